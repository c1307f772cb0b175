"""A request's output does not depend on what else is in the batch.

Eight requests (different prompt lengths and max_tokens) are run one at a time, then all together:
in a roomy engine, with a token budget small enough to chunk every long prefill, and with a KV
cache small enough to force recompute preemption. Greedy ids must be identical, logprobs equal to
float tolerance; seeded sampling must also be identical (per-request generators).
"""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, make_tiny_model

from loraserve import LLM, SamplingParams

N = 8
LENS = [3, 30, 7, 19, 1, 25, 12, 9]
MAX_TOKENS = [12, 8, 20, 5, 16, 10, 1, 14]
PROMPTS = [
    torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(100 + i)).tolist()
    for i, n in enumerate(LENS)
]


def greedy(i: int) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True, logprobs=2, prompt_logprobs=1
    )


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=50, max_tokens=MAX_TOKENS[i], ignore_eos=True, seed=1000 + i)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(path, "llama", initializer_range=0.1)
    return path


def make_llm(model_dir, **kw) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=N, **kw)


def run(llm: LLM, make_params, idx: list[int]):
    return llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in idx], [make_params(i) for i in idx])


@pytest.fixture(scope="module")
def alone(model_dir):
    llm = make_llm(model_dir)
    return {
        "greedy": [run(llm, greedy, [i])[0] for i in range(N)],
        "seeded": [run(llm, seeded, [i])[0] for i in range(N)],
    }


def spy_schedule(llm: LLM) -> list[list[tuple[int, int, int]]]:
    """Record each step's (num_computed_tokens before, num_new_tokens, num_prompt_tokens) per seq."""
    sched = llm.engine.scheduler
    real = sched.schedule
    log: list[list[tuple[int, int, int]]] = []

    def schedule():
        batch = real()
        log.append(
            [
                (s.num_computed_tokens, n, s.num_prompt_tokens)
                for s, n in zip(batch.seqs, batch.num_new_tokens)
            ]
        )
        return batch

    sched.schedule = schedule
    return log


def assert_same(ref, got, exact_logprobs: bool = False) -> None:
    for i, (a, b) in enumerate(zip(ref, got)):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids, f"request {i}"
        assert len(cb.token_ids) == MAX_TOKENS[i]
        assert cb.finish_reason == ca.finish_reason == "length"
        if ca.logprobs is not None:
            for da, db in zip(ca.logprobs, cb.logprobs):
                assert da.keys() == db.keys()
                for t in da:
                    assert abs(da[t].logprob - db[t].logprob) < 1e-5 and da[t].rank == db[t].rank
        if a.prompt_logprobs is not None:
            assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == LENS[i]
            for da, db in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                assert da.keys() == db.keys()
                for t in da:
                    assert abs(da[t].logprob - db[t].logprob) < 1e-5


CONFIGS = {
    "roomy": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "preemption": dict(block_size=4, num_kv_blocks=16),
    "chunked_and_preemption": dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=8),
}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_batch_equals_alone(model_dir, alone, config, kind):
    llm = make_llm(model_dir, **CONFIGS[config])
    log = spy_schedule(llm)
    got = run(llm, greedy if kind == "greedy" else seeded, list(range(N)))
    assert_same(alone[kind], got)

    assert max(len(step) for step in log) > 1, "requests never shared a step"
    chunked = any(0 < n and done + n < plen for step in log for done, n, plen in step)
    budget = CONFIGS[config].get("max_num_batched_tokens")
    if budget is not None:
        assert chunked, "no prefill was split into chunks"
        assert all(sum(n for _, n, _ in step) <= budget for step in log)
    else:
        assert not chunked
    preempted = llm.engine.scheduler.num_preemptions
    if "num_kv_blocks" in CONFIGS[config]:
        assert preempted > 0, "the small KV cache never forced a preemption"
    else:
        assert preempted == 0
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_seeded_differs_from_greedy(alone):
    """Guard: the seeded case really samples (otherwise its invariance check would be greedy's)."""
    g = [o.outputs[0].token_ids for o in alone["greedy"]]
    s = [o.outputs[0].token_ids for o in alone["seeded"]]
    assert g != s
