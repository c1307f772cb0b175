"""NaN in the KV cache where no request may read it: the engine-level isolation scenarios.

Used by tests/engine/test_attention_isolation.py (CPU, torch attention) and its GPU twin (Triton).
A clean run and a poisoned run of the same requests on fresh engines must give every request
other than the poisoned batch-mate the same token ids and bit-identical logprobs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from helpers import VOCAB

from loraserve import LLM, SamplingParams

LENS = [5, 30, 7, 19, 1, 12, 23]
MAX_TOKENS = [6, 10, 16, 5, 14, 9, 12]
PROMPTS = [
    torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(300 + i)).tolist()
    for i, n in enumerate(LENS)
]
# NOTE: request 0 is admitted first, so it holds block 0: the slot the old batched decode padded with
MATE = 0

CONFIGS = {
    "roomy": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8, block_size=4),
    "chunked_and_preemption": dict(max_num_batched_tokens=8, block_size=4, num_kv_blocks=16),
}


def params(i: int) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True, logprobs=2, prompt_logprobs=1
    )


def spy_schedule(llm: LLM) -> list[list[tuple[int, int, int]]]:
    """Record each step's (num_computed_tokens before, num_new_tokens, num_prompt_tokens) per seq,
    steps scheduled ahead (async scheduling) included."""
    sched = llm.engine.scheduler
    log: list[list[tuple[int, int, int]]] = []

    def spy(real):
        def scheduled(*args):
            batch = real(*args)
            if not batch.empty:
                log.append(
                    [
                        (s.num_computed_tokens, n, s.num_prompt_tokens)
                        for s, n in zip(batch.seqs, batch.num_new_tokens)
                    ]
                )
            return batch

        return scheduled

    sched.schedule = spy(sched.schedule)
    sched.schedule_ahead = spy(sched.schedule_ahead)
    return log


def poison_blocks(llm: LLM, blocks: Iterable[int]) -> None:
    """Write NaN into every slot of ``blocks``, K and V of every layer."""
    runner = llm.engine.runner
    bs = runner.blocks.block_size
    slots = [b * bs + o for b in blocks for o in range(bs)]
    if not slots:
        return
    idx = torch.tensor(slots, dtype=torch.long, device=runner.device)
    for k, v in runner.kv_caches:
        k[idx] = float("nan")
        v[idx] = float("nan")


def poison_free_blocks(llm: LLM) -> None:
    """From now on every free block holds NaN: all blocks now (the engine is idle, so all are free),
    every block a sequence frees (finished, aborted or preempted) as it is freed, and on CUDA the
    scratch block of graph padding rows."""
    engine = llm.engine
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks, "poison an idle engine"
    poison_blocks(llm, range(blocks.num_blocks))
    for k, v in engine.runner.kv_caches:  # slots past the manager's blocks (CUDA's scratch block), if any
        k[blocks.num_blocks * blocks.block_size :] = float("nan")
        v[blocks.num_blocks * blocks.block_size :] = float("nan")
    real_free = blocks.free

    def free(seq):
        poison_blocks(llm, seq.block_table)
        real_free(seq)

    blocks.free = free


def poison_mate(llm: LLM, prompt: list[int]) -> list[bool]:
    """Before every step, write NaN into every block of the running request with ``prompt`` (the
    positions it wrote and the unwritten rest of its last block), so its own K/V, and with them all
    its later activations, are NaN. Returns a list that gets, per step the mate took part in, whether
    its logits were non-finite: proof that the poison was live (its first step reads only the
    positions that step writes, so only later steps can show it).

    NOTE: the mate's own logit rows are then replaced by zeros, so the sampler's policy on non-finite
    logits (not attention's business) cannot change the schedule or fail the step for everyone."""
    engine = llm.engine
    runner = engine.runner
    real_execute = runner.execute
    seen: list[bool] = []

    def execute(step):
        mate = next((s for s in engine.scheduler.running if s.prompt_token_ids == prompt), None)
        i = None
        if mate is not None:
            i = next((j for j, t in enumerate(step.block_tables) if t is mate.block_table), None)
        if i is not None:
            poison_blocks(llm, mate.block_table)
        logits = real_execute(step)
        if i is None or logits is None:
            return logits
        lo, hi = step.query_starts[i], step.query_starts[i] + step.query_lens[i]
        rows = [r for r, h in enumerate(step.logit_rows) if lo <= h < hi]
        if rows:
            seen.append(not bool(torch.isfinite(logits[rows]).all()))
            logits = logits.clone()
            logits[rows] = 0.0
        return logits

    runner.execute = execute
    return seen


def assert_bit_identical(ref, got, skip: set[int]) -> None:
    """Same token ids, and the same logprob floats bit for bit, for every request not in ``skip``."""
    for i, (a, b) in enumerate(zip(ref, got)):
        if i in skip:
            continue
        ca, cb = a.outputs[0], b.outputs[0]
        assert b.error is None and cb.finish_reason == ca.finish_reason == "length", f"request {i}: {b.error}"
        assert cb.token_ids == ca.token_ids, f"request {i}: token ids differ"
        assert len(cb.token_ids) == MAX_TOKENS[i]
        for j, (da, db) in enumerate(zip(ca.logprobs, cb.logprobs, strict=True)):
            assert da.keys() == db.keys(), f"request {i}, token {j}: top tokens differ"
            for t in da:
                assert bits(db[t].logprob) == bits(da[t].logprob), (
                    f"request {i}, token {j}: {db[t]} != {da[t]}"
                )
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == LENS[i]
        for j, (da, db) in enumerate(zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True)):
            assert da.keys() == db.keys()
            for t in da:
                assert bits(db[t].logprob) == bits(da[t].logprob), f"request {i}, prompt pos {j + 1}"


def bits(x: float) -> bytes:
    """A float's bytes: equal only when bit-identical (NaN never equals a finite clean value)."""
    return torch.tensor(x, dtype=torch.float64).numpy().tobytes()


def padded_decode_steps(log: list[list[tuple[int, int, int]]]) -> int:
    """Steps of one new token per sequence over different context lengths: a batched decode with padding."""
    return sum(all(n == 1 for _, n, _ in step) and len({done + n for done, n, _ in step}) > 1 for step in log)


def chunked_steps(log: list[list[tuple[int, int, int]]]) -> int:
    """Steps that ran a prompt chunk short of the whole prompt."""
    return sum(any(0 < n and done + n < plen for done, n, plen in step) for step in log)
