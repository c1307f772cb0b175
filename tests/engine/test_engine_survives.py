"""Property tests: random sampling parameters and random traffic never take the engine down.

Hypothesis draws the parameters (extremes, NaN and Inf included) and the order of events. Whatever
it draws, a request is refused at the boundary (``ValueError``) or runs to a normal end; the
sampler never raises and never hands a bad row to ``torch.multinomial``; the scheduler's block
accounting stays exact; and at the end nothing is left behind.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraserve import LLM, SamplingParams
from loraserve.engine.sampler import NO_TOKEN, Sampler

V = 64


def fast(n: int) -> settings:
    """n examples, no deadline, the same examples on every run (CI must not flake), no database."""
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e4, 1e39, -1.0, math.nan, math.inf, -math.inf]),
)
any_int = st.one_of(
    st.integers(-5, 70),
    st.sampled_from([-(2**63) - 1, -(2**63), 2**63 - 1, 2**64 - 2, 2**64 - 1, 2**64, 10**30]),
)


def param_kwargs():
    """Any mix of SamplingParams' numeric fields, valid or not."""
    return st.fixed_dictionaries(
        {},
        optional={
            "n": st.integers(-1, 3),
            "temperature": any_float,
            "top_p": any_float,
            "top_k": any_int,
            "min_p": any_float,
            "seed": st.one_of(st.none(), any_int),
            "max_tokens": st.one_of(st.none(), st.integers(-1, 6)),
            "min_tokens": st.integers(-1, 6),
            "logprobs": st.one_of(st.none(), any_int),
            "prompt_logprobs": st.one_of(st.none(), any_int),
            "stop_token_ids": st.lists(any_int, max_size=4),
            "ignore_eos": st.booleans(),
        },
    )


def make_params(kw: dict) -> SamplingParams | None:
    try:
        return SamplingParams(**kw)
    except ValueError:
        return None


@given(
    kws=st.lists(param_kwargs(), min_size=1, max_size=6),
    data=st.data(),
)
@fast(60)
def test_the_sampler_survives_any_valid_params_and_any_logits(kws, data):
    params = [p for p in map(make_params, kws) if p is not None]
    if not params:
        return
    n = len(params)
    logits = torch.randn(n, V, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))) * 5
    poisoned = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, V - 1)), max_size=3))
    for r, c in poisoned:
        # huge finite logits too: over a small temperature they overflow unless rows are shifted first
        logits[r, c] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf, 3e38, -3e38, 1e30]))
    banned = [data.draw(st.lists(st.integers(0, V - 1), max_size=V)) for _ in range(n)]
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    ids = Sampler()(logits, params, gens, banned).tolist()
    for i, t in enumerate(ids):
        row = logits[i].clone()
        row[banned[i]] = -math.inf
        refused = not math.isfinite(row.max().item())
        assert (t == NO_TOKEN) == refused, (i, t, row)
        if not refused:
            assert 0 <= t < V and t not in banned[i]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("survives")
    make_tiny_model(d / "m", "llama", vocab_size=V, max_position_embeddings=64)
    return LLM(
        str(d / "m"), device="cpu", dtype="float32", max_model_len=48, num_kv_blocks=24, max_num_seqs=4
    )


@given(
    requests=st.lists(
        st.tuples(param_kwargs(), st.lists(st.integers(-2, V + 2), min_size=0, max_size=40)),
        min_size=1,
        max_size=6,
    )
)
@fast(40)
def test_the_engine_survives_any_requests(llm, requests):
    eng = llm.engine
    added = []
    for i, (kw, prompt) in enumerate(requests):
        params = make_params(kw)
        if params is None:
            continue
        rid = f"h{i}"
        try:
            eng.add_request(rid, None, params, prompt)
        except ValueError:  # RequestError: refused at the boundary, with a message
            assert not eng.requests.get(rid)
            continue
        added.append(rid)
    outs = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            outs[o.request_id] = o
    assert not eng.has_unfinished_requests(), "the engine made no progress"
    for rid in added:
        for c in outs[rid].outputs:
            assert c.finish_reason in ("stop", "length"), (rid, c.finish_reason, outs[rid].error)
    assert eng.is_healthy() and not eng.requests
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "abort", "step", "step", "step"]), st.integers(0, 10**6)),
        max_size=80,
    )
)
@fast(60)
def test_the_scheduler_keeps_its_books_under_any_traffic(ops):
    """Adds (random lengths, adapters), aborts and steps in any order: blocks are never lost or
    double-counted, every running sequence holds the blocks its computed tokens need, and once
    everything ends every block is free."""
    from test_scheduler import FakeSlots, make, seq, step

    s = make(num_blocks=24, block_size=4, max_num_seqs=4, max_tokens=16, adapters=FakeSlots(max_loras=2))
    live = []
    for op, x in ops:
        if op == "add":
            q = seq(1 + x % 30, max_tokens=1 + x % 7, lora=x % 4)
            if s.blocks.blocks_for(q.num_prompt_tokens + q.params.max_tokens) <= s.blocks.num_blocks:
                s.add(q)
                live.append(q)
        elif op == "abort" and live:
            q = live.pop(x % len(live))
            if not q.is_finished:
                s.finish(q, "abort")
        else:
            step(s)
        held = sum(len(q.block_table) for q in live if not q.is_finished)
        assert held + s.blocks.num_free_blocks == s.blocks.num_blocks
    for _ in range(500):
        if not s.has_unfinished():
            break
        step(s)
    assert not s.has_unfinished()
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """The sampler's own guard, beside SamplingParams' floor: a top_p that is 0 in fp32 keeps one token."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(3)]
    for p in params:
        p.top_p = 1e-46  # past the validation: 0 in the sampler's fp32 table
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert Sampler()(logits, params, gens).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-5, 0.5, 1.0])
def test_huge_finite_logits_are_sampled_not_refused(temperature):
    """A logit near fp32's max over a small temperature must not overflow into a NaN distribution."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    logits[0, 5] = 3e38
    logits[1, 9] = 1e30
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(2)]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    assert Sampler()(logits, params, gens).tolist() == [5, 9]
