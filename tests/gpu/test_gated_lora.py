"""silu_and_mul_lora (gate_up's LoRA delta added in the SiLU-and-mul launch) against torch on random data.

The reference is the unfused path's numbers: the base GEMM rounded to the activations' dtype, plus the
torch_ops delta in fp32, rounded once more, then ``silu_and_mul_torch``. Random A and B, garbage past
each slot's rank in A, tokens of no adapter that must get exactly the base activation, a slot absent
from the batch. Runs on CUDA, or on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.test_decode_linear import lora_stacks, mapping_of, rel_err
from tests.gpu.triton_device import skip_interpreted_bf16, triton_device

DEV = triton_device()

from loraserve.layers.activation import silu_and_mul_torch  # noqa: E402
from loraserve.layers.triton_decode_linear import decode_linear  # noqa: E402
from loraserve.layers.triton_elementwise import silu_and_mul  # noqa: E402
from loraserve.lora.ops import torch_ops  # noqa: E402
from loraserve.lora.ops.precision import compute_dtype  # noqa: E402
from loraserve.lora.ops.triton.gated_lora import silu_and_mul_lora  # noqa: E402
from loraserve.lora.ops.triton.lora_shrink import lora_shrink  # noqa: E402

CASES = [
    # M, K, D (each half), S, R, x dtype, LoRA dtype, block_n
    (32, 256, 256, 8, 16, torch.float16, torch.float32, 32),
    (32, 256, 256, 8, 16, torch.float16, torch.float16, 64),
    (5, 128, 192, 3, 8, torch.float16, torch.float32, 64),  # three column blocks, a token count off the tile
    (17, 384, 128, 12, 16, torch.float16, torch.float32, 32),  # two chunks of slots
    (9, 128, 64, 5, 64, torch.float16, torch.float16, 64),  # rank 64: two slots a chunk
    (1, 128, 128, 2, 16, torch.float16, torch.float32, 128),
    (32, 512, 256, 8, 16, torch.bfloat16, torch.bfloat16, 64),
    (32, 512, 256, 8, 16, torch.bfloat16, torch.float32, 32),
    (32, 512, 256, 8, 16, torch.bfloat16, torch.float16, 64),  # the GPU's auto storage: tf32 products
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-D{c[2]}-S{c[3]}-R{c[4]}-{c[5]}-{c[6]}-bn{c[7]}")
def test_silu_and_mul_lora_matches_reference(case, monkeypatch):
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    monkeypatch.setattr(shrink_mod, "_new_buf", lambda shape, device: torch.full(shape, float("nan"), device=device))
    M, K, D, S, R, xdt, wdt, block_n = case
    skip_interpreted_bf16(xdt, wdt)
    g = torch.Generator().manual_seed(M * 11 + K + D)
    ranks = torch.randint(1, R + 1, (S,), generator=g).tolist()
    ranks[0] = R
    if S > 3:
        ranks[1] = 0  # an empty slot in the batch: its tokens get no delta
    x = torch.randn(M, K, generator=g).to(DEV, xdt)
    w = (torch.randn(2 * D, K, generator=g) * 0.05).to(DEV, xdt)
    As, Bs = lora_stacks(g, S, R, K, (D, D), ranks, wdt)
    slots = [-1 if t % 3 == 2 else t % max(S - 1, 1) for t in range(M)]
    mapping, meta = mapping_of(slots)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    buf = lora_shrink(x, As, meta, rank_dev, R, zero_fill=True)
    y = decode_linear(x, w)
    out = silu_and_mul_lora(y, buf, Bs, mapping.token_slots, block_n=block_n)

    ref = F.linear(x.float(), w.float()).to(xdt).float()
    off = 0
    for a, b in zip(As, Bs):
        h = torch.zeros(M, R, dtype=compute_dtype(xdt, wdt), device=DEV)
        torch_ops.lora_shrink(x, a, mapping.token_segments, ranks, h)
        torch_ops.lora_expand(ref, h, b, mapping.token_segments, ranks, off, act_dtype=xdt)
        off += D
    ref = silu_and_mul_torch(ref.to(xdt))
    assert rel_err(out, ref) < 1e-2
    # the base activation by the SiLU-and-mul kernel this one replaces (same formula: torch's fp16 silu on
    # the CPU may differ from it by an ulp)
    base = silu_and_mul(y)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    lora_rows = [t for t, s in enumerate(slots) if s >= 0 and ranks[s] > 0]
    empty_rows = [t for t, s in enumerate(slots) if s >= 0 and ranks[s] == 0]
    # base tokens, and tokens of a rank-0 slot, get exactly the base activation; LoRA tokens moved (no
    # vacuous pass with a zero delta)
    assert torch.equal(out[base_rows], base[base_rows])
    assert torch.equal(out[empty_rows], base[empty_rows])
    assert not torch.equal(out[lora_rows], base[lora_rows])


def test_silu_and_mul_lora_equals_the_epilogue_path():
    """The same numbers as the GEMM with the delta in its epilogue followed by silu_and_mul (the path it
    replaces): the same roundings of the same fp32 sums in the same order, so bit for bit equal."""
    from loraserve.layers.triton_decode_linear import ExpandEpilogue

    g = torch.Generator().manual_seed(3)
    M, K, D, S, R = 24, 256, 128, 4, 16
    ranks = [16, 8, 16, 4]
    x = torch.randn(M, K, generator=g).to(DEV, torch.float16)
    w = (torch.randn(2 * D, K, generator=g) * 0.05).to(DEV, torch.float16)
    As, Bs = lora_stacks(g, S, R, K, (D, D), ranks, torch.float16)
    slots = [t % S for t in range(M)]
    mapping, meta = mapping_of(slots)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    buf = lora_shrink(x, As, meta, rank_dev, R, zero_fill=True)
    ref = silu_and_mul(decode_linear(x, w, lora=ExpandEpilogue(buf, Bs, mapping.token_slots)))
    out = silu_and_mul_lora(decode_linear(x, w), buf, Bs, mapping.token_slots, block_n=64)
    assert torch.equal(out, ref)


def test_silu_and_mul_lora_refuses_shapes_that_do_not_fit():
    x = torch.zeros(4, 64, dtype=torch.float16, device=DEV)
    buf = torch.zeros(1, 2, 4, 16, device=DEV)
    b = torch.zeros(2, 1, 32, 16, dtype=torch.float16, device=DEV)
    slots = torch.zeros(4, dtype=torch.int32, device=DEV)
    with pytest.raises(AssertionError, match="buf"):
        silu_and_mul_lora(x, buf[:, :1], (b, b), slots)
    with pytest.raises(AssertionError, match="B"):
        silu_and_mul_lora(x, buf, (b, b[:, :, :16].contiguous()), slots)
    with pytest.raises(AssertionError, match="tokens"):
        silu_and_mul_lora(torch.zeros(33, 64, dtype=torch.float16, device=DEV), buf, (b, b), slots)
    with pytest.raises(AssertionError, match="multiple of block_n"):
        silu_and_mul_lora(x, buf, (b, b), slots, block_n=64)


@pytest.mark.parametrize("n_lora_tokens", [0, 7])
@pytest.mark.parametrize("K", [256, 1024], ids=["one-split", "gemm-split-k-4"])
def test_ops_path_equals_linear_with_lora_then_silu_and_mul(n_lora_tokens, K, monkeypatch):
    """TritonLoRAOps.linear_with_lora(then_silu_and_mul=True) (shrink, plain GEMM, the gated kernel) against the path it
    replaces (linear_with_lora, then silu_and_mul); a batch of base tokens only gets the base bits. And it
    declines (None) where ``prefer`` says no (K past GATED_MAX_K)."""
    from loraserve.lora.ops.triton import gated_lora
    from loraserve.lora.ops.triton_ops import TritonLoRAOps

    g = torch.Generator().manual_seed(n_lora_tokens + K)
    M, D, S, R = 12, 128, 4, 16
    ranks = [16, 8, 16, 4]
    x = torch.randn(M, K, generator=g).to(DEV, torch.float16)
    w = (torch.randn(2 * D, K, generator=g) * 0.05).to(DEV, torch.float16)
    As, Bs = lora_stacks(g, S, R, K, (D, D), ranks, torch.float32)
    slots = [t % S if t < n_lora_tokens else -1 for t in range(M)]
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    out = ops.linear_with_lora(x, w, None, As, Bs, ranks, meta, mapping.token_slots, then_silu_and_mul=True)
    assert out is not None, "a small gate_up at decode sizes takes the gated path"
    ref = silu_and_mul(ops.linear_with_lora(x, w, None, As, Bs, ranks, meta, mapping.token_slots))
    assert torch.equal(out, ref)
    if n_lora_tokens == 0:
        assert torch.equal(out, silu_and_mul(decode_linear(x, w)))
    monkeypatch.setattr(gated_lora, "GATED_MAX_K", K - 1)
    assert ops.linear_with_lora(x, w, None, As, Bs, ranks, meta, mapping.token_slots, then_silu_and_mul=True) is None


def test_ops_path_declines_where_the_gated_kernel_does_not_apply():
    """None (the caller takes the epilogue path, then SiLU-and-mul) for slices that are not a gate/up pair of equal halves, halves that are not a multiple of its column block, and a batch
    whose slots all have rank 0 (nothing to add)."""
    from loraserve.lora.ops.triton_ops import TritonLoRAOps

    g = torch.Generator().manual_seed(5)
    M, K, S, R = 8, 256, 2, 16
    x = torch.randn(M, K, generator=g).to(DEV, torch.float16)
    slots = [t % S for t in range(M)]
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)

    def gated(outs, ranks):
        w = (torch.randn(sum(outs), K, generator=g) * 0.05).to(DEV, torch.float16)
        As, Bs = lora_stacks(g, S, R, K, outs, ranks, torch.float16)
        return ops.linear_with_lora(x, w, None, As, Bs, ranks, meta, mapping.token_slots, then_silu_and_mul=True)

    assert gated((128, 128), [16, 8]) is not None, "the cases below differ from this taken one by one thing"
    assert gated((128, 128, 128), [16, 8]) is None, "three slices"
    assert gated((128, 64), [16, 8]) is None, "unequal halves"
    assert gated((96, 96), [16, 8]) is None, "halves not a multiple of the column block"
    assert gated((128, 128), [0, 0]) is None, "no rank in the batch"
