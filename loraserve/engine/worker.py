"""Tensor parallelism on one host: rank 0 runs the engine, ranks 1..N-1 follow its steps.

Launch, from ``LLMEngine`` (``start_tensor_parallel``), before the model is built:
- ``LLM(..., tensor_parallel_size=N)`` spawns N-1 worker processes (torch.multiprocessing, 'spawn':
  a script that builds an LLM needs the ``if __name__ == "__main__":`` guard);
- under ``torchrun --nproc-per-node N`` (WORLD_SIZE/RANK set), rank 0 returns and runs the engine;
  ``LLM(...)`` on the other ranks serves rank 0 and exits the process when rank 0 shuts down.

Each step, rank 0 (``TPWorkers.send_step``, the model runner's ``on_step`` hook) broadcasts one
message over the gloo control group: the step's prepared inputs (``PreparedStep``, plain lists) and
the LoRA slot writes its manager made since the last step, as ops (``("set", slot, LoRARequest)`` /
``("reset", slot)``). Every rank then runs the same forward; the collectives inside meet. Workers
keep a LoRAManager replica that loads the same adapter paths and writes its own shard (set_lora ->
slice_lora_a/b). Only rank 0 schedules and samples (the gathered logits are the same on every rank).

Failure: a worker that raises reports its error through a queue and exits; rank 0 checks the
workers' liveness before each step, and the collectives time out (``distributed_timeout_s``), so a
dead or hung worker makes ``step`` raise ``EngineDeadError`` in bounded time, never hang.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import traceback
from collections import OrderedDict
from pathlib import Path

import torch

from loraserve.config import ConfigError, EngineConfig, resolve_dtype
from loraserve.distributed.comm import broadcast_object
from loraserve.distributed.parallel_state import (
    EngineDeadError,
    get_failure,
    get_tp_size,
    init_distributed,
    mark_failed,
    set_failure_reporter,
    shutdown_distributed,
)

logger = logging.getLogger(__name__)

__all__ = ["EngineDeadError", "TPWorkers", "start_tensor_parallel"]


def _device_for(config: EngineConfig, local_rank: int) -> torch.device:
    dev = torch.device(config.model.device)
    return torch.device("cuda", local_rank) if dev.type == "cuda" else dev


_ACTIVE: list[TPWorkers] = []  # this process's TP group, if any (emptied by its shutdown)


def start_tensor_parallel(config: EngineConfig, model_dir) -> TPWorkers | None:
    """Set up the TP group for this engine. None at TP=1. Under torchrun, ranks > 0 never return."""
    if _ACTIVE and not _ACTIVE[0].attached:  # left behind by an engine whose construction failed
        _ACTIVE[0].shutdown()
    if get_tp_size() != 1:
        raise RuntimeError(
            "a tensor-parallel engine is already running in this process; shut it down (LLM.shutdown()) first"
        )
    tp = config.parallel.tensor_parallel_size
    env = config.env
    if env.world_size is not None and env.world_size > 1:  # under torchrun
        if env.world_size != tp:
            raise ConfigError(
                f"running under torchrun with WORLD_SIZE={env.world_size} but tensor_parallel_size={tp}; "
                f"pass tensor_parallel_size={env.world_size} (one rank per TP shard)"
            )
        device = _device_for(config, env.local_rank or 0)
        init_distributed(env.rank, tp, "env://", _backend(device), config.parallel.distributed_timeout_s)
        if env.rank == 0:
            return TPWorkers(config, procs=[], errors=None)
        try:
            Worker(config, model_dir, device).serve()
        finally:
            shutdown_distributed()
        raise SystemExit(0)
    if tp == 1:
        return None
    device = _device_for(config, 0)
    if device.type == "cuda" and torch.device(config.model.device).index not in (None, 0):
        raise ConfigError(
            f"with tensor parallelism rank r uses cuda:r; pass device='cuda', not {config.model.device!r}"
        )
    if device.type == "cuda" and torch.cuda.device_count() < tp:
        raise ConfigError(
            f"tensor_parallel_size={tp} needs {tp} GPUs, this host has {torch.cuda.device_count()}"
        )
    return TPWorkers.spawn(config, model_dir, device)


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _joined_key(rank: int) -> str:
    return f"loraserve/joined/{rank}"


class TPWorkers:
    """Rank 0's handle on the workers: broadcasts steps, mirrors LoRA slots, watches liveness."""

    def __init__(self, config: EngineConfig, procs: list, errors):
        self.config = config
        self.procs = procs  # spawned worker processes, rank i + 1 (empty under torchrun)
        self.errors = errors  # queue of (rank, message) the workers report before they exit
        self.lora_manager = None
        self._mirrored: list = []  # per slot, the LoRARequest the workers hold
        self._reported: dict[int, str] = {}
        self._failure: EngineDeadError | None = None
        self._closed = False
        self.attached = False
        _ACTIVE[:] = [self]
        atexit.register(self.shutdown)

    @classmethod
    def spawn(cls, config: EngineConfig, model_dir, device: torch.device) -> TPWorkers:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        tp = config.parallel.tensor_parallel_size
        ctx = mp.get_context("spawn")
        errors = ctx.Queue()
        # rank 0 serves the rendezvous store (port 0: the OS picks a free one)
        store = dist.TCPStore("127.0.0.1", 0, tp, is_master=True, wait_for_workers=False)
        procs = []
        for rank in range(1, tp):
            p = ctx.Process(
                target=_spawned_worker,
                args=(rank, tp, store.port, config, str(model_dir), errors, os.getpid()),
                name=f"loraserve-tp-worker-{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        workers = cls(config, procs, errors)
        try:
            workers._wait_joined(store)
            init_distributed(
                0, tp, None, _backend(device), config.parallel.distributed_timeout_s, store=store
            )
        except Exception as e:
            err = workers.failure() or EngineDeadError(f"tensor-parallel workers did not join: {e}")
            workers._failure = err  # no shutdown message, no wait: kill them
            workers.shutdown()
            raise err from e
        return workers

    def _wait_joined(self, store, timeout_s: float = 300.0) -> None:
        """Until every worker reached the rendezvous; a worker that dies while starting fails this at once."""
        keys = [_joined_key(rank) for rank in range(1, len(self.procs) + 1)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            err = self.failure()
            if err is not None:
                raise err
            if time.monotonic() > deadline:
                raise EngineDeadError(f"tensor-parallel workers did not start within {timeout_s:.0f}s")
            time.sleep(0.05)

    # ---- engine side ----------------------------------------------------------------------------
    def attach(self, runner, lora_manager, num_blocks: int) -> None:
        """Tell the workers the KV cache size (they build theirs) and follow the runner's steps."""
        self.lora_manager = lora_manager
        self.attached = True
        set_failure_reporter(self.failure)
        if lora_manager is not None:
            self._mirrored = [None] * lora_manager.max_loras
        # NOTE: a long wait: the workers may still be loading their shards of the model
        self._broadcast(
            ("init", num_blocks), timeout_s=max(600.0, self.config.parallel.distributed_timeout_s)
        )
        runner.on_step = self.send_step

    def send_step(self, step) -> None:
        err = self.failure()
        if err is not None:
            raise err
        self._broadcast(("step", self._lora_ops(), step))

    def _broadcast(self, msg: tuple, timeout_s: float | None = None) -> None:
        try:
            broadcast_object(msg, timeout_s=timeout_s)
        except EngineDeadError:  # before attach() there is no reporter: add the workers' errors here
            raise self.failure() from None

    def _lora_ops(self) -> list[tuple]:
        """The slot writes rank 0's manager made since the last step, as ops the workers replay."""
        if self.lora_manager is None:
            return []
        current = self.lora_manager.slot_requests()
        ops = [
            ("reset", slot)
            if new is None
            else ("set", slot, new, self.lora_manager.registered_files(new.lora_int_id))
            for slot, (old, new) in enumerate(zip(self._mirrored, current))
            if old != new
        ]
        self._mirrored = current
        return ops

    def failure(self) -> EngineDeadError | None:
        """Why the TP group cannot run a step (a worker exited, a collective failed), or None."""
        if self._failure is not None:
            return self._failure
        if self._closed:
            return EngineDeadError("the engine was shut down")
        collective = get_failure()
        dead = [(i + 1, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
        if collective is None and not dead:
            return None
        if collective is not None and not dead:  # a worker that just died may not be reaped yet
            for p in self.procs:
                p.join(timeout=0.5)
            dead = [(i + 1, p) for i, p in enumerate(self.procs) if p.exitcode is not None]
        self._drain_errors()
        parts = []
        for rank, p in dead:
            why = self._reported.get(rank)
            parts.append(
                f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                + (f": {why}" if why else "")
            )
        if collective is not None:
            parts.append(str(collective))
        self._failure = EngineDeadError(
            "tensor-parallel engine is dead: " + "; ".join(parts) + ". Restart the engine."
        )
        mark_failed(self._failure)
        return self._failure

    def is_healthy(self) -> bool:
        return self.failure() is None

    def _drain_errors(self) -> None:
        if self.errors is None:
            return
        while True:
            try:
                rank, msg = self.errors.get(timeout=0.2)
            except Exception:
                return
            self._reported[rank] = msg

    def shutdown(self) -> None:
        """End the workers (a shutdown message; killed if they do not exit) and leave the group."""
        if self._closed:
            return
        healthy = self.failure() is None
        self._closed = True
        atexit.unregister(self.shutdown)
        if healthy:
            try:
                broadcast_object(("shutdown",))
            except EngineDeadError:
                pass
        deadline = time.monotonic() + (10.0 if healthy else 0.0)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        shutdown_distributed()
        if self.errors is not None:
            self.errors.close()
        if _ACTIVE and _ACTIVE[0] is self:
            _ACTIVE.clear()


# ---- worker side ------------------------------------------------------------------------------------
class Worker:
    """A rank > 0: the same model (its shards), a LoRA replica and a KV cache; runs rank 0's steps."""

    def __init__(self, config: EngineConfig, model_dir, device: torch.device):
        from transformers import AutoConfig

        from loraserve.models.loader import build_model

        self.config = config
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        mc = config.model
        model_dir = Path(model_dir)
        hf_config = AutoConfig.from_pretrained(str(model_dir))
        self.dtype = resolve_dtype(mc.dtype, getattr(hf_config, "dtype", None), device)
        torch.manual_seed(mc.seed)
        self.model = build_model(hf_config, model_dir, device, self.dtype, mc.load_format, mc.seed)
        self.lora_manager = None
        if config.lora is not None:
            from loraserve.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, config.lora, hf_config, device)
        self._packed: OrderedDict = OrderedDict()  # LoRARequest -> PackedAdapter, LRU
        self.runner = None

    def serve(self) -> None:
        """Follow rank 0's messages until it sends shutdown."""
        from loraserve.engine.kv_cache import BlockManager
        from loraserve.engine.model_runner import ModelRunner

        while True:
            msg = broadcast_object()
            kind = msg[0]
            if kind == "shutdown":
                return
            if kind == "init":
                blocks = BlockManager(msg[1], self.config.cache.block_size)
                self.runner = ModelRunner(self.model, blocks, self.dtype, self.device, self.lora_manager)
            elif kind == "step":
                _, ops, step = msg
                for op in ops:
                    self._apply_lora_op(op)
                self.runner.execute(step)
            else:
                raise RuntimeError(f"unknown message from rank 0: {kind!r}")

    def _apply_lora_op(self, op: tuple) -> None:
        m = self.lora_manager
        if op[0] == "reset":
            for module in m.modules.values():
                module.reset_lora(op[1])
            return
        _, slot, req, files = op
        # parse + check + lay out, as rank 0 did; the files must be the ones rank 0 registered
        packed = self._packed.pop(req, None) or m._pack(req, files)
        self._packed[req] = packed
        while len(self._packed) > m.config.max_cpu_loras:
            self._packed.popitem(last=False)
        m.write_modules(slot, packed)  # the same writes as rank 0's, into the slot it chose


def _watch_parent(parent_pid: int) -> None:
    """A spawned worker outlives nothing: exit when rank 0's process is gone."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


def _spawned_worker(
    rank: int,
    world_size: int,
    store_port: int,
    config: EngineConfig,
    model_dir: str,
    errors,
    parent_pid: int,
) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        device = _device_for(config, rank)
        if device.type == "cpu":  # the ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False)
        store.set(_joined_key(rank), "1")
        timeout = config.parallel.distributed_timeout_s
        init_distributed(rank, world_size, None, _backend(device), timeout, store=store)
        Worker(config, model_dir, device).serve()
        shutdown_distributed()
    except BaseException as e:  # report to rank 0, then exit at once: our sockets close, its collectives fail
        logger.error("tensor-parallel worker rank %d failed:\n%s", rank, traceback.format_exc())
        try:
            errors.put((rank, f"{type(e).__name__}: {e}"))
            errors.close()
            errors.join_thread()
        finally:
            os._exit(1)
