"""SamplingParams refuses every value the sampler cannot take, naming the field; the values at the edges
of each range run through the engine, and a greedy request afterwards gets the same answer as before."""

from __future__ import annotations

import math

import pytest
from helpers import make_tiny_model

from loraserve.llm import LLM
from loraserve.sampling import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
    SamplingParamsError,
)

BAD = [
    # every float finite and in range
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf, min_tokens=2), "temperature"),
    (dict(temperature=1e39, min_tokens=2), "temperature"),
    (dict(temperature=MAX_TEMPERATURE * 1.01), "temperature"),
    (dict(temperature=-1e-9), "temperature"),
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.0 + 1e-9), "top_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=math.inf), "min_p"),
    # integers in range, and integers
    (dict(n=0), "n"),
    (dict(n=True), "n"),
    (dict(n=2.0), "n"),
    (dict(seed=2**64), "seed"),
    (dict(seed=SEED_MIN - 1), "seed"),
    (dict(seed=2**64 - 1, n=2), "seed"),  # completion 1 would use seed 2**64
    (dict(seed=1.5), "seed"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2**63), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
    (dict(stop_token_ids=[-100000]), "stop_token_ids"),
    (dict(stop_token_ids=[5, True]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    # bools are bools
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
    # stop strings: non-empty, valid Unicode, capped in count and length
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=[5]), "stop"),
    (dict(stop={"a"}), "stop"),
    (dict(stop="\ud800"), "stop"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (dict(stop="x" * (MAX_STOP_STRING_LENGTH + 1)), "stop"),
]


@pytest.mark.parametrize("kw,field", BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert e.value.param == field
    assert field in str(e.value), str(e.value)


def test_values_at_the_edges_are_accepted_and_normalised():
    sp = SamplingParams(temperature=0, top_k=-1, min_p=1, top_p=1, seed=SEED_MAX, max_tokens=3, min_tokens=3)
    assert isinstance(sp.temperature, float) and sp.greedy and sp.top_k == 0 and sp.min_p == 1.0
    assert SamplingParams(seed=SEED_MIN, n=4).seed == SEED_MIN
    assert SamplingParams(seed=SEED_MAX - 3, n=4).seed == SEED_MAX - 3  # seed + 3 is the last one that fits
    assert SamplingParams(temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE
    sp = SamplingParams(stop=["x"] * MAX_STOP_STRINGS, logprobs=MAX_LOGPROBS, prompt_logprobs=0)
    assert sp.stop_list == ["x"] * MAX_STOP_STRINGS
    assert SamplingParams(stop="y" * MAX_STOP_STRING_LENGTH, stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(path, "llama")
    return LLM(model=str(path), max_model_len=64, max_num_seqs=8, device="cpu")


PROMPT = {"prompt_token_ids": [200, 31, 7, 64, 128]}


def greedy(llm) -> list[int]:
    return (
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )


EDGES = [
    dict(
        temperature=MAX_TEMPERATURE, min_tokens=2, stop_token_ids=[1, 255]
    ),  # the reported crash, at the edge
    dict(temperature=1e-5, top_p=1e-9, min_p=1.0),
    dict(temperature=1.0, seed=SEED_MAX - 1, n=2),  # the last seeds torch takes
    dict(temperature=1.0, seed=SEED_MIN, n=2, top_k=2**62),
]


@pytest.mark.parametrize("kw", EDGES)
def test_edge_values_run_and_leave_greedy_answers_alone(llm, kw):
    before = greedy(llm)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=1, **kw))[0]
    assert len(out.outputs) == kw.get("n", 1)
    for c in out.outputs:
        assert len(c.token_ids) == 4 and all(0 <= t < 256 for t in c.token_ids)
        assert all(math.isfinite(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs))
    assert greedy(llm) == before


def test_seeded_sampling_at_the_top_seed_is_reproducible(llm):
    sp = SamplingParams(temperature=1.0, seed=SEED_MAX - 1, n=2, max_tokens=6, ignore_eos=True)
    a = [c.token_ids for c in llm.generate(PROMPT, sp)[0].outputs]
    b = [c.token_ids for c in llm.generate(PROMPT, sp)[0].outputs]
    assert a == b
