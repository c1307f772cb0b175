"""One daemon thread running jobs in order, with Futures: the LoRA manager's adapter parses, the server's
adapter loads and its large-body preparation each have one.

A ``ThreadPoolExecutor``'s workers are joined at interpreter exit, so a job in flight would hold up a
shutdown; this thread is a daemon. A job whose Future was cancelled before it started is skipped, and
one whose waiter ended it (a server shutting down) finishes unheard.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError


class DaemonWorker:
    """``submit(fn, *args) -> Future``, run one at a time on a daemon thread started on first use;
    after ``shutdown()`` new submissions fail at once with ``closed_error()``."""

    def __init__(self, name: str, closed_error: Callable[[], Exception]):
        self._name = name
        self._closed_error = closed_error
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(self._closed_error())
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
