"""Triton LoRA kernels (shrink + expand, 1-3 slices per launch) against the torch reference ops.

Random data everywhere (never zeros), garbage beyond each slot's rank (the kernels must not read it),
tokens of no adapter (slot -1) that must stay bit-identical, heterogeneous ranks including 0.
Runs on CUDA (the device machine), or on the CPU under TRITON_INTERPRET=1 (whose bf16 dots are wrong:
those cases skip there); CI has neither.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.triton_device import skip_interpreted_bf16, triton_device

DEV = triton_device()

from loraserve.forward_context import forward_context  # noqa: E402
from loraserve.lora.ops import torch_ops  # noqa: E402
from loraserve.lora.ops.precision import compute_dtype  # noqa: E402
from loraserve.lora.ops.triton import utils as triton_utils  # noqa: E402
from loraserve.lora.ops.triton.lora_shrink import lora_shrink  # noqa: E402
from loraserve.lora.ops.triton_ops import TritonLoRAOps  # noqa: E402
from loraserve.lora.punica import LoRAMapping, PunicaWrapper, SegmentMeta  # noqa: E402


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def stacked(g, max_loras, rank, n_in, n_out, ranks, dtype):
    """A (S, 1, R, in), B (S, 1, out, R): random inside each slot's rank, large garbage beyond it."""
    a = torch.randn(max_loras, 1, rank, n_in, generator=g) * 0.1
    b = torch.randn(max_loras, 1, n_out, rank, generator=g) * 0.1
    for s, r in enumerate(ranks):
        a[s, :, r:] = 1e4
        b[s, :, :, r:] = 1e4
    return a.to(DEV, dtype), b.to(DEV, dtype)


def meta_of(m: LoRAMapping) -> SegmentMeta:
    return SegmentMeta.build(m.token_order.cpu(), m.active_slots, m.seg_starts, m.seg_lens, DEV)


def reference(y0, x, As, Bs, segments, ranks):
    """fp32 y0 + per-slice delta with torch_ops (the CPU oracle, run on the same device).

    The intermediate is kept in the products' dtype (``precision.compute_dtype``: the weights', as PEFT's
    lora_A output is, fp32 by default; fp32 for fp16 weights with bf16 x).
    """
    y = y0.float().clone()
    off = 0
    for a, b in zip(As, Bs):
        buf = torch.zeros(x.shape[0], a.shape[2], dtype=compute_dtype(x.dtype, a.dtype), device=x.device)
        torch_ops.lora_shrink(x, a, segments, ranks, buf)
        torch_ops.lora_expand(y, buf, b, segments, ranks, off, act_dtype=x.dtype)
        off += b.shape[2]
    return y


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


CASES = [
    # T, max_loras, R, n_in, slice outs, x dtype, weight dtype, y dtype
    (16, 8, 16, 4096, (4096, 1024, 1024), torch.bfloat16, torch.bfloat16, torch.float32),
    (256, 32, 16, 4096, (4096, 1024, 1024), torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (64, 8, 64, 4096, (14336, 14336), torch.bfloat16, torch.float32, torch.bfloat16),
    (200, 8, 32, 14336, (4096,), torch.bfloat16, torch.float32, torch.float32),
    (37, 5, 16, 896, (896, 128, 128), torch.float16, torch.float16, torch.float16),
    (300, 6, 64, 512, (700, 300), torch.float32, torch.float32, torch.float32),
    (1, 4, 8, 64, (64, 32, 32), torch.bfloat16, torch.float32, torch.bfloat16),
    (1000, 3, 16, 1024, (2048,), torch.bfloat16, torch.bfloat16, torch.bfloat16),
    # fp16 weights with bf16 x (the GPU's auto storage): tf32 products (the prefill shrink's fp16, exact
    # too: lora_shrink.x_dot), s kept in fp32 (precision.py)
    (16, 8, 16, 4096, (4096, 1024, 1024), torch.bfloat16, torch.float16, torch.bfloat16),
    (256, 8, 16, 1024, (1024, 256, 256), torch.bfloat16, torch.float16, torch.float32),
    (200, 8, 32, 14336, (4096,), torch.bfloat16, torch.float16, torch.bfloat16),
    (1000, 3, 16, 1024, (2048, 256), torch.bfloat16, torch.float16, torch.bfloat16),  # prefill sizes
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"T{c[0]}-S{c[1]}-R{c[2]}-{len(c[4])}sl-{c[5]}-{c[6]}-{c[7]}"
)
@pytest.mark.parametrize("seed", [0, 1])
def test_add_lora_linear_matches_reference(case, seed):
    check_add_lora_linear(case, seed)


def random_case(case, seed, top_rank=None):
    """Random inputs of a case: ranks up to ``top_rank`` (R if None) with an empty slot (when S > 2),
    tokens of no adapter; returns (mapping, ranks, As, Bs, x, y0, base) where ``base`` marks the tokens
    that get no delta."""
    T, S, R, n_in, outs, xdt, wdt, ydt = case
    skip_interpreted_bf16(compute_dtype(xdt, wdt))  # the dots' dtype: bf16 loads convert fine
    g = torch.Generator().manual_seed(seed)
    top = top_rank or R
    ranks = torch.randint(1, top + 1, (S,), generator=g).tolist()
    ranks[0] = top
    if S > 2:
        ranks[2] = 0  # an empty slot: its tokens get no delta
    slots = torch.randint(-1, S, (T,), generator=g).tolist()
    slots[0] = 0
    mapping = LoRAMapping.build(slots, [], DEV)
    pairs = [stacked(g, S, R, n_in, n, ranks, wdt) for n in outs]
    As, Bs = tuple(a for a, _ in pairs), tuple(b for _, b in pairs)
    x = torch.randn(T, n_in, generator=g).to(DEV, xdt)
    y0 = torch.randn(T, sum(outs), generator=g).to(DEV, ydt)
    base = torch.tensor([s < 0 or ranks[s] == 0 for s in slots], device=DEV)
    return mapping, ranks, As, Bs, x, y0, base


def assert_delta_matches(y, y0, ref, base, xdt, wdt, ydt) -> None:
    """y = y0 + delta equals the reference ``ref`` (fp32): tokens of no adapter bit-identical, the delta
    within 1e-5 (all fp32) or 1e-2, a half-precision y rounded once."""
    assert torch.equal(y[base], y0[base]), "tokens without an adapter must be untouched"
    if ydt == torch.float32:
        tol = 1e-5 if wdt == torch.float32 and xdt == torch.float32 else 1e-2
        err = rel_err((y.float() - y0.float())[~base], (ref - y0.float())[~base])
        assert err < tol, f"rel err {err}"
    else:  # rounded once into the layer's dtype, as (y.float() + delta).to(dtype)
        err = rel_err(y.float(), ref.to(ydt).float())
        assert err < 1e-2, f"rel err {err}"
        assert (y.float() - ref).abs().max().item() <= 2 * (ref.abs().max().item() * 2**-7 + 1e-3)
    assert torch.isfinite(y).all()


def check_add_lora_linear(case, seed, top_rank=None) -> SegmentMeta:
    """add_lora_linear on random data (ranks with an empty slot, tokens of no adapter) equals the torch
    reference; returns the mapping's kernel view. ``top_rank``: the largest rank in the batch (R if None)."""
    mapping, ranks, As, Bs, x, y0, base = random_case(case, seed, top_rank)
    ref = reference(y0, x, As, Bs, mapping.token_segments, ranks)
    y = y0.clone()
    ops = TritonLoRAOps(DEV)
    meta = meta_of(mapping)
    ops.add_lora_linear(y, x, As, Bs, ranks, meta)
    sync()
    assert_delta_matches(y, y0, ref, base, *case[5:])
    return meta


@pytest.mark.parametrize(
    "case, top_rank",
    [
        ((9, 4, 48, 256, (128, 64), torch.float16, torch.float32, torch.float32), 33),  # decode sizes
        ((80, 4, 48, 256, (128, 64), torch.float16, torch.float16, torch.float16), 33),  # prefill sizes
        ((40, 3, 64, 512, (192,), torch.float32, torch.float32, torch.float32), 20),
    ],
    ids=["decode-R48-top33", "prefill-R48-top33", "prefill-R64-top20"],
)
def test_add_lora_linear_batch_ranks_below_R(case, top_rank):
    """Every rank in the batch below the stacks' R (48 or 64, multiples of the shrink's 16-column rank block):
    the output still equals the reference when the shrink's grid covers only the batch's largest rank and
    its stores drop the r < R mask (EVEN_R). (Columns past every rank are never read here; the zero-filled
    R = 48 case in test_decode_linear.py reads them all.)"""
    check_add_lora_linear(case, 0, top_rank=top_rank)


def test_wrapper_dispatches_to_triton_and_covers_logits():
    """PunicaWrapper on CUDA picks the kernels once; add_lora_linear and add_lora_logits match the reference."""
    g = torch.Generator().manual_seed(3)
    S, R, T, H, V = 6, 16, 50, 256, 1000
    ranks = [16, 8, 0, 4, 16, 12]
    skip_interpreted_bf16(torch.bfloat16)
    pw = PunicaWrapper(S, DEV)
    assert pw.backend == "triton"
    slots = torch.randint(-1, S, (T,), generator=g).tolist()
    logit_slots = [5, -1, 0, 3, 1, 1, -1, 4]
    a, b = stacked(g, S, R, H, V, ranks, torch.float32)
    h = torch.randn(len(logit_slots), H, generator=g).to(DEV, torch.bfloat16)
    y0 = torch.randn(len(logit_slots), V, generator=g).to(DEV)
    mapping = LoRAMapping.build(slots, logit_slots, DEV)
    y = y0.clone()
    with forward_context(lora=mapping):
        pw.add_lora_logits(y, h, a, b, ranks)
    ref = reference(y0, h, (a,), (b,), mapping.logit_segments, ranks)
    assert rel_err(y - y0, ref - y0) < 2e-3  # bf16 activations: tf32 products, fp32 accumulation

    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    out0 = torch.randn(T, V, generator=g).to(DEV, torch.bfloat16)
    with forward_context(lora=mapping):
        out = pw.apply_lora_linear(out0.clone(), x, (a,), (b,), (V,), ranks)
    ref = reference(out0, x, (a,), (b,), mapping.token_segments, ranks).to(torch.bfloat16)
    assert (out.float() - ref.float()).abs().max().item() <= ref.float().abs().max().item() * 2**-7


def test_rank_change_is_seen():
    """A slot rewritten with another rank (set_lora after an eviction) is picked up by the cached ranks."""
    g = torch.Generator().manual_seed(4)
    S, R, T, H, N = 4, 32, 20, 128, 256
    ranks = [32, 16, 8, 4]
    ops = TritonLoRAOps(DEV)
    slots = torch.randint(0, S, (T,), generator=g).tolist()
    mapping = LoRAMapping.build(slots, [], DEV)
    for _ in range(2):
        a, b = stacked(g, S, R, H, N, ranks, torch.float32)
        x = torch.randn(T, H, generator=g).to(DEV)
        y0 = torch.randn(T, N, generator=g).to(DEV)
        y = y0.clone()
        ops.add_lora_linear(y, x, (a,), (b,), ranks, meta_of(mapping))
        ref = reference(y0, x, (a,), (b,), mapping.token_segments, ranks)
        assert rel_err(y - y0, ref - y0) < 1e-5
        ranks[1], ranks[3] = 4, 32  # the same list object, changed in place, as layers do


def test_embedding_lora_matches_reference():
    g = torch.Generator().manual_seed(5)
    S, R, T, V, H = 5, 16, 40, 300, 128
    ranks = [16, 0, 4, 9, 16]
    slots = torch.randint(-1, S, (T,), generator=g).tolist()
    emb_a = (torch.randn(S, V, R, generator=g) * 0.1).to(DEV)
    b = (torch.randn(S, 1, H, R, generator=g) * 0.1).to(DEV)
    for s, r in enumerate(ranks):
        emb_a[s, :, r:] = 0  # A^T columns past the rank are zero, as set_lora leaves them
        b[s, :, :, r:] = 1e4
    ids = torch.randint(0, V, (T,), generator=g).to(DEV)
    y0 = torch.randn(T, H, generator=g).to(DEV)
    mapping = LoRAMapping.build(slots, [], DEV)
    y, ref = y0.clone(), y0.clone()
    TritonLoRAOps(DEV).add_lora_embedding(y, ids, emb_a, b, ranks, mapping.token_slots, meta_of(mapping))
    torch_ops.lora_embedding(ref, ids, emb_a, b, mapping.token_segments, ranks)
    assert rel_err(y - y0, ref - y0) < 1e-5


SHRINK_CASES = [
    # T, max_loras, R, K, slices, seg lengths come from round-robin slots; static: graph-style meta
    (32, 8, 16, 14336, 1, False),  # decode, down_proj-like: K split 28 ways, one K block a program
    (32, 8, 16, 4096, 3, True),  # decode, qkv-like, CUDA-graph meta (every slot a segment, some empty)
    (7, 3, 32, 1000, 2, False),  # K not a multiple of the K block, two rank blocks
    (200, 2, 16, 4096, 1, False),  # prefill sizes: 64-token blocks, planes summed in several loads
]


@pytest.mark.parametrize(
    "case", SHRINK_CASES, ids=lambda c: f"T{c[0]}-S{c[1]}-R{c[2]}-K{c[3]}-{c[4]}sl-static{c[5]}"
)
@pytest.mark.parametrize("zero_fill", [False, True])
def test_shrink_sums_its_splits_deterministically(case, zero_fill, monkeypatch):
    """The shrink hands over one plane: x @ A^T per token's slot (fp32, exact), bit-identical on a
    second launch (the arrival counters are back to zero); A's garbage past each rank is never read.
    With zero_fill every column past a token's rank holds 0 (its storage starts as NaN here)."""
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    monkeypatch.setattr(
        shrink_mod, "_new_buf", lambda shape, device: torch.full(shape, float("nan"), device=device)
    )
    T, S, R, K, n, static = case
    g = torch.Generator().manual_seed(7)
    ranks = [R - (s % 3) * (R // 4) for s in range(S)]
    slots = [t % S if t % 5 != 4 else -1 for t in range(T)]
    if static:
        slots = [s if s != 2 else -1 for s in slots]  # slot 2 absent: a segment of length 0
        meta = SegmentMeta(
            torch.tensor(SegmentMeta.static_host(slots, T, S), dtype=torch.int32, device=DEV),
            T,
            S,
            T,
            static=True,
        )
    else:
        meta = meta_of(LoRAMapping.build(slots, [], DEV))
    As = tuple(stacked(g, S, R, K, 8, ranks, torch.float32)[0] for _ in range(n))
    x = torch.randn(T, K, generator=g).to(DEV)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)

    first = lora_shrink(x, As, meta, rank_dev, max(ranks), zero_fill=zero_fill).clone()
    second = lora_shrink(x, As, meta, rank_dev, max(ranks), zero_fill=zero_fill)
    sync()
    assert first.shape == (1, n, T, R)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        r = ranks[s]
        for i, a in enumerate(As):
            ref = x[t].double() @ a[s, 0, :r].double().T
            got = first[0, i, t, :r].double()
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4), (
                f"token {t} slice {i}: {(got - ref).abs().max()}"
            )
            assert torch.equal(second[0, i, t, :r], first[0, i, t, :r]), (
                "a second launch must give the same bits"
            )
            if zero_fill:
                assert torch.equal(first[0, i, t, r:], torch.zeros_like(first[0, i, t, r:])), (
                    f"token {t}: not zeros past rank"
                )
    pool = triton_utils._PERSISTENT.get(("lora_shrink/arrivals", x.device, torch.int32), [])
    assert pool, "every case splits K, so the shrink counted arrivals"
    assert not any(c.any() for c in pool), "the arrival counters must be back to zero after a launch"


PREFILL_TILES = [  # (shrink, expand) tiles the prefill sweep (bench_lora_kernels.py --tune-prefill) can pick
    ((64, 64, 512, 4, 3, False), (64, 64, 4)),
    ((128, 128, 1024, 8, 4, False), (128, 256, 8)),
    ((64, 128, 512, 8, 3, True), (32, 128, 4)),
    ((128, 64, 256, 4, 3, True), (64, 128, 8)),
    ((64, 64, 256, 4, 4, True), (32, 128, 4)),  # the defaults (session 9's sweep)
    ((64, 128, 256, 4, 3, True), (32, 128, 4)),  # session 18's back-to-back sweep (one-slice layers take it)
]


@pytest.mark.parametrize("tiles", PREFILL_TILES, ids=lambda t: f"shrink{t[0]}-expand{t[1]}")
@pytest.mark.parametrize(
    "case",
    [
        CASES[5],
        (260, 3, 16, 896, (896, 128, 128), torch.float16, torch.float32, torch.float16),
        (200, 2, 16, 512, (384,), torch.float32, torch.float32, torch.float32),  # one slice: PREFILL_ONE_SLICE
    ],
    ids=lambda c: f"T{c[0]}-{c[5]}",
)
def test_prefill_tiles_match_reference(tiles, case, monkeypatch):
    """Segments longer than 32 tokens take the PREFILL tiles: every candidate gives the reference's delta (a
    one-slice layer takes PREFILL_ONE_SLICE whatever PREFILL is)."""
    from loraserve.lora.ops.triton import lora_expand as expand_mod
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    monkeypatch.setattr(shrink_mod, "PREFILL", shrink_mod.PrefillTiles(*tiles[0]))
    monkeypatch.setattr(expand_mod, "PREFILL", expand_mod.PrefillTiles(*tiles[1]))
    assert check_add_lora_linear(case, seed=3).max_seg_len > 32, "the case must take the prefill path"


class LaunchSpy:
    """Stands in for a Triton kernel: records each launch's keyword arguments, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("T", [16, 200, 600], ids=["decode-size", "prefill-size", "prefill-split-k"])
@pytest.mark.parametrize("n_slices", [1, 3])
def test_fp16_x_shrink_products_are_exact(T, n_slices, monkeypatch):
    """bf16 x with fp16 A (the GPU's auto storage): at prefill sizes the shrink casts x to fp16 and multiplies in
    fp16 (``lora_shrink.x_dot``), which holds every bf16 value in [2^-17, 65504] exactly, so its sums equal
    the fp64 product within fp32 summation error, as the tf32 path's (decode sizes) do; x's entries below 2^-14
    (fp16's subnormals, some rounded) included, and rows whose every entry is an fp16 subnormal held exactly
    (in [2^-17, 2^-14)), checked on their own: a tensor core flushing fp16 subnormals to zero would lose
    them. Decode sizes, prefill, and prefill with K split."""
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    g = torch.Generator().manual_seed(11)
    S, R, K = 4, 16, 4096 if T == 600 else 512
    slots = [(t // 100) % S if T > 32 else t % S for t in range(T)]
    meta = meta_of(LoRAMapping.build(slots, [], DEV))
    a = [torch.randn(S, 1, R, K, generator=g) * 0.05 for _ in range(n_slices)]
    x = torch.randn(T, K, generator=g)
    x[:, ::5] *= 3e-5  # fp16 subnormals (below 2^-14)
    x[:, 1::7] *= 300.0  # large, still inside fp16's range
    tiny = torch.arange(T) % 4 == 3  # rows of fp16 subnormals only, each exact in fp16: magnitudes in [2^-17, 2^-14)
    x[tiny] = torch.sign(torch.randn(int(tiny.sum()), K, generator=g)) * (2**-17 + torch.rand(int(tiny.sum()), K, generator=g) * (2**-14 - 2**-17))
    x = x.to(torch.bfloat16)
    As = tuple(t.to(DEV, torch.float16) for t in a)
    ranks = torch.full((S,), R, dtype=torch.int32, device=DEV)
    st = torch.tensor(slots)
    ref = torch.stack([torch.einsum("tk,trk->tr", x.double(), t.cpu().double()[st, 0]) for t in As], dim=0)
    spy = LaunchSpy(shrink_mod._lora_shrink_kernel)
    monkeypatch.setattr(shrink_mod, "_lora_shrink_kernel", spy)
    buf = lora_shrink(x.to(DEV), As, meta, ranks, R)
    sync()
    assert spy.launches[-1]["X16"] == (T > 32), "fp16 products at prefill sizes only"
    assert buf.shape[0] == 1, "the shrink sums its own splits (one plane)"
    out = buf[0].double().cpu()
    err = rel_err(out, ref)
    assert err < 2e-6, f"rel err {err}"
    err = rel_err(out[:, tiny], ref[:, tiny])
    assert err < 2e-6, f"rows of fp16 subnormals, rel err {err}"


@pytest.mark.parametrize("n_slices", [1, 3])
@pytest.mark.parametrize("K", [128, 4096], ids=["one-k-chunk", "k-split"])
def test_fp16_x_shrink_recomputes_blocks_past_fp16_range(n_slices, K, monkeypatch):
    """Prefill, bf16 x with fp16 A, fp16 products: rows with an x of 3e5 (inf in fp16) in one K column (with K
    split, in one split's range only); the blocks holding them are computed again in tf32, so every sum is finite
    and equals the fp64 product, the partial planes too. One and three slices, one K chunk a program and K split."""
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    g = torch.Generator().manual_seed(5)
    T, S, R = 200, 3, 16
    slots = [(t // 50) % S for t in range(T)]
    meta = meta_of(LoRAMapping.build(slots, [], DEV))
    As = tuple((torch.randn(S, 1, R, K, generator=g) * 0.05).to(DEV, torch.float16) for _ in range(n_slices))
    x = torch.randn(T, K, generator=g)
    x[::7, 5] = 3e5
    x = x.to(torch.bfloat16)
    spy = LaunchSpy(shrink_mod._lora_shrink_kernel)
    monkeypatch.setattr(shrink_mod, "_lora_shrink_kernel", spy)
    buf = lora_shrink(x.to(DEV), As, meta, torch.full((S,), R, dtype=torch.int32, device=DEV), R)
    sync()
    assert spy.launches[-1]["X16"], "the case must take the fp16 products"
    st = torch.tensor(slots)
    ref = torch.stack([torch.einsum("tk,trk->tr", x.double(), a.cpu().double()[st, 0]) for a in As], dim=0)
    assert x.float().abs().max() > 65504, "the case must hold an x fp16 cannot"
    assert torch.isfinite(buf).all(), "a block with an x past fp16's range kept its fp16 sums"
    got = buf.double().sum(dim=0).cpu()
    # fp32 sums of K = 4096 products on the tensor cores: 2.1e-6 measured on an H100 (sqrt(K) * 2^-24 is 3.8e-6);
    # the fp16 overflow this guards against leaves an inf or an error of order 1.
    assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("T", [16, 200], ids=["decode-size", "prefill-size"])
def test_fp16_weights_take_bf16_x_beyond_fp16_range(T):
    """bf16 activations, and s = A x, past fp16's range (65504) with fp16 LoRA weights (the GPU's auto
    storage), through add_lora_linear: the shrink's products exact (tf32 at decode sizes; fp16 at prefill,
    with the blocks holding an x past 65504 computed again in tf32: ``lora_shrink.x_dot``) and s fp32 into
    the expand, so the delta is finite and equals the fp64 product; fp16 products kept for those blocks,
    or s rounded to fp16 in the expand, would make it inf."""
    g = torch.Generator().manual_seed(7)
    S, R, K, outs = 3, 16, 256, (128, 64)
    slots = [t % S for t in range(T)]
    mapping = LoRAMapping.build(slots, [], DEV)
    a = torch.randn(S, 1, R, K, generator=g) * 0.02
    a[..., 5] = 1.0  # s = A x past fp16's range too: the expand must not round it to fp16
    As = tuple(a.to(DEV, torch.float16) for _ in outs)
    Bs = tuple((torch.randn(S, 1, n, R, generator=g) * 0.02).to(DEV, torch.float16) for n in outs)
    x = torch.randn(T, K, generator=g)
    x[::3, 5] = 3e5  # a bf16 value fp16 cannot hold
    x = x.to(DEV, torch.bfloat16)
    y = torch.zeros(T, sum(outs), device=DEV)
    TritonLoRAOps(DEV).add_lora_linear(y, x, As, Bs, [R] * S, meta_of(mapping))
    sync()
    st = torch.tensor(slots, device=DEV)
    ref = torch.cat([torch.einsum("tk,trk,tnr->tn", x.double(), a[st, 0].double(), b[st, 0].double())
                     for a, b in zip(As, Bs)], dim=1)  # fmt: skip
    assert (x.float() @ a[0, 0].t().to(DEV)).abs().max() > 65504, "the case must put s past fp16's range"
    assert torch.isfinite(y).all(), "x or s was cast to fp16"
    assert rel_err(y, ref) < 1e-3
