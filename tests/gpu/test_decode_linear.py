"""decode_linear (a decode-size GEMM with the LoRA expand in its epilogue) against torch on random data.

The reference is F.linear rounded to the layer's dtype, plus the torch_ops LoRA delta in fp32, rounded
once more: the unfused path's numbers. Random A and B (never zeros), garbage past each slot's rank,
tokens of no adapter that must get exactly the base output, slots absent from the batch.
Runs on CUDA, or on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.triton_device import skip_interpreted_bf16, triton_device

DEV = triton_device()

from loraserve.layers.triton_decode_linear import (  # noqa: E402
    DecodeTiles,
    ExpandEpilogue,
    decode_linear,
    default_tiles,
    supports,
)
from loraserve.lora.ops import torch_ops  # noqa: E402
from loraserve.lora.ops.precision import compute_dtype  # noqa: E402
from loraserve.lora.ops.triton.lora_shrink import lora_shrink  # noqa: E402
from loraserve.lora.ops.triton_ops import TritonLoRAOps  # noqa: E402
from loraserve.lora.punica import LoRAMapping, SegmentMeta  # noqa: E402


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)).item()


def lora_stacks(g, S, R, K, outs, ranks, dtype):
    """Per slice A (S, 1, R, K) and B (S, 1, N_i, R): random within each slot's rank, garbage past it in
    A (the shrink must not read it) and zeros past it in B (the layers keep B's unused columns zero)."""
    As, Bs = [], []
    for n in outs:
        a = torch.randn(S, 1, R, K, generator=g) * 0.05
        b = torch.randn(S, 1, n, R, generator=g) * 0.05
        for s, r in enumerate(ranks):
            a[s, :, r:] = 1e4
            b[s, :, :, r:] = 0.0
        As.append(a.to(DEV, dtype))
        Bs.append(b.to(DEV, dtype))
    return tuple(As), tuple(Bs)


def mapping_of(slots: list[int]) -> tuple[LoRAMapping, SegmentMeta]:
    """The batch's mapping for these token slots (-1 = base), and the shrink's segment meta of it."""
    mapping = LoRAMapping.build(slots, slots, DEV)
    meta = mapping.token_meta or SegmentMeta.build(
        mapping.token_order.cpu(), mapping.active_slots, mapping.seg_starts, mapping.seg_lens, DEV
    )
    return mapping, meta


CASES = [
    # M, K, slice outs, S, R, x dtype, LoRA dtype, tiles
    (32, 512, (512, 128, 128), 8, 16, torch.bfloat16, torch.float32, DecodeTiles(64, 128, 4, 3)),
    (5, 256, (256,), 3, 8, torch.bfloat16, torch.bfloat16, DecodeTiles(32, 64, 4, 2)),
    (17, 384, (256, 256), 4, 32, torch.float16, torch.float32, DecodeTiles(32, 128, 4, 2)),
    (32, 320, (192,), 5, 16, torch.float32, torch.float32, DecodeTiles(64, 128, 4, 2)),  # K not a multiple
    (1, 128, (64, 64, 64), 2, 16, torch.bfloat16, torch.float32, DecodeTiles(32, 64, 4, 2)),
    # the same shapes in fp16, which the Triton interpreter can check on the CPU
    (32, 512, (512, 128, 128), 8, 16, torch.float16, torch.float32, DecodeTiles(64, 128, 4, 3)),
    (5, 256, (256,), 3, 8, torch.float16, torch.float16, DecodeTiles(32, 64, 4, 2)),
    (32, 256, (128, 128, 64), 6, 16, torch.float16, torch.float32, DecodeTiles(64, 64, 4, 2)),
    # several chunks of slots in the epilogue (8 slots of rank 16, or 2 of rank 64, per MMA)
    (24, 256, (256, 128), 12, 16, torch.float16, torch.float32, DecodeTiles(64, 128, 4, 2)),
    (9, 128, (128,), 5, 64, torch.float16, torch.float16, DecodeTiles(32, 64, 4, 2)),
    (1, 128, (64, 64, 64), 2, 16, torch.float16, torch.float32, DecodeTiles(32, 64, 4, 2)),
    (9, 256, (128, 64), 12, 16, torch.float16, torch.float32, DecodeTiles(64, 128, 4, 2)),  # 2 chunks of slots
    # split-K: serial reduction over 2-4 programs per column block (uneven and empty splits too)
    (32, 512, (512, 128, 128), 8, 16, torch.float16, torch.float32, DecodeTiles(64, 128, 4, 2, split_k=2)),
    (7, 320, (192,), 5, 16, torch.float16, torch.float32, DecodeTiles(64, 128, 4, 2, split_k=3)),
    (16, 256, (128, 128), 3, 16, torch.float16, torch.float16, DecodeTiles(32, 128, 4, 2, split_k=4)),
    (32, 512, (256, 256), 8, 16, torch.bfloat16, torch.float32, DecodeTiles(64, 128, 4, 3, split_k=4)),
    # R a multiple of 16, not a power of two (the epilogue's BLOCK_R 64 > R); and K past 16 shrink blocks of
    # 256, so that with the planes left to the epilogue its sum loops twice, the second time in part
    (9, 512, (128,), 5, 48, torch.float16, torch.float32, DecodeTiles(32, 128, 4, 2)),
    (9, 5120, (64,), 3, 16, torch.float16, torch.float32, DecodeTiles(32, 128, 4, 2)),
    # fp16 LoRA weights with bf16 x (the GPU's auto storage): tf32 products (precision.py)
    (32, 512, (512, 128, 128), 8, 16, torch.bfloat16, torch.float16, DecodeTiles(64, 128, 4, 3)),
    (9, 512, (256, 256), 5, 16, torch.bfloat16, torch.float16, DecodeTiles(64, 128, 4, 3, split_k=4)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-K{c[1]}-{len(c[2])}sl-S{c[3]}-R{c[4]}-{c[5]}-{c[6]}")
@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_with_lora_matches_reference(case, bias, monkeypatch):
    """The shrink sums its split-K planes into one. The shrink's storage starts as NaN: what it does not write
    (rows of base tokens) must not matter."""
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    monkeypatch.setattr(shrink_mod, "_new_buf", lambda shape, device: torch.full(shape, float("nan"), device=device))
    M, K, outs, S, R, xdt, wdt, tiles = case
    skip_interpreted_bf16(xdt, wdt)
    g = torch.Generator().manual_seed(M * 7 + K)
    N = sum(outs)
    ranks = torch.randint(1, R + 1, (S,), generator=g).tolist()
    ranks[0] = R
    if S > 3:
        ranks[1] = 0  # an empty slot in the batch: its tokens get no delta
    x = torch.randn(M, K, generator=g).to(DEV, xdt)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, xdt)
    b = (torch.randn(N, generator=g) * 0.1).to(DEV, xdt) if bias else None
    As, Bs = lora_stacks(g, S, R, K, outs, ranks, wdt)
    # every other token on the base model, and slot S - 1 absent from the batch
    slots = [-1 if t % 3 == 2 else t % max(S - 1, 1) for t in range(M)]
    mapping, meta = mapping_of(slots)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    assert supports(x, w, outs, tiles) == (xdt != torch.float32)

    buf = lora_shrink(x, As, meta, rank_dev, R, zero_fill=True)
    assert buf.shape[0] == 1, "the shrink sums its splits"
    # every column of a token with a slot is written, zeros past its slot's rank (the epilogue loads no
    # rank); rows of base tokens are not (NaN): the epilogue must drop them
    for t, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(buf[:, :, t, ranks[s] :], torch.zeros_like(buf[:, :, t, ranks[s] :]))
        else:
            assert buf[:, :, t].isnan().all()
    y = decode_linear(x, w, b, lora=ExpandEpilogue(buf, Bs, mapping.token_slots), tiles=tiles)

    base = F.linear(x.float(), w.float(), None if b is None else b.float()).to(xdt)  # rounded, as cuBLAS's
    ref = base.float()
    off = 0
    for a, bb in zip(As, Bs):
        h = torch.zeros(M, R, dtype=compute_dtype(xdt, wdt), device=DEV)
        torch_ops.lora_shrink(x, a, mapping.token_segments, ranks, h)
        torch_ops.lora_expand(ref, h, bb, mapping.token_segments, ranks, off, act_dtype=xdt)
        off += bb.shape[2]
    ref = ref.to(xdt)
    base_rows = [t for t, s in enumerate(slots) if s < 0]
    tol = 1e-5 if xdt == torch.float32 else 1e-2
    assert rel_err(y, ref) < tol
    # base tokens: exactly what the base GEMM alone gives (no delta touched them)
    y0 = decode_linear(x, w, b, tiles=tiles)
    assert torch.equal(y[base_rows], y0[base_rows])
    # the LoRA tokens moved (the test would pass vacuously with a zero delta)
    lora_rows = [t for t, s in enumerate(slots) if s >= 0]
    assert not torch.equal(y[lora_rows], y0[lora_rows])


@pytest.mark.parametrize("K", [256, 1024], ids=["one-split", "gemm-split-k-4"])
@pytest.mark.parametrize("n_lora_tokens", [0, 5])
@pytest.mark.parametrize("R", [16, 64], ids=["one-mma", "mma-per-2-slots"])
def test_linear_with_lora_matches_the_unfused_path(n_lora_tokens, K, R):
    """TritonLoRAOps.linear_with_lora (shrink, then the GEMM with the delta in its epilogue) equals the
    unfused path (GEMM, then add_lora_linear); a batch of base tokens only gets the base GEMM's bits.
    The epilogue's MMA over every slot at once (4 slots of rank 16: 64 columns), or over 2 slots at a time
    (rank 64: MMA_COLUMNS 128 holds two)."""
    from loraserve.lora.ops.triton import expand_block

    g = torch.Generator().manual_seed(n_lora_tokens + K + R)
    M, outs, S = 12, (128, 64, 64), 4
    assert expand_block.slots_per_chunk(S, R) == (4 if R == 16 else 2)
    assert default_tiles(M, sum(outs), K, torch.float16).split_k == (4 if K == 1024 else 1)
    ranks = [R, R // 2, R, 4]
    x = torch.randn(M, K, generator=g).to(DEV, torch.float16)
    w = (torch.randn(sum(outs), K, generator=g) * 0.05).to(DEV, torch.float16)
    As, Bs = lora_stacks(g, S, R, K, outs, ranks, torch.float32)
    slots = [t % S if t < n_lora_tokens else -1 for t in range(M)]
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    y = ops.linear_with_lora(x, w, None, As, Bs, ranks, meta, mapping.token_slots)
    assert y is not None, "decode sizes take the fused path"
    ref = decode_linear(x, w)
    ops.add_lora_linear(ref, x, As, Bs, ranks, meta)
    assert rel_err(y, ref) < 1e-2
    if n_lora_tokens == 0:
        assert torch.equal(y, decode_linear(x, w))


@pytest.mark.parametrize("K", [256, 1024], ids=["one-split", "gemm-split-k-4"])
@pytest.mark.parametrize("wdt", [torch.float32, torch.float16], ids=["fp32-lora", "fp16-lora"])
def test_linear_with_lora_of_either_lora_dtype_keeps_the_numbers(K, wdt):
    """Half-precision LoRA weights take the decode shrink computing every slice in one program and the GEMM
    pulling its epilogue's B into L2 some K steps before its loop ends (on the GPU only: the interpreter runs no
    inline PTX); fp32 ones neither. Either way the fused path gives what the unfused path gives."""
    from loraserve.layers import triton_decode_linear as dl
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    assert shrink_mod._fuse_decode(wdt) == (wdt != torch.float32)
    assert (dl.prefetch_ahead(wdt) > 0) == (wdt != torch.float32)
    g = torch.Generator().manual_seed(K)
    M, outs, S, R = 12, (128, 64, 64), 4, 16
    ranks = [16, 0, 16, 4]
    x = torch.randn(M, K, generator=g).to(DEV, torch.float16)
    w = (torch.randn(sum(outs), K, generator=g) * 0.05).to(DEV, torch.float16)
    As, Bs = lora_stacks(g, S, R, K, outs, ranks, wdt)
    slots = [t % S if t < 9 else -1 for t in range(M)]
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    y = ops.linear_with_lora(x, w, None, As, Bs, ranks, meta, mapping.token_slots)
    ref = decode_linear(x, w)
    ops.add_lora_linear(ref, x, As, Bs, ranks, meta)
    assert rel_err(y, ref) < 1e-2
    base_rows = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    assert torch.equal(y[base_rows], decode_linear(x, w)[base_rows])
    assert not torch.equal(y, decode_linear(x, w))


def test_decode_choices_follow_the_lora_dtype():
    """Half-precision LoRA weights: the epilogue's B pulled into L2 PREFETCH_B_AHEAD steps before the loop's end and
    the decode shrink computing every slice in one program; fp32 ones neither."""
    from loraserve.layers import triton_decode_linear as dl
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    assert dl.prefetch_ahead(torch.bfloat16) == dl.prefetch_ahead(torch.float16) == dl.PREFETCH_B_AHEAD == 4
    assert dl.prefetch_ahead(torch.float32) == 0
    assert shrink_mod._fuse_decode(torch.bfloat16) and not shrink_mod._fuse_decode(torch.float32)


@pytest.mark.parametrize("M", [1, 16, 17, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_linear_base_matches_torch(M, dtype):
    skip_interpreted_bf16(dtype)
    g = torch.Generator().manual_seed(M)
    K, N = 512, 320
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, dtype)
    b = torch.randn(N, generator=g).to(DEV, dtype)
    y = decode_linear(x, w, b, tiles=DecodeTiles(64, 128, 4, 2))  # N not a multiple of block_n
    ref = F.linear(x.float(), w.float(), b.float())
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_err(y, ref) < 1e-2


@pytest.mark.parametrize("split", [2, 3])
def test_split_k_is_deterministic_and_leaves_its_counters_at_zero(split):
    from loraserve.lora.ops.triton import utils as triton_utils

    g = torch.Generator().manual_seed(split)
    x = torch.randn(12, 384, generator=g).to(DEV, torch.float16)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(DEV, torch.float16)
    tiles = DecodeTiles(64, 64, 4, 2, split_k=split)
    ys = [decode_linear(x, w, tiles=tiles) for _ in range(3)]
    assert all(torch.equal(ys[0], y) for y in ys[1:])
    assert rel_err(ys[0], F.linear(x.float(), w.float())) < 1e-2
    pool = triton_utils._PERSISTENT[("decode_linear/arrivals", x.device, torch.int32)]
    assert pool and all(int(counters.abs().sum()) == 0 for counters in pool)


def test_supports_refuses_what_it_cannot_do():
    x = torch.randn(8, 256, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(192, 256, device=DEV, dtype=torch.bfloat16)
    assert supports(x, w, (128, 64), DecodeTiles(block_n=64))
    assert not supports(x, w, (160, 32), DecodeTiles(block_n=64))  # a slice that is not a block multiple
    assert not supports(torch.randn(33, 256, device=DEV, dtype=torch.bfloat16), w)  # too many tokens
    assert not supports(x.float(), w.float())  # fp32 takes cuBLAS
    assert not supports(x, w.t().contiguous().t())  # W not contiguous along K


def test_w_prefetch_lines_cover_the_k_range_within_its_bounds(monkeypatch):
    """W's prefetch lines: none under the interpreter, none past the size cap, at most 32 a row."""
    from loraserve.layers import triton_decode_linear as dl

    w = torch.empty(1152, 896, dtype=torch.bfloat16)
    monkeypatch.setattr(dl, "interpreted", lambda: False)
    assert dl.w_prefetch_lines(w, 0, 896) == 16, "896 bf16 = 14 lines of 128 bytes, rounded up to 16"
    assert dl.w_prefetch_lines(w, 0, 4096) == 32, "at most 32"
    big = torch.empty(6144, 4096, dtype=torch.bfloat16)  # Llama-8B's qkv: 50 MB
    assert dl.w_prefetch_lines(big, 0, 4096) == 0, "past W_PREFETCH_MAX_BYTES"
    monkeypatch.setattr(dl, "interpreted", lambda: True)
    assert dl.w_prefetch_lines(w, 0, 896) == 0, "inline PTX: not under the interpreter"


def test_one_wave_tiles_fit_the_sms_and_give_the_same_product():
    """A product of more 64-row blocks than SMs (Qwen2.5-0.5B's gate/up, 2 x 4864 rows) runs 128-row blocks, at most
    one program an SM, with the product of the 64-row tiles (which slices that are not multiples of 128 rows keep);
    narrower products keep theirs."""
    from loraserve.layers import triton_decode_linear as dl

    N, K = 2 * 4864, 256
    one = dl.default_tiles(32, N, K, torch.float16)
    default = dl.default_tiles(32, N, K, torch.float16, (4800, 4928))  # a slice of 37.5 128-row blocks
    assert default.block_n == 64 and -(-N // default.block_n) * default.split_k > dl.sm_count(), "two waves"
    assert one.block_n == 128 and -(-N // one.block_n) * one.split_k <= dl.sm_count(), one
    assert dl.default_tiles(32, 1152, K, torch.float16).block_n == 64, "a product that fits one wave keeps its tiles"
    assert dl.default_tiles(32, N, K, torch.float16, (4864, 4864)) == one, "slices of 38 128-row blocks each"
    assert dl.default_tiles(32, 9600, K, torch.float16, (4800, 4800)).block_n == 64, "a slice of 37.5 keeps 64 rows"
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, K, generator=g).to(DEV, torch.float16)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, torch.float16)
    want = F.linear(x.float(), w.float())
    assert rel_err(decode_linear(x, w, tiles=one), want) < 2e-3
    assert rel_err(decode_linear(x, w, tiles=one), decode_linear(x, w, tiles=default)) < 2e-3


@pytest.mark.skipif(DEV.type != "cuda", reason="the prefetch is inline PTX: off under the interpreter")
@pytest.mark.parametrize("N, K", [(1152, 896), (2 * 4864, 896), (896, 4864)], ids=["qkv", "gate_up", "down"])
def test_w_prefetch_before_the_wait_gives_the_same_product(N, K, monkeypatch):
    """A link of the PDL chain pulls its rows of W into L2 before its wait (Qwen2.5-0.5B's shapes: split-K, one wave,
    and the trigger after the wait); its product is, bit for bit, that of a launch whose W passes the size cap
    (``W_PREFETCH_MAX_BYTES``, set to 0 here: no prefetch)."""
    from loraserve.layers import triton_decode_linear as dl
    from loraserve.lora.ops.triton.utils import pdl_chain

    if not pdl_chain(DEV):
        pytest.skip("no PDL chain on this GPU: the prefetch is not taken")
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(32, K, generator=g).to(DEV, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) * 0.05).to(DEV, torch.bfloat16)
    assert dl.w_prefetch_lines(w, 0, K) > 0, "the prefetch is taken at these shapes"
    got = {True: (decode_linear(x, w), decode_linear(x, w, trigger_after_wait=True))}
    monkeypatch.setattr(dl, "W_PREFETCH_MAX_BYTES", 0)
    assert dl.w_prefetch_lines(w, 0, K) == 0
    got[False] = (decode_linear(x, w), decode_linear(x, w, trigger_after_wait=True))
    for plain, pulled in zip(got[False], got[True]):
        assert torch.equal(plain, pulled), "the prefetch changed the product"
    assert rel_err(got[True][0], F.linear(x.float(), w.float())) < 1e-2
