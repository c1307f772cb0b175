"""A dead, hung or failing TP worker: the engine reports it and fails requests in bounded time."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
from helpers import make_peft_adapter, make_tiny_model

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.engine.engine import EngineDeadError

LONG = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_fail") / "model"
    make_tiny_model(d, "llama", num_key_value_heads=2, max_position_embeddings=512)
    return d


def _llm(model, **kw) -> LLM:
    return LLM(str(model), device="cpu", num_kv_blocks=128, tensor_parallel_size=2, **kw)


def _assert_dead(llm: LLM, what: str) -> None:
    assert not llm.engine.is_healthy()
    assert not llm.engine.requests, "the engine failed every request"
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=what):
        llm.generate(PROMPT, SamplingParams(max_tokens=2))
    assert time.monotonic() - t0 < 2.0, "a dead engine answers at once"


def test_killed_worker_fails_generate_in_bounded_time(model):
    llm = _llm(model)
    try:
        (worker,) = llm.engine.workers.procs
        killed_at = []

        def kill():
            os.kill(worker.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

        timer = threading.Timer(0.5, kill)
        timer.start()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 .*exited with code -9"):
            llm.generate([PROMPT, PROMPT], LONG)  # ~10 s of decoding if nothing failed
        assert killed_at and time.monotonic() - killed_at[0] < 10.0
        _assert_dead(llm, "worker rank 1")
    finally:
        llm.shutdown()
    assert not worker.is_alive()


def test_hung_worker_times_out(model):
    llm = _llm(model, distributed_timeout_s=2.0)
    try:
        (worker,) = llm.engine.workers.procs
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2))  # healthy first
        os.kill(worker.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="did not answer within 2.0s"):
            llm.generate(PROMPT, LONG)
        assert time.monotonic() - t0 < 10.0
        _assert_dead(llm, "did not answer")
    finally:
        llm.shutdown()  # kills the stopped worker
    assert not worker.is_alive()


def test_failing_worker_reports_its_error(model, tmp_path):
    adapter = make_peft_adapter(
        model, tmp_path / "gone", seed=3, r=4, lora_alpha=8, target_modules=["q_proj"]
    )
    llm = _llm(model, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        lora = LoRARequest("gone", 1, str(adapter))
        llm.add_lora(lora)  # rank 0 parses it now and keeps it in its host cache ...
        shutil.rmtree(adapter)  # ... the worker reads the files only when the slot is written
        with pytest.raises(EngineDeadError, match=r"worker rank 1 .*exited with code 1: LoRA\w*Error"):
            llm.generate(PROMPT, SamplingParams(max_tokens=2), lora_request=lora)
        _assert_dead(llm, "gone")
    finally:
        llm.shutdown()
