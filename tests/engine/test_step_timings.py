"""engine.step_timings: every phase of step() is timed, and the phases add up to the step (with
async scheduling too, where a call launches one step and finishes another)."""

from __future__ import annotations

import time

import pytest
from helpers import make_tiny_model

from loraserve import LLM, SamplingParams
from loraserve.config import Env
from loraserve.engine.timings import PHASES


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("timings")
    make_tiny_model(path, "llama")
    return LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=4)


def test_phases_are_recorded_and_sum_to_the_step(llm):
    eng = llm.engine
    eng.step_timings.reset()
    sp = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    for i in range(3):
        eng.add_request(f"t{i}", None, sp, [5, 6, 7, 8 + i])
    steps, wall = 0, 0.0
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        wall += time.perf_counter() - t0
        steps += 1
    t = eng.step_timings
    assert t.steps == steps == t.counts["schedule"]
    for phase in PHASES:
        assert t.counts[phase] == steps, phase  # no idle steps here: every phase ran every step
        assert t.seconds[phase] > 0, phase
    phases = sum(t.seconds.values())
    assert phases <= t.step_seconds <= wall
    assert t.step_seconds - phases < 0.05 * t.step_seconds + 1e-3  # only check_healthy and laps between
    assert wall - t.step_seconds < 0.05 * wall + 1e-3
    d = t.as_dict()
    assert d["step"]["count"] == steps and d["forward"]["mean_ms"] == pytest.approx(
        1e3 * t.seconds["forward"] / steps
    )


def test_phases_under_async_scheduling(llm):
    """A call launches the next step ahead (schedule .. sample) and finishes the current one (wait,
    postprocess): every call finishes one step, and as max_tokens ends every request, no step is left
    over: one launch (prepare, forward, sample) per call, but more schedules (each try to run ahead)."""
    eng = llm.engine
    eng.async_scheduling = True
    try:
        eng.step_timings.reset()
        launched = eng.num_launched_ahead
        sps = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8 + i]} for i in range(3)], sps)
    finally:
        eng.async_scheduling = False
    t = eng.step_timings
    assert eng.num_launched_ahead > launched and eng._inflight is None
    assert t.counts["wait"] == t.counts["postprocess"] == t.steps
    assert t.counts["prepare"] == t.counts["forward"] == t.counts["sample"] == t.steps
    assert t.counts["schedule"] > t.steps
    assert all(t.seconds[p] > 0 for p in PHASES)
    assert sum(t.seconds.values()) <= t.step_seconds


def test_reset_zeroes_everything(llm):
    llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2))
    t = llm.engine.step_timings
    assert t.steps > 0
    t.reset()
    assert t.steps == 0 and t.step_seconds == 0.0
    assert all(v == 0.0 for v in t.seconds.values()) and all(v == 0 for v in t.counts.values())
    assert set(t.seconds) == set(t.counts) == set(PHASES)


def test_profile_sync_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("LORASERVE_PROFILE_SYNC", raising=False)
    assert Env.read().profile_sync is False
    monkeypatch.setenv("LORASERVE_PROFILE_SYNC", "1")
    assert Env.read().profile_sync is True
