"""A failure inside a step fails that step's requests alone; the engine goes on serving the others.

An exception while running a step ends the requests of the step with finish_reason "error" and a
message naming the cause, frees their KV blocks and adapter references, and the next requests get
the answers they would have got anyway. A second failure in a row stops the engine for good
(``EngineDeadError``). A row of non-finite logits (a broken adapter, say) fails its own request only.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_model

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.engine.worker import EngineDeadError

PROMPTS = [[5, 9, 13, 2, 8], [7, 7, 3], [11, 4, 6, 19, 23, 5, 2], [3, 30, 31]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("isolation")
    make_tiny_model(d / "base", "llama")
    make_peft_adapter(d / "base", d / "a", seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    return d


def make(files, **kw) -> LLM:
    kw = {"max_model_len": 64, "num_kv_blocks": 32, "max_num_seqs": 4, **kw}
    return LLM(str(files / "base"), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8, **kw)


def adapter(files) -> LoRARequest:
    return LoRARequest("a", 1, str(files / "a"))


def run(llm: LLM, loras) -> list[tuple[list[int], list]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, loras)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def assert_idle(llm: LLM) -> None:
    """Nothing left behind: no request, every KV block free, no adapter reference held."""
    eng = llm.engine
    assert not eng.requests and not eng.has_unfinished_requests()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert not eng.lora_manager._refs


class FailingForward:
    """Wraps the runner's forward: raises on the calls listed in ``fail_on`` (1-based)."""

    def __init__(self, runner, fail_on):
        self.forward, self.fail_on, self.calls = runner.forward, set(fail_on), 0

    def __call__(self, *args, **kw):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected failure in the forward")
        return self.forward(*args, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(files, async_scheduling, monkeypatch):
    llm = make(files, max_num_seqs=2, async_scheduling=async_scheduling)
    loras = [adapter(files), None, adapter(files), None]
    ref = run(llm, loras)
    # the 4th forward is a decode of the first two requests; the last two wait for their seats
    monkeypatch.setattr(llm.engine.runner, "forward", FailingForward(llm.engine.runner, {4}))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, loras)
    failed = [o for o in outs if o.error is not None]
    assert [o.request_id for o in failed] == [outs[0].request_id, outs[1].request_id]
    for o in failed:
        assert o.finished and o.outputs[0].finish_reason == "error"
        assert "injected failure in the forward" in o.error
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs[2:]] == ref[2:]
    assert_idle(llm)
    assert (llm.engine.num_launched_ahead > 0) == async_scheduling
    assert llm.engine.is_healthy() and llm.engine.consecutive_step_failures == 0
    monkeypatch.undo()
    assert run(llm, loras) == ref


def test_a_failure_in_the_scheduler_fails_the_requests_and_the_engine_goes_on(files, monkeypatch):
    llm = make(files)
    ref = run(llm, [None] * 4)
    schedule = llm.engine.scheduler.schedule
    calls = iter(range(100))

    def flaky():
        if next(calls) == 2:
            raise RuntimeError("injected scheduler failure")
        return schedule()

    monkeypatch.setattr(llm.engine.scheduler, "schedule", flaky)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert all(o.outputs[0].finish_reason == "error" and "scheduler failure" in o.error for o in outs)
    assert_idle(llm)
    assert run(llm, [None] * 4) == ref


def test_a_second_failure_in_a_row_stops_the_engine(files, monkeypatch):
    llm = make(files, max_num_seqs=2)
    monkeypatch.setattr(llm.engine.runner, "forward", FailingForward(llm.engine.runner, {2, 3}))
    eng = llm.engine
    for i, p in enumerate(PROMPTS[:3]):  # the third waits for a seat, so the engine never idles
        eng.add_request(f"r{i}", None, GREEDY, p)
    assert eng.step()  # the first two's prefill
    first = eng.step()  # fails: both requests end with an error, the engine goes on
    assert {o.request_id for o in first} == {"r0", "r1"} and all(o.error for o in first)
    assert eng.is_healthy() and "r2" in eng.requests
    with pytest.raises(EngineDeadError, match="cannot go on"):
        eng.step()  # the third's prefill fails too: two in a row
    assert not eng.is_healthy()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.requests
    with pytest.raises(EngineDeadError):
        eng.add_request("r3", None, GREEDY, PROMPTS[3])


def test_failures_with_idle_time_between_do_not_stop_the_engine(files, monkeypatch):
    llm = make(files)
    monkeypatch.setattr(llm.engine.runner, "forward", FailingForward(llm.engine.runner, {1, 2}))
    for _ in range(2):  # each request alone, each failing: not "in a row" with the next one
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
        assert out.outputs[0].finish_reason == "error"
    assert llm.engine.is_healthy()
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY)
    assert out.error is None and len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_failures_apart_do_not_stop_the_engine(files, monkeypatch):
    llm = make(files)
    monkeypatch.setattr(llm.engine.runner, "forward", FailingForward(llm.engine.runner, {2, 4}))
    eng = llm.engine
    for rid in ("r0", "r1"):
        eng.add_request(rid, None, GREEDY, PROMPTS[0])
        assert eng.step()[0].error is None  # its prefill
        (out,) = eng.step()  # a failure, after a good step
        assert out.request_id == rid and out.error and eng.consecutive_step_failures == 1
    assert eng.is_healthy()
    eng.add_request("r2", None, GREEDY, PROMPTS[0])
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].outputs[0].finish_reason == "length" and eng.consecutive_step_failures == 0


def poison_rows(runner, poisoned_request: str, value: float):
    """Wrap forward: the sampling logits of ``poisoned_request``'s rows become ``value``."""
    forward = runner.forward

    def wrapped(*args, **kw):
        out = forward(*args, **kw)
        rows = [i for i, s in enumerate(out.sample_seqs) if s.request_id == poisoned_request]
        if rows:
            out.sample_logits = out.sample_logits.clone()
            out.sample_logits[rows, 3] = value
        return out

    return wrapped


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_non_finite_logits_fail_their_request_alone(files, value, async_scheduling, monkeypatch):
    llm = make(files, async_scheduling=async_scheduling)
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=6, logprobs=2)
    params = [GREEDY, sampled, GREEDY, sampled]
    ref = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    eng = llm.engine
    first_rid = int(eng.new_request_id()) + 1  # generate() takes the ids after this one
    monkeypatch.setattr(eng.runner, "forward", poison_rows(eng.runner, str(first_rid + 1), value))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    bad = outs[1]
    assert bad.outputs[0].finish_reason == "error" and "non-finite logits" in bad.error
    for i in (0, 2, 3):
        assert outs[i].error is None
        assert outs[i].outputs[0].token_ids == ref[i].outputs[0].token_ids
        # NOTE: the batch shrinks once the bad request fails, so float sums may round differently
        for got, want in zip(outs[i].outputs[0].logprobs, ref[i].outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-5 for t in got)
    assert_idle(llm)
    assert eng.is_healthy()


def test_the_sampler_refuses_non_finite_rows_and_leaves_the_others_alone():
    from loraserve.engine.sampler import NO_TOKEN, Sampler

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [
        SamplingParams(temperature=t, seed=s)
        for t, s in [(0, None), (1.0, 1), (0.7, 2), (0, None), (1.3, 3), (1.0, 4)]
    ]

    def gens():
        return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]

    clean = Sampler()(logits, params, gens())
    bad = logits.clone()
    bad[1, 4] = math.nan  # a sampled row
    bad[3, 7] = math.inf  # a greedy row
    banned = [[], [], [], [], list(range(50)), []]  # every token banned: nothing can be drawn
    got = Sampler()(bad, params, gens(), banned)
    assert got[1] == got[3] == got[4] == NO_TOKEN
    for i in (0, 2, 5):
        assert got[i] == clean[i]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_step_frees_every_sequence_of_an_n_request_with_prompt_logprobs(
    files, async_scheduling, monkeypatch
):
    """n = 3 with prompt logprobs and preemption-prone room: every sibling (running or waiting) ends
    with the error, and nothing stays behind."""
    llm = make(files, max_num_seqs=2, num_kv_blocks=12, async_scheduling=async_scheduling)
    params = SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=8, prompt_logprobs=2, logprobs=1)
    monkeypatch.setattr(llm.engine.runner, "forward", FailingForward(llm.engine.runner, {3}))
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, adapter(files))
    assert out.error is not None and [c.finish_reason for c in out.outputs] == ["error"] * 3
    assert_idle(llm)
    monkeypatch.undo()
    (again,) = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, adapter(files))
    assert again.error is None and all(c.finish_reason == "length" for c in again.outputs)
