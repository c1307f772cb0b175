"""o's LoRA shrink computed in the decode attention launch (``paged_attention(..., shrink=)``) against the
shrink launch of its output, on random caches and adapters. Runs on CUDA, or on the CPU under
TRITON_INTERPRET=1 (fp16; the interpreter's bf16 dots are wrong).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_device import skip_interpreted_bf16, triton_device

DEV = triton_device()

from loraserve.layers.triton_attention import paged_attention, shrink_supports  # noqa: E402
from loraserve.lora.ops.triton.lora_shrink import lora_shrink  # noqa: E402
from tests.gpu.attention_batches import make_batch  # noqa: E402
from tests.gpu.test_decode_linear import lora_stacks, mapping_of  # noqa: E402

# NOTE: the interpreter running the attention kernel warns on numpy scalar conversions (its own code)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CASES = [
    # tokens (one a sequence), q heads, kv heads, head_dim, slots, R, dtype
    (6, 14, 2, 64, 4, 16, torch.float16),  # Qwen2.5-0.5B's group of 7
    (5, 8, 2, 32, 3, 8, torch.float16),  # rank 8 of a 16-column tile
    (3, 4, 4, 32, 2, 64, torch.float16),  # MHA: 4 planes, rank 64
    (4, 8, 1, 32, 2, 16, torch.float16),  # MQA: one plane, a group of 8
    (32, 32, 8, 128, 8, 16, torch.bfloat16),  # Llama-8B's shape
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-KV{c[2]}-D{c[3]}-S{c[4]}-R{c[5]}-{c[6]}")
def test_decode_attention_computes_os_shrink(case):
    """obuf's planes (one per KV head) summed in order = the output @ A[slot]^T per LoRA token, as
    ``lora_shrink(out, ..., zero_fill=True)`` (the sum of exact products in another order: within fp32
    rounding), zeros past each slot's rank whatever A holds there; the output bits unchanged by the shrink;
    o's GEMM given obuf as its shrink (split-K planes) as with its own shrink launch."""
    T, H, KV, D, S, R, dtype = case
    skip_interpreted_bf16(dtype)
    g = torch.Generator().manual_seed(T + H + KV + D + R)
    ctx = torch.randint(1, 40, (T,), generator=g).tolist()
    md = make_batch(g, [1] * T, ctx, 4, 12 * T, DEV)
    q = torch.randn(T, H, D, generator=g).to(DEV, dtype)
    k_cache = torch.randn(12 * T * 4, KV, D, generator=g).to(DEV, dtype)
    v_cache = torch.randn(12 * T * 4, KV, D, generator=g).to(DEV, dtype)
    ranks = torch.randint(1, R + 1, (S,), generator=g).tolist()
    ranks[0] = R
    (A,), _ = lora_stacks(g, S, R, H * D, (16,), ranks, dtype)
    slots = [-1 if t % 3 == 2 else t % S for t in range(T)]
    mapping, meta = mapping_of(slots)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    assert shrink_supports(q, KV, md, A)
    out, obuf = paged_attention(q, k_cache, v_cache, md, D**-0.5, None, shrink=(A, rank_dev, mapping.token_slots))
    assert torch.equal(out, paged_attention(q, k_cache, v_cache, md, D**-0.5, None))
    flat = out.reshape(T, H * D)
    ref = lora_shrink(flat, (A,), meta, rank_dev, R, zero_fill=True)
    lora_rows = [t for t, s in enumerate(slots) if s >= 0]
    exact = torch.stack([A[slots[t], 0].double().cpu() @ flat[t].double().cpu() for t in lora_rows])
    for j, t in enumerate(lora_rows):
        exact[j, ranks[slots[t]] :] = 0.0
    assert obuf.shape == (KV, 1, T, R)
    total = obuf[0, 0]
    for p in range(1, KV):  # in plane order, as the GEMM's epilogue sums them
        total = total + obuf[p, 0]
    got = total[lora_rows].double().cpu()
    scale = exact.abs().max().item()
    assert scale > 0
    assert (got - exact).abs().max().item() <= 1e-5 * scale
    assert (got - ref[0, 0, lora_rows].double().cpu()).abs().max().item() <= 1e-5 * scale
    # o's GEMM with obuf for its shrink: what it gives with its own shrink launch
    if T <= 32 and D * H % 64 == 0:
        from loraserve.lora.ops.triton_ops import TritonLoRAOps

        w = (torch.randn(128, H * D, generator=g) * 0.05).to(DEV, dtype)
        _, Bs = lora_stacks(g, S, R, 8, (128,), ranks, dtype)
        ops = TritonLoRAOps(DEV)
        y = ops.linear_with_lora(flat, w, None, (A,), Bs, ranks, meta, mapping.token_slots, shrunk=obuf)
        want = ops.linear_with_lora(flat, w, None, (A,), Bs, ranks, meta, mapping.token_slots)
        assert y is not None and want is not None
        assert (y.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()


def test_shrink_supports_only_a_decode_step_with_half_precision_a():
    g = torch.Generator().manual_seed(0)
    md_decode = make_batch(g, [1, 1], [5, 9], 4, 8, DEV)
    md_prefill = make_batch(g, [3, 1], [3, 9], 4, 8, DEV)
    q = torch.zeros(2, 4, 32, dtype=torch.float16, device=DEV)
    a = torch.zeros(2, 1, 16, 128, dtype=torch.float16, device=DEV)
    assert shrink_supports(q, 2, md_decode, a)
    assert not shrink_supports(q, 2, md_prefill, a), "prefill"
    assert not shrink_supports(q, 2, md_decode, a.float()), "fp32 A"
    assert not shrink_supports(q, 2, md_decode, a[:, :, :, :64]), "A's columns are not q's heads x head_dim"
    assert shrink_supports(q, 2, md_decode, torch.zeros(2, 1, 128, 128, dtype=torch.float16, device=DEV)), "8192"
    big = torch.zeros(2, 1, 256, 128, dtype=torch.float16, device=DEV)
    assert not shrink_supports(q, 2, md_decode, big), "rank 256: a tile of 2 heads x 256 x 32 past MAX_SHRINK_TILE"
