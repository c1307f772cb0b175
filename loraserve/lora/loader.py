"""The LoRA manager's background parses: one daemon thread running them in order, with Futures.

A ``ThreadPoolExecutor``'s workers are joined at interpreter exit, so a parse in flight would hold up a
shutdown; this thread is a daemon, and parses stop early through the manager's cancel event.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from loraserve.lora.errors import LoRALoadCancelledError


class DaemonLoader:
    """``submit(fn, *args) -> Future``, run one at a time on a daemon thread started on first use;
    after ``shutdown()`` new submissions fail at once with LoRALoadCancelledError."""

    def __init__(self, name: str = "lora-loader"):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(
                    LoRALoadCancelledError("adapter loading is closed (the server is shutting down)")
                )
                return fut
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # the Future carries it to the step loop
                result, error = None, e
            else:
                error = None
            try:
                fut.set_exception(error) if error is not None else fut.set_result(result)
            except InvalidStateError:  # its waiter ended it already (a server shutting down)
                pass

    def shutdown(self) -> None:
        """Stop after the parses already queued (each ends at its next cancel check once the manager's
        cancel event is set); returns at once."""
        with self._lock:
            self._closed = True
            self._queue.put(None)
