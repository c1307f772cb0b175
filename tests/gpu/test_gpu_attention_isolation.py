"""No request reads another's KV on the GPU: the Triton twin of tests/engine/test_attention_isolation.py.

Kernel level: ``paged_attention`` over a cache whose every slot outside the batch's sequences (block 0,
the block tables' padding, among them) and the unwritten rest of each last block is NaN, or whose one
batch-mate's own slots are NaN, gives every other row bit-identical to a clean cache.

Engine level (tests/kv_poison.py), bf16 and fp32, eager and with CUDA graphs + async scheduling:
every free block NaN (and the graphs' scratch block), with and without a batch-mate whose KV is NaN;
every other request's token ids and logprobs bit-identical to a clean run.

The kernel level also runs on the CPU under ``TRITON_INTERPRET=1`` (fp32; the interpreter has no bf16);
the engine level needs CUDA. CI has neither.
"""

from __future__ import annotations

import pytest
import torch
from triton_device import skip_interpreted_bf16, triton_device  # noqa: E402

DEV = triton_device()

from attention_batches import make_batch  # noqa: E402
from helpers import make_tiny_model  # noqa: E402
from kv_poison import (  # noqa: E402
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

from loraserve import LLM  # noqa: E402
from loraserve.forward_context import AttentionMetadata  # noqa: E402
from loraserve.layers.triton_attention import paged_attention  # noqa: E402

NAN = float("nan")
BS, NUM_BLOCKS = 16, 200

# (query lens, context lens): every query ends at its context's end; contexts not multiples of BS
KERNEL_BATCHES = {
    "decode": ([1] * 6, [9, 1, 230, 140, 66, 17]),
    "mixed": ([1, 70, 1, 50, 130], [90, 70, 3, 220, 130]),  # decode, full prefill, chunked prefill
}


def kernel_batch(q_lens, ctx_lens, mate_owns_block0: bool, g: torch.Generator) -> AttentionMetadata:
    """Metadata with blocks scattered over the cache, tables padded with block 0; block 0 is the first
    block of sequence 0 when ``mate_owns_block0``, else nobody's."""
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
    if mate_owns_block0:
        perm.insert(0, 0)
    return make_batch(g, q_lens, ctx_lens, BS, NUM_BLOCKS, DEV, blocks=perm)


@pytest.mark.parametrize("batch", list(KERNEL_BATCHES))
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("poison", ["free_slots", "batch_mate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (32, 8, 128)], ids=["qwen05b", "llama8b"])
def test_paged_attention_ignores_nan_outside_own_positions(
    batch, window, poison, dtype, heads, kv_heads, head_dim
):
    skip_interpreted_bf16(dtype)
    g = torch.Generator().manual_seed(sum(map(ord, f"{batch}-{window}-{poison}-{heads}")))
    q_lens, ctx_lens = KERNEL_BATCHES[batch]
    md = kernel_batch(q_lens, ctx_lens, mate_owns_block0=poison == "batch_mate", g=g)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(DEV, dtype)
    k_cache = torch.randn(NUM_BLOCKS * BS, kv_heads, head_dim, generator=g).to(DEV, dtype)
    v_cache = torch.randn(NUM_BLOCKS * BS, kv_heads, head_dim, generator=g).to(DEV, dtype)
    ref = paged_attention(q, k_cache, v_cache, md, head_dim**-0.5, window)

    owned = torch.zeros(NUM_BLOCKS * BS, dtype=torch.bool, device=DEV)
    owned[torch.cat(md.kv_slots)] = True
    if poison == "free_slots":  # nobody's: other blocks (block 0 among them), the tails of last blocks
        bad, checked = ~owned, range(len(q_lens))
    else:  # sequence 0's own slots, block 0 among them
        bad = torch.zeros_like(owned)
        bad[md.kv_slots[0]] = True
        checked = range(1, len(q_lens))
    assert bad[0], "block 0 (the tables' padding) must be poisoned"
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    k_bad[bad], v_bad[bad] = NAN, NAN
    out = paged_attention(q, k_bad, v_bad, md, head_dim**-0.5, window)
    if DEV.type == "cuda":
        torch.cuda.synchronize()

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


MODES = {"eager": dict(enforce_eager=True, async_scheduling=False), "graphs_async": dict()}


def make_llm(model_dir, config: str, dtype: str, mode: str) -> LLM:
    kw = dict(CONFIGS[config], **MODES[mode])
    return LLM(model=str(model_dir), dtype=dtype, max_model_len=128, max_num_seqs=8, device="cuda", **kw)


def run(llm: LLM):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params(i) for i in range(len(PROMPTS))])


@pytest.fixture(scope="module")
def clean():
    """(config, dtype, mode) -> (outputs, schedule log) of a clean engine, built on first use."""
    return {}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("scenario", ["free_blocks", "free_blocks_and_batch_mate"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", list(MODES))
def test_nan_kv_elsewhere_leaves_every_answer_bit_identical(model_dir, clean, config, scenario, dtype, mode):
    if DEV.type != "cuda":
        pytest.skip("the engine level needs CUDA (graphs, the Triton attention bound by the engine)")
    key = (config, dtype, mode)
    if key not in clean:
        llm = make_llm(model_dir, config, dtype, mode)
        log = spy_schedule(llm)
        clean[key] = (run(llm), log)
    ref, ref_log = clean[key]
    llm = make_llm(model_dir, config, dtype, mode)
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
    if mate_nan is not None:
        assert any(mate_nan), "the batch-mate's own logits were never NaN: the poison was not live"
    if mode == "graphs_async":
        assert llm.engine.runner.graphs is not None, "the CUDA graphs were turned off"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
