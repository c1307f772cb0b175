"""AsyncEngine: the LLMEngine loop on one background thread, beside the asyncio event loop.

The engine is not thread-safe, so every engine call happens on its thread. The event loop talks
to it through a thread-safe inbox (``call`` runs a function there and awaits its result; ``abort``
is fire-and-forget); each step's outputs come back in one ``loop.call_soon_threadsafe`` and are
routed to per-request streams (the latest snapshot and an ``asyncio.Event``). Everything on the
loop side (the stream table, metrics) is touched by the loop thread only.

The adapter name table lives here too: a request names its adapter, and the name is resolved on
the engine thread in the same command that adds the request, so a concurrent unload either happens
before (the request gets 404) or after (the request finishes on the old weights). Resolving on the
loop thread instead would let ``LLMEngine.add_request`` re-register an adapter just unloaded.

NOTE: on the CPU the engine's torch (OpenMP) threads compete with the event-loop thread for cores;
with as many torch threads as cores, both slow down a lot under load (OMP spin-waits). Fewer torch
threads than cores (``OMP_NUM_THREADS`` or ``torch.set_num_threads``) keep the loop responsive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from loraserve.daemon_worker import DaemonWorker
from loraserve.engine.engine import LLMEngine, RequestError
from loraserve.engine.worker import EngineDeadError  # the engine cannot go on; restart the server
from loraserve.lora.errors import UnknownAdapterError
from loraserve.lora.request import LoRARequest
from loraserve.outputs import RequestOutput
from loraserve.sampling import SamplingParams
from loraserve.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)
IDLE_HEALTH_CHECK_S = 1.0  # how often an idle engine thread checks that it can still serve


class RequestFailedError(RuntimeError):
    """The engine failed this request (a step raised, or its logits were not finite); others go on."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down: requests still running end with this error."""


class UnknownModelError(LookupError):
    """A request names a model that is neither the base model nor a loaded adapter."""


@dataclass
class GenRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


class AdapterTable:
    """Adapter name -> LoRARequest, with ids from a counter (an id is one set of weights).

    Mutated on the engine thread only; ``snapshot`` is a copy-on-write dict readers may keep.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def snapshot(self) -> dict[str, LoRARequest]:
        return self._by_name

    def new_request(self, name: str, path: str, lora_root: str | None = None) -> LoRARequest:
        return LoRARequest(name, next(self._ids), path, lora_root=lora_root)

    def load(
        self, engine: LLMEngine, name: str, path: str, req: LoRARequest | None = None, packed=None
    ) -> LoRARequest:
        """Register name -> path under a new id; a reload replaces the old id only once the new one parsed.

        ``packed``: the adapter already parsed off the engine thread (LoRAManager.prepare)."""
        if engine.lora_manager is None:
            raise RequestError("LoRA is disabled on this server; restart it with --enable-lora")
        req = req or self.new_request(name, path)
        engine.lora_manager.add_adapter(req, packed)  # validates; LoRAError leaves the old one in place
        old = self._by_name.get(name)
        self._by_name = {**self._by_name, name: req}
        if old is not None:
            engine.lora_manager.remove_adapter(old.lora_int_id)  # in-flight requests finish on it
        return req

    def unload(self, engine: LLMEngine, name: str) -> LoRARequest:
        old = self._by_name.get(name)
        if old is None:
            raise UnknownAdapterError(f"the LoRA adapter {name!r} is not loaded")
        self._by_name = {k: v for k, v in self._by_name.items() if k != name}
        engine.lora_manager.remove_adapter(old.lora_int_id)
        return old


class RequestStream:
    """The outputs of one HTTP request's engine requests (one per prompt), as they arrive.

    Iterating yields ``(prompt_index, RequestOutput)``; outputs are cumulative snapshots, and steps
    the reader did not get to in time are merged into the next one it sees.
    ``abort()`` (idempotent) aborts whatever has not finished and frees its KV blocks.
    """

    def __init__(self, owner: AsyncEngine, requests: list[GenRequest], arrival: float):
        self._owner = owner
        self.request_ids = [r.request_id for r in requests]
        self._n = {r.request_id: r.params.n for r in requests}
        request_ids = self.request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._pending = set(request_ids)
        # NOTE: outputs are cumulative snapshots, so only the latest per request is kept: a slow
        # reader gets bigger deltas instead of a queue that grows with every step.
        self._latest: dict[str, RequestOutput] = {}
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self._arrival = arrival
        self._progress: dict[tuple[str, int], tuple[int, float]] = {}  # (rid, seq) -> (tokens, time)

    @property
    def finished(self) -> bool:
        return not self._pending

    def _put(self, out: RequestOutput, now: float) -> None:
        m = self._owner.metrics
        for c in out.outputs:
            key = (out.request_id, c.index)
            ntok, last = self._progress.get(key, (0, self._arrival))
            new = len(c.token_ids) - ntok
            if new > 0:
                if ntok == 0:
                    m.ttft.observe(now - self._arrival)
                    if new > 1:
                        m.itl.observe(0.0, new - 1)
                else:
                    m.itl.observe((now - last) / new, new)
                m.generation_tokens += new
                self._progress[key] = (len(c.token_ids), now)
        if out.finished:
            self._pending.discard(out.request_id)
            for c in out.outputs:
                m.finished[c.finish_reason or "abort"] += 1
        if out.error is not None:  # the whole HTTP request fails: abort its other prompts
            self.abort()
            self._fail(RequestFailedError(out.error))
            return
        self._latest[out.request_id] = out
        self._wake.set()

    def _fail(self, exc: BaseException) -> None:
        self._pending.clear()
        self._error = exc
        self._wake.set()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        done = 0
        while done < len(self.request_ids):
            await self._wake.wait()
            self._wake.clear()
            if self._error is not None:
                raise self._error
            items, self._latest = self._latest, {}
            for rid, out in items.items():
                done += out.finished
                yield self._index[rid], out

    def abort(self) -> None:
        if self._pending:
            self._owner.metrics.finished["abort"] += sum(self._n[rid] for rid in self._pending)
            self._owner._abort(list(self._pending))
            self._pending.clear()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, base_names: set[str], metrics: ServerMetrics | None = None):
        self.engine = engine
        self.base_names = set(base_names)
        self.metrics = metrics or ServerMetrics()
        self.adapters = AdapterTable()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: BaseException | None = None
        # called on the loop thread once the engine cannot go on (the server exits non-zero)
        self.on_fatal: Callable[[], None] | None = None
        self._loader = DaemonWorker(
            "loraserve-adapter-load", lambda: ShuttingDownError("the server is shutting down")
        )
        self._loads: set[concurrent.futures.Future] = set()  # adapter parses queued or running there

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="loraserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop: running requests end with ``ShuttingDownError`` (streams get a clean end); the
        engine thread finishes its step and exits, waited for at most ``timeout`` seconds."""
        self.stop_streams()
        self._stopping = True
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def stop_streams_soon(self) -> None:
        """Any thread (a signal handler): ``stop_streams`` on the loop thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.stop_streams)

    def stop_streams(self) -> None:
        """Loop thread: end every running request and adapter load with ``ShuttingDownError``."""
        err = ShuttingDownError("the server is shutting down; retry on another replica or later")
        rids = list(self._streams)
        self._fail_all(err)
        if rids:
            self._inbox.put(("abort", rids))
        for fut in list(self._loads):
            try:
                fut.set_exception(err)
            except concurrent.futures.InvalidStateError:  # it finished meanwhile
                pass
        if self.engine.lora_manager is not None:
            self.engine.lora_manager.close()  # parses in flight stop at their next read
        self._loader.shutdown()

    def _in_daemon_thread(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """``fn(*args)`` on the adapter-load thread, awaitable from the loop; ``stop_streams`` ends the wait.

        NOTE: not ``asyncio.to_thread``: the default executor's threads are joined at interpreter exit,
        so a slow adapter parse would hold shutdown hostage; the loader's thread is a daemon, and runs
        one load at a time.
        """
        fut = self._loader.submit(fn, *args)
        self._loads.add(fut)
        fut.add_done_callback(self._loads.discard)
        return asyncio.wrap_future(fut)

    @property
    def alive(self) -> bool:
        """The loop runs and, under tensor parallelism, every worker is healthy."""
        loop_ok = self.dead is None and self._thread is not None and self._thread.is_alive()
        return loop_ok and self.engine.is_healthy()

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox(block=not engine.has_unfinished_requests())
                if self._stopping:
                    break
                engine.check_healthy()  # NOTE: also while idle: a tensor-parallel worker may die then
                if engine.has_unfinished_requests():
                    outs = engine.step()
                    if outs:
                        self._loop.call_soon_threadsafe(self._deliver, outs, time.monotonic())
        except BaseException as e:  # the engine cannot go on: fail every in-flight request, then exit
            logger.exception("the engine loop died")
            self.dead = e
            self._loop.call_soon_threadsafe(self._fatal, e)
            while True:  # answer pending calls so no caller hangs
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if cmd is not None and cmd[0] == "call":
                    cmd[2].set_exception(EngineDeadError(f"the engine stopped: {e!r}"))

    def _drain_inbox(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=IDLE_HEALTH_CHECK_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if cmd is None:
                self._stopping = True
                return
            kind = cmd[0]
            if kind == "abort":
                for rid in cmd[1]:
                    self.engine.abort_request(rid)
            else:  # ("call", fn, future)
                fn, fut = cmd[1], cmd[2]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.engine))
                    except EngineDeadError as e:  # e.g. add_request finding a dead worker: the loop ends
                        fut.set_exception(e)
                        raise
                    except Exception as e:
                        fut.set_exception(e)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    # ---- the loop side --------------------------------------------------------------------------
    def _deliver(self, outs: list[RequestOutput], now: float) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out, now)

    def _fatal(self, exc: BaseException) -> None:
        """/health already answers 503 (``alive`` is False); fail the streams, then stop the server."""
        self._fail_all(EngineDeadError(f"the engine stopped: {exc!r}"))
        if self.on_fatal is not None:
            self.on_fatal()

    def _fail_all(self, err: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream._fail(err)
        self._streams.clear()

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)
        self._inbox.put(("abort", request_ids))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread; its result or exception comes back here."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """None = the base model. Engine thread (or before start)."""
        if model is None or model in self.base_names:
            return None
        lora = self.adapters.snapshot().get(model)
        if lora is None:
            raise UnknownModelError(f"The model `{model}` does not exist.")
        return lora

    async def add(self, requests: list[GenRequest], model: str | None) -> RequestStream:
        """Add all requests (atomically: all or none) under the adapter ``model`` names; raises on errors."""
        stream = RequestStream(self, requests, time.monotonic())
        for r in requests:
            self._streams[r.request_id] = stream

        def add_all(engine: LLMEngine) -> None:
            lora = self.resolve(model)
            added = []
            try:
                for r in requests:
                    engine.add_request(r.request_id, r.prompt, r.params, r.prompt_token_ids, lora)
                    added.append(r.request_id)
            except BaseException:
                for rid in added:
                    engine.abort_request(rid)
                raise

        try:
            await self.call(add_all)
        except BaseException:
            # NOTE: also abort: if this task was cancelled after the engine thread began add_all, the
            # requests exist there; the inbox is FIFO, so this abort runs after them (a no-op otherwise).
            self._abort(stream.request_ids)
            stream._pending.clear()
            raise
        self.metrics.prompt_tokens += sum(len(r.prompt_token_ids) for r in requests)
        return stream

    async def load_adapter(self, name: str, path: str, lora_root: str | None = None) -> LoRARequest:
        """Parse ``path`` off the engine thread, then register it as ``name``; every later read of its
        files stays under ``lora_root`` (when given) and must find them as registration did."""
        req = self.adapters.new_request(name, path, lora_root)
        packed = None
        if self.engine.lora_manager is not None:
            # NOTE: parse on a worker thread, so a runtime load never stalls the step loop
            packed = await self._in_daemon_thread(self.engine.lora_manager.prepare, req)
        return await self.call(lambda engine: self.adapters.load(engine, name, path, req, packed))

    async def unload_adapter(self, name: str) -> LoRARequest:
        return await self.call(lambda engine: self.adapters.unload(engine, name))

    def load_adapter_now(self, name: str, path: str) -> LoRARequest:
        """Before ``start()`` only (startup adapters): nothing else touches the engine yet."""
        assert self._thread is None, "load_adapter_now() after start(); use await load_adapter()"
        return self.adapters.load(self.engine, name, path)
