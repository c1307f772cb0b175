"""LoRAManager: wraps the model's layers, owns the device slots and the host cache.

Tiers: registered adapters (disk paths) -> host cache of parsed, packed adapters (``max_cpu_loras``,
LRU) -> device slots (``max_loras``, LRU among adapters not needed by the current batch).
Verbs come in pairs: ``add_adapter / remove_adapter``, ``acquire / release`` (in-flight requests),
``pin / unpin``; ``prepare_slots`` makes every adapter of a batch resident (``prepare_mapping`` also builds its mapping).

Loading never blocks the step loop: a cold adapter (registered, not in the host cache) is parsed on
a worker thread; the scheduler's ``activate`` returns False until it is there, so its requests wait
while others run. Host->device slot writes go on a side CUDA stream (the forward waits on its event);
on the CPU they are plain copies. Host copies live in pinned memory on CUDA.

Removing an adapter while requests use it: those requests finish on the weights they started with;
the slot and host copy are freed when the last one ends; new requests get ``UnknownAdapterError``.
Re-adding a removed id before its last request ended is refused (use a new id): an id is one set of
weights: a re-read after a host-cache eviction must find the files registration read (real paths, sha256;
``files.py``), under the request's ``lora_root`` if any, or it fails that adapter's requests with
LoRAChangedError (``take_load_errors``). Re-reading keeps the host cache bounded by ``max_cpu_loras``.
``close()`` cancels parses in flight (``prepare`` on any thread too); the loader thread is a daemon.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from contextlib import nullcontext

import torch
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.daemon_worker import DaemonWorker
from loraserve.distributed.parallel_state import get_tp_size
from loraserve.lora.checks import check_magnitudes
from loraserve.lora.errors import (
    LoRAError,
    LoRAFormatError,
    LoRALoadCancelledError,
    LoRAShapeError,
    UnknownAdapterError,
)
from loraserve.lora.files import AdapterFiles
from loraserve.lora.layers import LORA_LAYER_CLASSES, BaseLayerWithLoRA, LogitsProcessorWithLoRA
from loraserve.lora.mapping import LoRATarget, find_lora_targets
from loraserve.lora.mixtures import combine_adapters
from loraserve.lora.packing import PackedAdapter, pack_adapter
from loraserve.lora.peft import load_adapter, store_adapter
from loraserve.lora.punica import LoRAMapping, PunicaWrapper
from loraserve.lora.request import LoRAMixture, LoRARequest
from loraserve.lora.slot_traits import SlotTraits

logger = logging.getLogger(__name__)


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, hf_config, device: torch.device):
        self.model = model
        model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self.model_dtype = model_dtype  # where the LoRA deltas land: the magnitude checks' output dtype
        # the LoRA weights' storage dtype, resolved once ("auto" by device and model dtype) for the layers'
        # slots and the host copies alike
        self.lora_dtype = config.resolved_dtype(device, model_dtype)
        self.config = dataclasses.replace(config, lora_dtype=self.lora_dtype)
        self.hf_config = hf_config
        self.device = device
        self.max_loras = config.max_loras
        self.punica = PunicaWrapper(config.max_loras, device)
        self._tp_size = get_tp_size()
        self.targets: dict[str, LoRATarget] = {}
        self.modules: dict[str, BaseLayerWithLoRA] = {}
        self._wrap_model()
        self._registered: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, PackedAdapter] = OrderedDict()  # LRU: oldest first
        self._slot_ids: list[int | None] = [None] * config.max_loras
        # what the steps' paths ask of a slot
        self._slot_traits = [SlotTraits() for _ in range(config.max_loras)]
        self._slot_lru: OrderedDict[int, None] = OrderedDict()  # resident ids, least recently used first
        self._refs: Counter[int] = Counter()
        self._pinned: set[int] = set()
        # removed while in use: kept until released (the error instead, if its files could not be re-read)
        self._removed: dict[int, PackedAdapter | LoRAError] = {}
        self._sources: dict[int, tuple[AdapterFiles, ...]] = {}  # what registration read: re-reads must match
        self._loading: dict[int, Future] = {}  # disk -> host parses in flight
        self._load_errors: dict[int, Exception] = {}
        self._closing = threading.Event()  # set by close(): parses stop at their next check
        self._loader = DaemonWorker("lora-loader", _loads_closed)
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._slot_ready: dict[int, object] = {}  # slot -> CUDA event of its last write
        self.stats: Counter[str] = Counter()

    # ---- wrapping -------------------------------------------------------------------------------
    def _wrap_model(self) -> None:
        targets, self._restricted = find_lora_targets(self.model, self.config.lora_target_modules)
        for t in targets:
            cls = next(
                (
                    c
                    for c in LORA_LAYER_CLASSES
                    if c.can_replace_layer(t.module, self.config, t.packed, self.hf_config)
                ),
                None,
            )
            if cls is None:
                continue
            if cls is LogitsProcessorWithLoRA:
                wrapper = cls(t.module, self.hf_config.hidden_size, self.device)
            else:
                wrapper = cls(t.module)
            wrapper.create_lora_weights(self.max_loras, self.config, self.hf_config)
            wrapper.set_mapping(self.punica)
            _set_submodule(self.model, t.path, wrapper)
            self.targets[t.path] = t
            self.modules[t.path] = wrapper

    # ---- registration ---------------------------------------------------------------------------
    def prepare(self, req: LoRARequest) -> PackedAdapter:
        """Parse and validate an adapter without registering it. Safe off the engine thread (it only
        reads the model), so servers parse on a worker and hand the result to ``add_adapter``."""
        return self._pack(req)

    def add_adapter(self, req: LoRARequest, packed: PackedAdapter | None = None) -> bool:
        """Register (parse + validate now, unless ``packed`` from ``prepare``). False if already registered."""
        if req.lora_int_id in self._removed:
            raise LoRAFormatError(
                f"lora_int_id {req.lora_int_id} was removed but {self._refs[req.lora_int_id]} request(s) still use "
                f"its old weights; register the new weights under a new lora_int_id"
            )
        old = self._registered.get(req.lora_int_id)
        # a reference by id to an adapter registered earlier
        if not req.lora_path and not isinstance(req, LoRAMixture):
            if old is None:
                raise UnknownAdapterError(
                    f"unknown adapter {req.lora_name!r} (id {req.lora_int_id}): it was removed or never added; "
                    f"add it with add_lora(LoRARequest(name, id, path))"
                )
            return False
        if old is not None:
            if old == req:
                return False
            raise LoRAFormatError(
                f"lora_int_id {req.lora_int_id} is already used by adapter {old.lora_name!r} ({old.lora_path}); "
                f"new weights need a new lora_int_id"
            )
        if packed is None or packed.request != req:
            packed = self._pack(req)
        self._registered[req.lora_int_id] = req
        self._sources[req.lora_int_id] = packed.adapter.sources
        self._host_put(req.lora_int_id, packed)
        self.stats["registered"] += 1
        return True

    def remove_adapter(self, lora_int_id: int) -> bool:
        req = self._registered.pop(lora_int_id, None)
        if req is None:
            return False
        self._pinned.discard(lora_int_id)
        packed = self._host.pop(lora_int_id, None)
        if self._refs[lora_int_id] > 0:
            # in-flight requests finish on these weights; freed (with its sources) at the last release()
            if packed is None:
                try:
                    packed = self._pack(req, self._sources.get(lora_int_id))
                except LoRAError as e:  # its requests fail with this if they need the weights again
                    packed = e
            self._removed[lora_int_id] = packed
        else:
            self._free_slot(lora_int_id)
            self._sources.pop(lora_int_id, None)
        return True

    def close(self) -> None:
        """Cancel adapter parses in flight (they end with LoRALoadCancelledError at their next check) and
        stop the loader thread; idempotent. Loads asked for afterwards fail the same way."""
        self._closing.set()
        self._loader.shutdown()

    def registered_files(self, lora_int_id: int) -> tuple[AdapterFiles, ...] | None:
        """What registration read for this id: any re-read must match it (a tensor-parallel worker's too)."""
        return self._sources.get(lora_int_id)

    def list_adapters(self) -> list[int]:
        return sorted(self._registered)

    def get_request(self, lora_int_id: int) -> LoRARequest:
        if lora_int_id not in self._registered:
            raise UnknownAdapterError(f"unknown adapter id {lora_int_id}; register it with add_lora first")
        return self._registered[lora_int_id]

    def pin(self, lora_int_id: int) -> bool:
        """Keep this adapter in the host cache and, once loaded, in its device slot."""
        self.get_request(lora_int_id)
        if lora_int_id not in self._pinned and len(self._pinned) >= self.max_loras - 1:
            raise LoRAFormatError(
                f"cannot pin adapter {lora_int_id}: {len(self._pinned)} of max_loras={self.max_loras} slots are "
                f"pinned and one must stay free; unpin one or raise --max-loras"
            )
        self._pinned.add(lora_int_id)
        return True

    def pinned_resident(self) -> set[int]:
        return {i for i in self._pinned if i in self._slot_lru}

    def unpin(self, lora_int_id: int) -> bool:
        self._pinned.discard(lora_int_id)
        return True

    # ---- in-flight reference counts -------------------------------------------------------------
    def acquire(self, lora_int_id: int) -> None:
        if lora_int_id not in self._registered:
            raise UnknownAdapterError(f"unknown adapter id {lora_int_id}; it was removed or never added")
        self._refs[lora_int_id] += 1

    def release(self, lora_int_id: int) -> None:
        self._refs[lora_int_id] -= 1
        if self._refs[lora_int_id] <= 0:
            del self._refs[lora_int_id]
            if lora_int_id in self._removed:
                del self._removed[lora_int_id]
                self._sources.pop(lora_int_id, None)
                self._free_slot(lora_int_id)

    def in_use(self, lora_int_id: int) -> bool:
        return self._refs[lora_int_id] > 0

    # ---- tiers ----------------------------------------------------------------------------------
    def _host_put(self, lid: int, packed: PackedAdapter) -> None:
        self._host[lid] = packed
        self._host.move_to_end(lid)
        while len(self._host) > self.config.max_cpu_loras:
            victim = next((i for i in self._host if i not in self._pinned and i != lid), None)
            if victim is None:
                break
            del self._host[victim]
            self.stats["host_evictions"] += 1

    def _host_lookup(self, lid: int) -> PackedAdapter | None:
        """The host copy if present; otherwise start (or collect) the background parse and return None."""
        if lid in self._removed:
            packed = self._removed[lid]
            if isinstance(packed, LoRAError):
                self._load_errors[lid] = packed
                return None
            return packed
        if lid in self._load_errors:  # a failed reload not reported yet: reported before trying again
            return None
        if lid in self._host:
            self._host.move_to_end(lid)
            return self._host[lid]
        fut = self._loading.get(lid)
        if fut is None:
            req = self.get_request(lid)
            self._loading[lid] = self._loader.submit(self._pack, req, self._sources.get(lid))
            return None
        if not fut.done():
            return None
        del self._loading[lid]
        try:
            packed = fut.result()
        except Exception as e:  # the files changed on disk since registration, or a shutdown cancelled it
            logger.error("reloading adapter %d failed: %s", lid, e)
            self._load_errors[lid] = e
            return None
        if lid not in self._registered:  # removed while loading
            return None
        self.stats["disk_loads"] += 1
        self._host_put(lid, packed)
        return packed

    def take_load_errors(self) -> dict[int, Exception]:
        """Failed background reloads (reported once, so the engine can fail their requests)."""
        errors, self._load_errors = self._load_errors, {}
        return errors

    def wait_for_loads(self, timeout: float = 0.05) -> None:
        """Block briefly on an in-flight parse (used only when nothing else can run)."""
        fut = next(iter(self._loading.values()), None)
        if fut is not None:
            with contextlib.suppress(FuturesTimeout):  # still parsing: the caller just tries again
                fut.exception(timeout=timeout)

    def _host_get(self, lid: int) -> PackedAdapter:
        """The host copy, parsing synchronously if needed (only for paths off the step loop)."""
        packed = self._host_lookup(lid)
        if packed is None:
            fut = self._loading.get(lid)
            if fut is not None:
                fut.exception()
            packed = self._host_lookup(lid)
        if packed is None:
            err = self._load_errors.pop(lid, None)
            raise err or UnknownAdapterError(f"unknown adapter id {lid}")
        return packed

    def activate(self, lid: int, protected: set[int]) -> bool:
        """Scheduler hook: True once ``lid`` holds a slot (evicting none of ``protected``); False = wait."""
        if lid in self._slot_lru:
            self._slot_lru.move_to_end(lid)
            return True
        if None not in self._slot_ids and self._evictable(protected) is None:
            return False
        packed = self._host_lookup(lid)
        if packed is None:
            return False
        self._write_slot(lid, packed, protected)
        return True

    def _free_slot(self, lid: int) -> None:
        if lid in self._slot_lru:
            self._empty_slot(self._slot_ids.index(lid))
            del self._slot_lru[lid]

    def write_modules(self, slot: int, packed: PackedAdapter) -> None:
        """Every module's slot ``slot`` from ``packed`` (zeros in the modules it does not target): what a slot load
        writes, here and on the tensor-parallel workers (into the slot rank 0 chose)."""
        lm_head = getattr(getattr(self.model, "lm_head", None), "weight", None)
        for path, m in self.modules.items():
            pack = packed.per_module.get(path)
            if pack is None:
                m.reset_lora(slot)
            else:
                pack.write(m, slot, lm_head)

    def _empty_slot(self, slot: int) -> None:
        """Every module's slot zeroed, the slot listed empty and its flags as an empty slot's."""
        for m in self.modules.values():
            m.reset_lora(slot)
        self._slot_ids[slot] = None
        self._slot_traits[slot] = SlotTraits()

    def slots_have_vocab_lora(self, slots: list[int]) -> bool:
        """Whether any of these slots (-1 = base) holds an adapter with an embedding or lm_head A/B: a CUDA graph's
        key (``LoRAMapping.vocab_lora``; without one, the graph skips those deltas). One flag per slot."""
        return any(self._slot_traits[s].vocab_lora for s in set(slots) if s >= 0)

    def slots_a_exact_in_w(self, slots: list[int]) -> bool:
        """Whether every one of these slots (-1 = base) has its row-parallel layers' A exactly in their weights' dtype:
        a CUDA graph's key (``LoRAMapping.a_exact_in_w``; with it, the GEMMs that compute a shrink read one piece
        of A). One flag per slot."""
        return all(self._slot_traits[s].a_exact_in_w for s in set(slots) if s >= 0)

    def slots_have_extras(self, slots: list[int]) -> bool:
        """Whether any of these slots (-1 = base) holds an adapter with PEFT extras: such steps run
        eagerly (see BaseLayerWithLoRA.slot_has_extras). Cheap: one flag per slot, set when written."""
        return any(self._slot_traits[s].extras for s in set(slots) if s >= 0)

    def slot_of(self, lid: int) -> int | None:
        return self._slot_ids.index(lid) if lid in self._slot_lru else None

    def slot_requests(self) -> list[LoRARequest | None]:
        """Per device slot, the adapter it holds (None = empty): what tensor-parallel workers mirror."""
        out: list[LoRARequest | None] = []
        for lid in self._slot_ids:
            removed = self._removed.get(lid) if lid is not None else None
            held = removed.request if isinstance(removed, PackedAdapter) else None
            out.append(None if lid is None else self._registered.get(lid) or held)
        return out

    def _evictable(self, protected: set[int]) -> int | None:
        """LRU resident adapter that no running request uses and that is not pinned."""
        return next((i for i in self._slot_lru if i not in protected and i not in self._pinned), None)

    def _write_slot(self, lid: int, packed: PackedAdapter, protected: set[int]) -> int:
        if None in self._slot_ids:
            slot = self._slot_ids.index(None)
        else:
            victim = self._evictable(protected)
            if victim is None:
                raise RuntimeError(f"a batch needs more than max_loras={self.max_loras} adapters")
            slot = self._slot_ids.index(victim)
            del self._slot_lru[victim]
            self.stats["slot_evictions"] += 1
        stream = torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else nullcontext()
        try:
            with stream:
                self.write_modules(slot, packed)
        except Exception:
            # a module refused the adapter (its error goes on to the caller): the slot is left empty, not half
            # written nor still listed under the adapter it evicted
            with stream:
                self._empty_slot(slot)
            raise
        if self._copy_stream is not None:
            ev = torch.cuda.Event()
            ev.record(self._copy_stream)
            self._slot_ready[slot] = ev
        self._slot_ids[slot] = lid
        self._slot_traits[slot] = SlotTraits.of(slot, self.modules.values())
        self._slot_lru[lid] = None
        self.stats["slot_loads"] += 1
        return slot

    def _ensure_slot(self, lid: int, protected: set[int]) -> int:
        if lid in self._slot_lru:
            self._slot_lru.move_to_end(lid)
            return self._slot_ids.index(lid)
        return self._write_slot(lid, self._host_get(lid), protected)

    def prepare_slots(
        self, token_lora_ids: list[int], logit_lora_ids: list[int]
    ) -> tuple[list[int], list[int]] | None:
        """Make the batch's adapters resident: (slot per token, slot per logits row), -1 = base; None
        when the batch has no adapter. Cheap (lists only): a CUDA-graph step needs no more."""
        needed = set(token_lora_ids) | set(logit_lora_ids)
        needed.discard(0)
        if not needed:
            return None
        slots = {lid: self._ensure_slot(lid, needed) for lid in needed}
        for slot in slots.values():
            ev = self._slot_ready.pop(slot, None)
            if ev is not None:  # the forward waits for the side-stream copy on the GPU, not the CPU
                torch.cuda.current_stream(self.device).wait_event(ev)
        slots[0] = -1
        return [slots[i] for i in token_lora_ids], [slots[i] for i in logit_lora_ids]

    def prepare_mapping(self, token_lora_ids: list[int], logit_lora_ids: list[int]) -> LoRAMapping | None:
        """``prepare_slots``, then the batch's LoRAMapping (device tensors) for an eager forward."""
        slots = self.prepare_slots(token_lora_ids, logit_lora_ids)
        return None if slots is None else LoRAMapping.build(*slots, self.device)

    @property
    def num_resident(self) -> int:
        return len(self._slot_lru)

    @property
    def num_host_cached(self) -> int:
        return len(self._host)

    # ---- packing and validation -----------------------------------------------------------------
    def _load(
        self, req: LoRARequest, dtype: torch.dtype | None = None, expect: Iterator[AdapterFiles] | None = None
    ):
        """The adapter of ``req`` with its LoRA pairs in ``dtype`` (the storage dtype if None). A mixture
        combines its components in fp32 (ties / DARE merge elementwise, which fp16 balancing would change)
        and is stored after. ``expect`` yields what an earlier read saw, per adapter dir in read order; a
        component named by id must match its own registration."""
        dtype = dtype or self.lora_dtype
        if isinstance(req, LoRAMixture):
            parts = [self._load(r, torch.float32, expect) for r, _ in req.components]
            mixed = combine_adapters(
                req.lora_name,
                parts,
                [w for _, w in req.components],
                req.combination,
                self.config.max_lora_rank,
                req.density,
                req.seed,
            )
            mixed = dataclasses.replace(
                store_adapter(mixed, dtype), sources=sum((p.sources for p in parts), ())
            )
            # the components' weights can add up past the bound
            check_magnitudes(mixed, dtype, self.model_dtype, self._closing)
            return mixed
        if not req.lora_path and req.lora_int_id in self._registered:  # a component named by id
            own = self._sources.get(req.lora_int_id)
            adapter = self._load(self._registered[req.lora_int_id], dtype, iter(own) if own else None)
            for _ in adapter.sources if expect is not None else ():
                next(expect, None)  # keep the outer expectations aligned with the dirs read
            return adapter
        return load_adapter(
            req.lora_path, req.lora_name, self.config.max_lora_rank, dtype,
            out_dtype=self.model_dtype, root=req.lora_root,
            expect=next(expect, None) if expect is not None else None,
            # the largest file whose stored adapter can fit max_adapter_bytes: fp64 in the file, fp16 stored
            max_weights_bytes=4 * self.config.max_adapter_bytes, cancel=self._closing,
        )  # fmt: skip

    def _pack(self, req: LoRARequest, expect: tuple[AdapterFiles, ...] | None = None) -> PackedAdapter:
        """Parse, check and lay out ``req``'s adapter; ``expect``: what registration read (a re-read)."""
        adapter = self._load(req, None, iter(expect) if expect else None)
        if adapter.nbytes > self.config.max_adapter_bytes:
            raise LoRAShapeError(
                f"adapter {req.lora_name!r} ({req.lora_path}) is {adapter.nbytes} bytes > the limit "
                f"{self.config.max_adapter_bytes}; raise max_adapter_bytes"
            )
        packed = pack_adapter(
            req, adapter, self.model, self.targets, self.modules, self._restricted, self._tp_size
        )
        if self.device.type == "cuda":  # pinned host memory: the slot copies run async on the side stream
            for mp in packed.per_module.values():
                mp.a = [t if t is None else t.pin_memory() for t in mp.a]
                mp.b = [t if t is None else t.pin_memory() for t in mp.b]
        return packed


def _loads_closed() -> LoRALoadCancelledError:
    return LoRALoadCancelledError("adapter loading is closed (the server is shutting down)")
