"""No request reads another's KV: NaN where a request may not look changes none of its bits (torch attention).

Unit level: ``reference_paged_attention`` over a cache whose every slot outside the batch's sequences
(block 0 included, the old padding slot) and the unwritten rest of each sequence's last block is NaN,
or whose one batch-mate's own slots are NaN, gives every other row bit-identical to a clean cache.

Engine level (tests/kv_poison.py): greedy requests of different lengths, with chunked prefill and
preemption, run on a clean engine and on one where every free block holds NaN (before the first step
and from the moment a block is freed), with and without a batch-mate whose KV is NaN before each of
its steps: every other request's token ids and logprobs are bit-identical to the clean run.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_model
from kv_poison import (
    CONFIGS,
    MATE,
    PROMPTS,
    assert_bit_identical,
    chunked_steps,
    padded_decode_steps,
    params,
    poison_free_blocks,
    poison_mate,
    spy_schedule,
)

from loraserve import LLM
from loraserve.forward_context import AttentionMetadata
from loraserve.layers.attention import reference_paged_attention

NAN = float("nan")
BS, NUM_BLOCKS, HQ, HK, D = 4, 64, 4, 2, 16

# (query lens, context lens): every query ends at its context's end
UNIT_BATCHES = {
    "decode": ([1, 1, 1, 1, 1], [9, 1, 23, 14, 6]),
    "mixed": ([1, 7, 1, 5, 13], [18, 7, 3, 22, 13]),  # decode, full prefill, chunked prefill
}


def unit_batch(q_lens, ctx_lens, mate_owns_block0: bool, g: torch.Generator):
    """Metadata with blocks scattered over the cache; block 0 is the first block of sequence 0 when
    ``mate_owns_block0``, else nobody's. Returns (metadata, every sequence's slots, every seq's blocks)."""
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
    if mate_owns_block0:
        perm.insert(0, 0)
    tables, kv_slots, slot_mapping, starts, pos = [], [], [], [], 0
    for n, c in zip(q_lens, ctx_lens):
        nb = -(-c // BS)
        table, perm = perm[:nb], perm[nb:]
        slots = [table[p // BS] * BS + p % BS for p in range(c)]
        tables.append(table)
        kv_slots.append(torch.tensor(slots, dtype=torch.long))
        slot_mapping.extend(slots[c - n :])
        starts.append(pos)
        pos += n
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long),
        query_starts=starts,
        query_lens=list(q_lens),
        context_lens=list(ctx_lens),
        kv_slots=kv_slots,
        block_size=BS,
    )
    return md, kv_slots, tables


@pytest.mark.parametrize("batch", list(UNIT_BATCHES))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("poison", ["free_slots", "batch_mate"])
def test_reference_attention_ignores_nan_outside_own_positions(batch, window, poison):
    g = torch.Generator().manual_seed(sum(map(ord, f"{batch}-{window}-{poison}")))
    q_lens, ctx_lens = UNIT_BATCHES[batch]
    md, kv_slots, _ = unit_batch(q_lens, ctx_lens, mate_owns_block0=poison == "batch_mate", g=g)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    k_cache = torch.randn(NUM_BLOCKS * BS, HK, D, generator=g)
    v_cache = torch.randn(NUM_BLOCKS * BS, HK, D, generator=g)
    ref = reference_paged_attention(q, k_cache, v_cache, md, D**-0.5, window)

    owned = torch.zeros(NUM_BLOCKS * BS, dtype=torch.bool)
    owned[torch.cat(kv_slots)] = True
    if poison == "free_slots":  # nobody's: other blocks (block 0 among them), the tails of last blocks
        bad, checked = ~owned, range(len(q_lens))
    else:  # sequence 0's own slots, block 0 among them
        bad = torch.zeros_like(owned)
        bad[kv_slots[0]] = True
        checked = range(1, len(q_lens))
    assert bad[0], "the old padding slot must be poisoned"
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    k_bad[bad], v_bad[bad] = NAN, NAN
    out = reference_paged_attention(q, k_bad, v_bad, md, D**-0.5, window)

    for i in checked:
        rows = slice(md.query_starts[i], md.query_starts[i] + md.query_lens[i])
        assert torch.isfinite(out[rows]).all(), f"sequence {i} read NaN it does not own"
        assert torch.equal(out[rows], ref[rows]), f"sequence {i} changed by values it does not own"
    if poison == "batch_mate":  # guard: the poison is live where it belongs
        assert torch.isnan(out[md.query_starts[0]]).all()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(path, "llama", initializer_range=0.1)
    return path


def make_llm(model_dir, config: str) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=8, **CONFIGS[config])


def run(llm: LLM):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params(i) for i in range(len(PROMPTS))])


@pytest.fixture(scope="module")
def clean():
    """config -> (outputs, schedule log) of a clean engine, built on first use."""
    return {}


def clean_run(model_dir, clean, config: str):
    if config not in clean:
        llm = make_llm(model_dir, config)
        log = spy_schedule(llm)
        clean[config] = (run(llm), log)
    return clean[config]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("scenario", ["free_blocks", "free_blocks_and_batch_mate"])
def test_nan_kv_elsewhere_leaves_every_answer_bit_identical(model_dir, clean, config, scenario):
    ref, ref_log = clean_run(model_dir, clean, config)
    llm = make_llm(model_dir, config)
    log = spy_schedule(llm)
    poison_free_blocks(llm)
    mate_nan = poison_mate(llm, PROMPTS[MATE]) if scenario == "free_blocks_and_batch_mate" else None
    got = run(llm)

    skip = {MATE} if mate_nan is not None else set()
    assert_bit_identical(ref, got, skip)

    assert log == ref_log, "the poisoned run must schedule exactly as the clean one"
    assert padded_decode_steps(log) > 0, "no batched decode over different context lengths"
    if "chunked" in config:
        assert chunked_steps(log) > 0, "no prefill was split into chunks"
    if "preemption" in config:
        assert llm.engine.scheduler.num_preemptions > 0, "the small KV cache never forced a preemption"
    if mate_nan is not None:  # its first step reads only what that step wrote; later ones read the NaN
        assert any(mate_nan), "the batch-mate's own logits were never NaN: the poison was not live"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
