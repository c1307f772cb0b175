"""A client that hangs up aborts its request and its KV blocks come back; a short load test leaks nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import httpx
from conftest import API_KEY, NUM_KV_BLOCKS

from loraserve.server.metrics import parse_metrics

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"model": "a0", "prompt": "t5 t6 t7", "max_tokens": 120, "temperature": 0, "ignore_eos": True}


def metrics(server) -> dict[str, float]:
    return parse_metrics(httpx.get(server.url + "/metrics").text)


def wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = m["loraserve_num_requests_running"] == 0 and m["loraserve_num_requests_waiting"] == 0
        if idle and m["loraserve_kv_cache_free_blocks"] == NUM_KV_BLOCKS or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_streaming_disconnect_frees_kv_blocks(server, client):
    before = wait_idle(server)
    with httpx.Client(base_url=server.url, headers=AUTH) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            busy = metrics(server)  # mid-stream: the request holds blocks
            assert busy["loraserve_kv_cache_free_blocks"] < NUM_KV_BLOCKS
            assert busy["loraserve_num_requests_running"] == 1
    after = wait_idle(server)
    assert after["loraserve_kv_cache_free_blocks"] == NUM_KV_BLOCKS
    assert after["loraserve_num_requests_running"] == 0
    assert (
        after['loraserve_request_finished_total{finish_reason="abort"}']
        == before.get('loraserve_request_finished_total{finish_reason="abort"}', 0) + 1
    )
    # it stopped early: far fewer than the 120 tokens it asked for were generated
    assert after["loraserve_generation_tokens_total"] - before["loraserve_generation_tokens_total"] < 120
    assert after["loraserve_lora_adapters_in_use"] == 0


def test_non_streaming_disconnect_frees_kv_blocks(server):
    before = wait_idle(server)
    try:
        httpx.post(server.url + "/v1/completions", json={**LONG, "n": 4}, headers=AUTH, timeout=0.05)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("the request finished before the client hung up; make it longer")
    after = wait_idle(server)
    assert after["loraserve_kv_cache_free_blocks"] == NUM_KV_BLOCKS
    assert (
        after['loraserve_request_finished_total{finish_reason="abort"}']
        == before.get('loraserve_request_finished_total{finish_reason="abort"}', 0) + 4
    )
    assert after["loraserve_generation_tokens_total"] - before["loraserve_generation_tokens_total"] < 4 * 120


def _load_test_module():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "load_test.py"
    spec = importlib.util.spec_from_file_location("loraserve_load_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def test_tiny_load_test(server, client):
    import torch

    lt = _load_test_module()
    # NOTE: the load generator shares this process (and its GIL) with the server; one torch thread
    # keeps the engine's OpenMP threads from spinning against them on a 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rep = asyncio.run(
            lt.run_load(
                server.url,
                API_KEY,
                clients=8,
                duration=5.0,
                max_tokens=16,
                disconnect_prob=0.25,
                request_timeout=30.0,
            )
        )
    finally:
        torch.set_num_threads(threads)
    print(rep.summary())
    assert rep.ok, rep.summary()
    assert rep.disconnected > 0 and rep.completed > 8
    assert {"tiny-llama", "a0", "a1"} <= set(rep.by_model)
