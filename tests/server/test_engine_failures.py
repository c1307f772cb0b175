"""An error inside the engine fails the requests of that step, not the server; if the engine cannot
go on, /health turns 503 and the process exits non-zero; a signal ends the server in bounded time.

Each test runs its own server (``make_server``, the one ``loraserve serve`` runs) on the tiny model,
with a fault put into the engine's forward.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest
from conftest import make_engine

from loraserve.server.app import ServerConfig, build_app
from loraserve.server.cli_serve import exit_status, make_server

BODY = {"model": "a0", "prompt": "t5 t9 t13", "max_tokens": 8, "temperature": 0}


class Served:
    """``make_server``'s server on a free port, in a thread; ``status`` is its exit status once it stopped."""

    def __init__(self, files):
        config = ServerConfig(lora_modules=[("a0", str(files.a0))])
        self.app = build_app(make_engine(files.base).engine, config)
        self.server = make_server(self.app, "127.0.0.1", 0, "warning")
        self.status: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.server.run()
        self.status = exit_status(self.app)

    def __enter__(self) -> Served:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    @property
    def runner(self):
        return self.app.state.server.engine.engine.runner

    def fail_forward(self, monkeypatch, when) -> None:
        """Forward call number k (counted from now) raises when ``when(k)``."""
        real, calls = self.runner.forward, iter(range(1, 10**6))

        def forward(*args, **kw):
            if when(next(calls)):
                raise RuntimeError("injected forward failure")
            return real(*args, **kw)

        monkeypatch.setattr(self.runner, "forward", forward)

    def stop(self, timeout: float = 15.0) -> float:
        """Wait for the server to stop by itself; the seconds it took."""
        t0 = time.monotonic()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not stop"
        return time.monotonic() - t0


def completion(url: str, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={**BODY, **kw}, timeout=30)


def stream_events(url: str, **kw) -> list:
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True, **kw}, timeout=30) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_failing_step_fails_its_request_with_500_and_the_server_serves_on(files, monkeypatch):
    with Served(files) as s:
        before = completion(s.url).json()["choices"][0]["text"]
        s.fail_forward(monkeypatch, lambda k: k == 1)
        r = completion(s.url)
        assert r.status_code == 500
        err = r.json()["error"]
        assert "injected forward failure" in err["message"] and err["type"] == "InternalServerError"
        s.fail_forward(monkeypatch, lambda k: k == 2)  # a decode step of a stream
        events = stream_events(s.url)
        assert events[-1] == "[DONE]"
        assert "injected forward failure" in json.loads(events[-2])["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 200
        monkeypatch.undo()
        after = completion(s.url)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
    assert s.status == 0


def test_an_engine_that_cannot_go_on_turns_unhealthy_and_exits_non_zero(files, monkeypatch):
    """As when a tensor-parallel worker dies mid-step (the engine's own "two failures in a row" rule
    is tested in tests/engine/test_failure_isolation.py)."""
    from loraserve.engine.worker import EngineDeadError

    with Served(files) as s:

        def dead(*args, **kw):
            raise EngineDeadError("injected: a worker died")

        monkeypatch.setattr(s.runner, "forward", dead)
        r = completion(s.url)
        assert r.status_code == 503 and "a worker died" in r.json()["error"]["message"]
        # /health turns 503 before the server goes: seen at once (the engine is marked dead first)
        health = httpx.get(s.url + "/health", timeout=5)
        assert health.status_code == 503 and "a worker died" in health.json()["error"]["message"]
        s.stop()
    assert s.status == 1


def test_a_signal_ends_running_streams_cleanly_and_the_server_in_bounded_time(files, monkeypatch):
    with Served(files) as s:
        real = s.runner.forward

        def slow(*args, **kw):
            time.sleep(0.05)
            return real(*args, **kw)

        monkeypatch.setattr(s.runner, "forward", slow)
        events: list = []
        first = threading.Event()

        def read() -> None:
            body = {**BODY, "stream": True, "max_tokens": 100, "ignore_eos": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30), "the stream never started"
        s.server.handle_exit(signal.SIGINT, None)
        took = s.stop()
        reader.join(10)
    assert took < 10
    assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
    assert s.status == 0


SERVE_WITH_A_HUNG_LOAD = textwrap.dedent(
    """
    import sys, time
    from loraserve.lora.manager import LoRAManager
    LoRAManager.prepare = lambda self, req: time.sleep(3600)  # an adapter load that never ends
    from loraserve.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_stops_the_process_while_an_adapter_load_hangs(files):
    args = ["serve", str(files.base), "--port", "0", "--max-model-len", "64", "--device", "cpu"]
    args += ["--allow-runtime-lora-updating", "--lora-root", str(files.root), "--uvicorn-log-level", "info"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH_A_HUNG_LOAD, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        url = None
        deadline = time.monotonic() + 120
        lines = []
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the server exited: " + "".join(lines)
            lines.append(line)
            if "Uvicorn running on" in line:
                url = line.split("Uvicorn running on ")[1].split()[0]
        assert url, "".join(lines)
        load = threading.Thread(
            target=lambda: httpx.post(
                url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": "a2"}, timeout=60
            ),
            daemon=True,
        )
        load.start()
        time.sleep(1.0)  # the load is hanging on its thread
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    # NOTE: uvicorn re-raises the signal it caught once its shutdown is done, so the status is SIGTERM's
    assert rc in (0, -signal.SIGTERM) and took < 5, (rc, took)
