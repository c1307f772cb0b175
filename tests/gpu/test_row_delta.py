"""row_delta: a row-parallel projection's LoRA delta left to the RMSNorm that reads its output, on random data.

- ``fused_add_rms_norm`` / ``norm_shrink`` given x's pending delta give what they give on x + delta computed
  in float64 and rounded (PEFT's order), to within a rounding of x's dtype on a few elements (the delta's
  fp32 sum over ranks in another order); base tokens' rows, whose shrink rows hold NaN, are the no-delta
  outputs bit for bit; the shrink's split planes are summed;
- ``PendingDelta.add_to`` (the torch path of a reader without the kernel) gives the same numbers;
- ``TritonLoRAOps.linear_deferring_delta`` returns the base GEMM's output and a delta that, added, gives the
  fused path's output (the decoder's wiring: test_norm_shrink's tiny LoRA'd Llama).

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (fp16 there: the interpreter has no bf16).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_decode_linear import lora_stacks, rel_err
from tests.gpu.test_norm_shrink import HALF, mapping_of
from tests.gpu.triton_device import triton_device

DEV = triton_device()

from loraserve.layers import triton_elementwise as tew  # noqa: E402
from loraserve.lora.ops.precision import compute_dtype  # noqa: E402
from loraserve.lora.ops.triton import norm_shrink as ns  # noqa: E402
from loraserve.lora.ops.triton import row_delta  # noqa: E402
from loraserve.lora.ops.triton_ops import TritonLoRAOps  # noqa: E402
from loraserve.lora.punica import PendingDelta  # noqa: E402

CASES = [
    # T, N, S, R, planes
    (32, 896, 8, 16, 1),  # Qwen2.5-0.5B's hidden size: a row block of 1024
    (5, 256, 3, 32, 3),  # the shrink's split planes, summed here
    (9, 576, 5, 8, 2),  # SmolLM2-135M's hidden size; a rank under the 16-wide tile
    (3, 2048, 3, 16, 1),  # MAX_HIDDEN
]


def random_ranks_and_slots(g: torch.Generator, T: int, S: int, R: int) -> tuple[list[int], list[int]]:
    """Random ranks up to R (slot 0 at R, slot 1 at 0 where S > 2: its tokens get no delta) and the tokens' slots,
    round-robin with every fourth token a base one (-1)."""
    ranks = torch.randint(1, R + 1, (S,), generator=g).tolist()
    ranks[0] = R
    if S > 2:
        ranks[1] = 0
    return ranks, [-1 if t % 4 == 3 else t % S for t in range(T)]


def random_delta(T, N, S, R, planes, xdt, bdt, seed):
    """(x, residual, norm weight, PendingDelta, slots, ranks): slots round-robin with base tokens, a slot of
    rank 0 (B zero), NaN in the shrink's rows of base tokens (never read) and zeros past each slot's rank."""
    g = torch.Generator().manual_seed(seed)
    ranks, slots = random_ranks_and_slots(g, T, S, R)
    x = torch.randn(T, N, generator=g).to(DEV, xdt)
    res = torch.randn(T, N, generator=g).to(DEV, xdt)
    w = (1 + 0.3 * torch.randn(N, generator=g)).to(DEV, xdt)
    _, (b,) = lora_stacks(g, S, R, 16, (N,), ranks, bdt)
    b = b * 20  # deltas of order 1: every output moves
    buf = torch.randn(planes, 1, T, R, generator=g)
    for t, s in enumerate(slots):
        if s < 0:
            buf[:, 0, t] = float("nan")
        else:
            buf[:, 0, t, ranks[s]:] = 0.0
    mapping, _ = mapping_of(slots)
    return x, res, w, PendingDelta(buf.to(DEV), b, mapping.token_slots), slots, ranks


def x_plus_delta(x: torch.Tensor, delta: PendingDelta, slots: list[int]) -> torch.Tensor:
    """x + B[slot] s in float64 (s the planes' fp32 sum in order, rounded to the products' dtype), rounded to x's dtype."""
    cdt = compute_dtype(x.dtype, delta.lora_b.dtype)
    out = x.double().cpu()
    for t, s in enumerate(slots):
        if s < 0:
            continue
        st = delta.buf[0, 0, t].cpu()
        for p in range(1, delta.buf.shape[0]):
            st = st + delta.buf[p, 0, t].cpu()
        st = st.to(cdt).double()
        out[t] += delta.lora_b[s, 0].cpu().double() @ st
    return out.to(x.dtype).to(DEV)


def assert_within_a_rounding(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """Equal but for a few elements a rounding or two apart at ``scale`` (x + delta's magnitude: an fp32 sum's
    order moved a tie there, and the residual add may cancel what it is added to)."""
    diff = (got.float() - want.float()).abs()
    ulp = torch.finfo(got.dtype).eps * scale.float().abs()
    assert (diff <= 2 * ulp).all(), f"{what}: off by {(diff / ulp.clamp(min=1e-30)).max().item():.1f} roundings"
    assert (diff > 0).float().mean() < 0.02, f"{what}: {(diff > 0).float().mean().item():.3f} of the elements differ"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-N{c[1]}-S{c[2]}-R{c[3]}-P{c[4]}")
@pytest.mark.parametrize("dtypes", [(x, b) for x in HALF for b in HALF], ids=lambda d: f"{d[0]}-B{d[1]}"[6:])
def test_fused_add_rms_norm_adds_the_pending_delta(case, dtypes):
    T, N, S, R, planes = case
    x, res, w, delta, slots, ranks = random_delta(T, N, S, R, planes, *dtypes, seed=T + N + planes)
    out, new_res = tew.fused_add_rms_norm(x, res, w, 1e-6, delta=delta)
    xd = x_plus_delta(x, delta, slots)
    _, want_res = tew.fused_add_rms_norm(xd, res, w, 1e-6)
    assert_within_a_rounding(new_res, want_res, xd.abs() + res.abs(), "x + delta + residual")
    assert torch.equal(out, tew.rms_norm(new_res, w, 1e-6)), "the norm of that sum, the norm kernel's bits"
    plain_out, plain_res = tew.fused_add_rms_norm(x, res, w, 1e-6)
    moved = [t for t, s in enumerate(slots) if s >= 0 and ranks[s] > 0]
    still = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    assert not torch.equal(new_res[moved], plain_res[moved]), "the delta was added"
    assert torch.equal(new_res[still], plain_res[still]) and torch.equal(out[still], plain_out[still]), (
        "base tokens and a rank-0 slot: the plain norm's bits (their shrink rows of NaN unread)"
    )


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"T{c[0]}-N{c[1]}-S{c[2]}-R{c[3]}-P{c[4]}")
def test_norm_shrink_adds_the_pending_delta(case):
    T, N, S, R, planes = case
    x, res, w, delta, slots, _ = random_delta(T, N, S, R, planes, torch.float16, torch.float16, seed=5 + T)
    g = torch.Generator().manual_seed(11)
    a_ranks = [16] * S
    As, _ = lora_stacks(g, S, 16, N, (64, 64), a_ranks, torch.float16)
    rank_dev = torch.tensor(a_ranks, dtype=torch.int32, device=DEV)
    out, new_res, buf = ns.norm_shrink(x, res, w, 1e-6, As, delta.token_slots, rank_dev, delta=delta)
    xd = x_plus_delta(x, delta, slots)
    _, want_res, want_buf = ns.norm_shrink(xd, res, w, 1e-6, As, delta.token_slots, rank_dev)
    assert_within_a_rounding(new_res, want_res, xd.abs() + res.abs(), "x + delta + residual")
    assert torch.equal(out, tew.rms_norm(new_res, w, 1e-6)), "the norm of that sum, the norm kernel's bits"
    lora_rows = [t for t, s in enumerate(slots) if s >= 0]
    assert rel_err(buf[:, :, lora_rows], want_buf[:, :, lora_rows]) < 1e-2, "the shrink of the norm's output"


@pytest.mark.parametrize("bdt", HALF)
def test_add_to_is_the_kernels_numbers_in_torch(bdt):
    x, _, _, delta, slots, _ = random_delta(9, 256, 4, 16, 2, torch.float16, bdt, seed=3)
    xd = x_plus_delta(x, delta, slots)
    assert_within_a_rounding(delta.add_to(x), xd, xd, "add_to")


def test_supports_refuses_what_it_cannot_add():
    b = torch.zeros(4, 1, 896, 16, dtype=torch.float16, device=DEV)
    assert row_delta.supports(torch.bfloat16, b) and row_delta.supports(torch.float16, b)
    assert not row_delta.supports(torch.float32, b), "fp32 activations"
    assert not row_delta.supports(torch.float16, b.float()), "fp32 B: the epilogue takes it"
    wide = torch.zeros(2, 1, 2 * row_delta.MAX_HIDDEN, 16, dtype=torch.float16, device=DEV)
    assert not row_delta.supports(torch.float16, wide), "a row past MAX_HIDDEN: B's tile would not fit registers"
    assert not row_delta.supports(torch.float16, b.transpose(2, 3).contiguous().transpose(2, 3)), "B not (N, R) per slot"


@pytest.mark.parametrize("adt", [torch.float16, torch.float32], ids=["A-fp16", "A-fp32"])
@pytest.mark.parametrize("xdt", HALF)
@pytest.mark.parametrize(
    "M,K,N,S,R",
    [(32, 896, 896, 8, 16), (5, 256, 256, 4, 16), (17, 640, 192, 2, 32), (1, 4864, 896, 8, 16)],
    ids=["qwen-o", "small", "R32-K-not-a-multiple", "qwen-down-one-token"],
)
def test_decode_linear_computes_the_shrink_columns(M, K, N, S, R, xdt, adt):
    """``decode_linear(shrink_into=(rows, s))`` with A's pieces in W's dtype (``exact_pieces``: one where A is
    W's dtype, else two): y bit for bit the plain GEMM's (same tiles, split-K or not); s every row's x A^T in fp32,
    float64's to within fp32 sums (half-precision products are exact); the pieces' planes summed are x A^T of A
    itself (exactly A for fp16 A in bf16 pieces, to 16 bits for fp32 A), garbage past a rank included (B's zeros
    there cancel it); every token's row written."""
    from loraserve.layers.triton_decode_linear import decode_linear, default_tiles
    from loraserve.lora.ops.precision import exact_pieces

    g = torch.Generator().manual_seed(M + K)
    (a,), _ = lora_stacks(g, S, R, K, (N,), [R] * (S - 1) + [R // 2], adt)
    x = torch.randn(M, K, generator=g).to(DEV, xdt)
    weight = (torch.randn(N, K, generator=g) * 0.05).to(DEV, xdt)
    rows = torch.stack(exact_pieces(a[:, 0], xdt)).contiguous()  # (P, S, R, K)
    P = rows.shape[0]
    assert P == (1 if adt == xdt else 2)
    tiles = default_tiles(M, N, K, xdt)
    s = torch.full((M, P * S * R), float("nan"), device=DEV)
    y = decode_linear(x, weight, tiles=tiles, shrink_into=(rows.view(P * S * R, K), s))
    assert torch.equal(y, decode_linear(x, weight, tiles=tiles)), "W's columns are the plain GEMM's"
    assert not s.isnan().any(), "every token's row, every column written"
    want = x.double() @ rows.view(P * S * R, K).double().T
    assert rel_err(s, want) < 1e-5, f"s vs float64: {rel_err(s, want):.2e}"
    summed = s.view(M, P, S * R).sum(1)
    exact = x.double() @ a.view(S * R, K).double().T
    bound = 1e-5 if adt != torch.float32 else 3e-5  # fp32 A: its lo piece keeps 8 of the 16 bits hi dropped
    assert rel_err(summed, exact) < bound, f"the pieces' sum vs A's own product: {rel_err(summed, exact):.2e}"


def test_exact_pieces_sum_to_a():
    from loraserve.lora.ops.precision import exact_pieces

    g = torch.Generator().manual_seed(0)
    a32 = torch.randn(64, 256, generator=g) * torch.logspace(-6, 3, 256)
    a16 = a32.to(torch.float16)
    (same,) = exact_pieces(a16, torch.float16)
    assert same is a16, "A already in the dtype: itself"
    hi, lo = exact_pieces(a16, torch.bfloat16)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi.double() + lo.double(), a16.double()), "fp16 in two bf16 pieces: exact"
    assert not torch.equal(hi.double(), a16.double()), "hi alone loses bits (lo is not all zero)"
    hi, lo = exact_pieces(a32, torch.bfloat16)
    err = ((hi.double() + lo.double()) - a32.double()).abs() / a32.double().abs()
    assert err.max() < 2**-15, f"fp32 in two bf16 pieces: 16 bits kept, {err.max().item():.2e}"


@pytest.mark.parametrize("gemm_shrink,adt", [(True, torch.float16), (True, torch.float32), (False, torch.float16)],
                         ids=["shrink-in-gemm", "shrink-in-gemm-A-fp32-two-pieces", "shrink-launch"])  # fmt: skip
def test_linear_deferring_delta_is_the_base_gemm_and_its_delta(gemm_shrink, adt):
    """gemm_shrink: the layer's A rows for the GEMM's shrink columns, or none (the shrink launch, which shapes the
    GEMM's columns do not fit take)."""
    from loraserve.lora.ops.precision import exact_pieces

    T, K, N, S, R = 12, 256, 128, 4, 16
    g = torch.Generator().manual_seed(4)
    ranks = [16, 8, 0, 4]
    As, Bs = lora_stacks(g, S, R, K, (N,), ranks, adt)
    Bs = tuple(b.half() for b in Bs)  # (row_delta adds half-precision B)
    for s, r in enumerate(ranks):
        As[0][s, :, r:] = 0.0  # as the layers keep it (reset_lora): the GEMM's shrink columns cover every rank row
    x = torch.randn(T, K, generator=g).to(DEV, torch.float16)
    weight = (torch.randn(N, K, generator=g) * 0.05).to(DEV, torch.float16)
    slots = [-1 if t % 5 == 4 else t % S for t in range(T)]
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    args = (x, weight, None, As, Bs, ranks, meta, mapping.token_slots)
    rows = torch.stack(exact_pieces(As[0][:, 0], weight.dtype)).contiguous() if gemm_shrink else None
    gemm_shrink_rows = (lambda: rows) if gemm_shrink else None  # as a layer's method
    y, delta = ops.linear_deferring_delta(*args, None, gemm_shrink_rows)
    assert delta.slot_cols == (R if gemm_shrink else 0), "every slot's shrink from the GEMM, or the token's own"
    assert delta.buf.shape[-1] == (S * R if gemm_shrink else R)
    from loraserve.layers.triton_decode_linear import decode_linear

    assert torch.equal(y, decode_linear(x, weight)), "the output is the base GEMM's"
    want = ops.linear_with_lora(*args)
    assert rel_err(delta.add_to(y), want) < 2e-3, "base + the deferred delta = the fused path"
    assert not torch.equal(delta.add_to(y), y), "the delta is not zero"
    if rows is not None:
        assert rows.shape[0] == (1 if adt == weight.dtype else 2), "A's pieces in W's dtype"
        assert delta.buf.shape[0] == rows.shape[0], "a plane per piece, summed by the reader"
    res, w = torch.randn_like(y), torch.ones(N, dtype=y.dtype, device=DEV)
    _, got_res = tew.fused_add_rms_norm(y, res, w, 1e-6, delta=delta)
    _, want_res = tew.fused_add_rms_norm(delta.add_to(y), res, w, 1e-6)
    assert_within_a_rounding(got_res, want_res, want_res.abs() + res.abs(), "the norm's launch adds it (its planes)")
    no_rank = (x, weight, None, As, Bs, [0] * S, meta, mapping.token_slots, None, gemm_shrink_rows)
    assert ops.linear_deferring_delta(*no_rank) is None, "no rank"
    two = ops.linear_deferring_delta(x, weight, None, As * 2, Bs * 2, ranks, meta, mapping.token_slots)
    assert two is None, "one slice only (a row-parallel projection)"


def test_a_deferred_delta_nobody_takes_is_an_error():
    from loraserve.forward_context import defer_delta, forward_context, take_deferred_delta

    y, other = torch.zeros(2, 4), torch.zeros(2, 4)
    with pytest.raises(RuntimeError, match="never taken"):
        with forward_context():
            defer_delta(y, "delta")
            assert take_deferred_delta(other) is None, "only the output it was deferred to takes it"
    with forward_context():
        defer_delta(y, "delta")
        assert take_deferred_delta(y) == "delta" and take_deferred_delta(y) is None, "taken once"
    with pytest.raises(RuntimeError, match="never taken"):
        with forward_context():
            defer_delta(y, "a")
            defer_delta(other, "b")  # the first was never taken
