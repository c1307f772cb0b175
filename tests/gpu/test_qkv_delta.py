"""qkv_proj's LoRA delta left to the attention's rotary + KV-cache launch (``row_delta``), on random data.

- ``rotary_kv_cache(delta=...)`` gives what the plain launch gives on qkv + delta computed in float64 from the
  same operands (the shrink's planes summed in fp32 in order, rounded to the products' dtype) and rounded once
  (PEFT's order): bit for bit but for a rounding on a few elements (the delta's fp32 sum in another order);
  base tokens' rows, whose shrink rows hold NaN, are the plain launch's bit for bit; rotary dims short of the
  head (a rest passed through) take their delta too; ``PendingQKVDelta.add_to`` (the torch path) agrees;
- ``TritonLoRAOps.qkv_deferring_delta`` returns the plain GEMM's output and a delta that, added, gives the
  epilogue path's output; None where the norm did not compute the shrink (the decoder's wiring: test_norm_shrink's
  tiny LoRA'd Llama);
- without the fused rotary launch (the torch attention) LlamaAttention adds the delta itself, and the logits equal
  those of qkv's GEMM adding its own delta.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (fp16 there: the interpreter has no bf16).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_decode_linear import lora_stacks, rel_err
from tests.gpu.test_norm_shrink import HALF, _lora_model, _run_lora_steps, mapping_of
from tests.gpu.test_row_delta import random_ranks_and_slots
from tests.gpu.triton_device import triton_device

DEV = triton_device()

from loraserve.layers import triton_elementwise as tew  # noqa: E402
from loraserve.lora.ops.precision import compute_dtype  # noqa: E402
from loraserve.lora.ops.triton import norm_shrink as ns  # noqa: E402
from loraserve.lora.ops.triton import row_delta  # noqa: E402
from loraserve.lora.ops.triton_ops import TritonLoRAOps  # noqa: E402
from loraserve.lora.punica import PendingQKVDelta  # noqa: E402

CASES = [
    # T, Hq, Hk, head_dim, rotary dims, S, R, planes
    (32, 14, 2, 64, 64, 8, 16, 1),  # Qwen2.5-0.5B's heads
    (5, 4, 2, 32, 32, 3, 8, 1),  # head_dim 32, a rank under the 16-wide tile
    (3, 2, 1, 80, 64, 2, 16, 2),  # a rest of 16 dims past the rotary ones; the shrink's split planes
]


def _case(T, Hq, Hk, D, rd, S, R, P, xdt, bdt, seed):
    g = torch.Generator().manual_seed(seed)
    ranks, slots = random_ranks_and_slots(g, T, S, R)
    nq, nk = Hq * D, Hk * D
    qkv = torch.randn(T, nq + 2 * nk, generator=g).to(DEV, xdt)
    _, bs = lora_stacks(g, S, R, 16, (nq, nk, nk), ranks, bdt)
    bs = tuple(b * 20 for b in bs)  # deltas of order 1: every output moves
    buf = torch.randn(P, 3, T, R, generator=g)
    for t, s in enumerate(slots):
        if s < 0:
            buf[:, :, t] = float("nan")  # never read
    mapping, _ = mapping_of(slots)
    delta = PendingQKVDelta(buf.to(DEV), bs, mapping.token_slots)
    pos = torch.arange(T, device=DEV) * 7
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2, device=DEV).float() / rd))
    f = pos.float()[:, None] * inv[None, :]
    cos, sin = torch.cat([f, f], 1).cos().to(xdt), torch.cat([f, f], 1).sin().to(xdt)
    return qkv, delta, slots, ranks, cos, sin


def _reference_qkv(qkv: torch.Tensor, delta: PendingQKVDelta) -> torch.Tensor:
    """qkv + the delta in float64 from the kernel's operands, rounded once to qkv's dtype."""
    buf = delta.buf.cpu()
    s = buf[0].clone()
    for p in range(1, buf.shape[0]):
        s = s + buf[p]  # fp32, in plane order
    slots = delta.token_slots.long().cpu()
    parts = []
    for i, b in enumerate(delta.lora_b):
        cdt = compute_dtype(qkv.dtype, b.dtype)
        si = torch.where((slots >= 0)[:, None], s[i], 0.0).to(cdt).double()
        bi = b.cpu()[slots.clamp(min=0), 0].double()  # (T, N_i, R)
        parts.append(torch.einsum("tnr,tr->tn", bi, si))
    return (qkv.cpu().double() + torch.cat(parts, 1)).to(qkv.dtype).to(qkv.device)


def _rotary_cache(qkv, Hq, Hk, D, cos, sin, delta=None):
    """(rotated q, the k and v cache rows) of rotary_kv_cache on views of qkv (T slots of cache)."""
    T = qkv.shape[0]
    nq, nk = Hq * D, Hk * D
    q = qkv[:, :nq].view(T, Hq, D)
    k = qkv[:, nq : nq + nk].view(T, Hk, D)
    v = qkv[:, nq + nk :].view(T, Hk, D)
    kc = torch.full((T + 3, Hk, D), float("nan"), dtype=qkv.dtype, device=qkv.device)
    vc = torch.full_like(kc, float("nan"))
    slot_mapping = torch.arange(T, device=qkv.device) + 2
    out = tew.rotary_kv_cache(q, k, v, cos, sin, kc, vc, slot_mapping, delta=delta)
    return out, kc[2 : T + 2], vc[2 : T + 2]


def _mostly_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit-equal but for a rounding on at most 1% of the elements (the fp32 sums' order)."""
    diff = (a != b).float().mean().item()
    assert diff <= 0.01, f"{what}: {diff:.2%} of the elements differ"
    assert rel_err(a, b) < 1e-2, what


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}x{c[2]}-D{c[3]}-rd{c[4]}-S{c[5]}-R{c[6]}-P{c[7]}")
@pytest.mark.parametrize("xdt", HALF, ids=str)
def test_rotary_kv_cache_adds_the_qkv_delta(case, xdt):
    T, Hq, Hk, D, rd, S, R, P = case
    bdt = torch.float16
    qkv, delta, slots, ranks, cos, sin = _case(*case, xdt, bdt, seed=T + D)
    want = _rotary_cache(_reference_qkv(qkv, delta), Hq, Hk, D, cos, sin)
    got = _rotary_cache(qkv, Hq, Hk, D, cos, sin, delta=delta)
    plain = _rotary_cache(qkv, Hq, Hk, D, cos, sin)
    lora_rows = [t for t, s in enumerate(slots) if s >= 0 and ranks[s] > 0]
    base_rows = [t for t, s in enumerate(slots) if s < 0 or ranks[s] == 0]
    for name, g_, w_, p_ in zip(("q", "k cache", "v cache"), got, want, plain):
        _mostly_equal(g_, w_, name)
        assert torch.equal(g_[base_rows], p_[base_rows]), f"{name}: base tokens get the plain launch's bits"
        assert not torch.equal(g_[lora_rows], p_[lora_rows]), f"{name}: the delta was added"
        assert not g_.isnan().any(), name
    # the torch path of a reader without the kernel
    _mostly_equal(delta.add_to(qkv), _reference_qkv(qkv, delta), "add_to")


def _ops_case(T, K, Hq, Hk, D, S, R, seed):
    g = torch.Generator().manual_seed(seed)
    ranks = [R, 0] + [max(1, R // (i + 1)) for i in range(S - 2)]
    slots = [-1 if t % 4 == 3 else t % S for t in range(T)]
    x = torch.randn(T, K, generator=g).to(DEV, torch.float16)
    outs = (Hq * D, Hk * D, Hk * D)
    As, Bs = lora_stacks(g, S, R, K, outs, ranks, torch.float16)
    w = (torch.randn(sum(outs), K, generator=g) * 0.05).to(DEV, torch.float16)
    bias = (torch.randn(sum(outs), generator=g) * 0.1).to(DEV, torch.float16)
    norm_w = (1 + 0.3 * torch.randn(K, generator=g)).to(DEV, torch.float16)
    return x, As, Bs, w, bias, norm_w, ranks, slots


def test_qkv_deferring_delta_is_the_base_gemm_and_its_delta(monkeypatch):
    T, K, Hq, Hk, D, S, R = 12, 256, 4, 2, 64, 4, 16
    x, As, Bs, w, bias, norm_w, ranks, slots = _ops_case(T, K, Hq, Hk, D, S, R, seed=5)
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    normed, _, buf = ops.norm_shrink(x, None, norm_w, 1e-6, As, Bs, ranks, w, meta, mapping.token_slots)
    args = (normed, w, bias, As, Bs, ranks, meta, mapping.token_slots)
    assert ops.qkv_deferring_delta(*args, None) is None, "only where the norm computed x's shrink"
    assert ops.qkv_deferring_delta(normed, w, bias, As, Bs, [0] * S, meta, mapping.token_slots, buf) is None, "no rank"
    monkeypatch.setattr(row_delta, "QKV_MAX_HIDDEN", K - 1)
    assert ops.qkv_deferring_delta(*args, buf) is None, "a larger model's qkv keeps its epilogue"
    monkeypatch.setattr(row_delta, "QKV_MAX_HIDDEN", K)
    y, delta = ops.qkv_deferring_delta(*args, buf)
    from loraserve.layers.triton_decode_linear import decode_linear

    assert torch.equal(y, decode_linear(normed, w, bias)), "the plain GEMM's output"
    assert delta.buf is buf and len(delta.lora_b) == 3
    want = ops.linear_with_lora(*args, shrunk=buf)  # the GEMM with the delta in its epilogue
    _mostly_equal(delta.add_to(y), want, "qkv + delta")


def test_rotary_reads_the_norms_shrink_only_once_written():
    """The norm's shrink, qkv's GEMM (``trigger_after_wait``), then the rotary launch computing the delta before its PDL
    wait: on the GPU the rotary launch reads the norm's buf before its wait, safe only because the GEMM lets it launch
    after the norm finished. The norm's buf is allocated where NaN was just freed, so a read before the norm wrote it
    would show; repeated, every run gives the bits of the first (on the CPU the launches are sequential)."""
    T, K, Hq, Hk, D, S, R = 32, 896, 14, 2, 64, 8, 16  # Qwen2.5-0.5B's attention
    x, As, Bs, w, bias, norm_w, ranks, slots = _ops_case(T, K, Hq, Hk, D, S, R, seed=9)
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    g = torch.Generator().manual_seed(10)
    rd = D
    f = (torch.arange(T).float() * 3)[:, None] / (10000 ** (torch.arange(0, rd, 2).float() / rd))[None, :]
    cos, sin = torch.cat([f, f], 1).cos().to(DEV, torch.float16), torch.cat([f, f], 1).sin().to(DEV, torch.float16)
    res = torch.randn(T, K, generator=g).to(DEV, torch.float16)

    def chain():
        junk = [torch.full((1, 3, T, R), float("nan"), device=DEV) for _ in range(32)]  # freed, then reused
        del junk
        normed, _, buf = ops.norm_shrink(x, res, norm_w, 1e-6, As, Bs, ranks, w, meta, mapping.token_slots)
        y, delta = ops.qkv_deferring_delta(normed, w, bias, As, Bs, ranks, meta, mapping.token_slots, buf)
        return _rotary_cache(y, Hq, Hk, D, cos, sin, delta=delta)

    first = chain()
    for _ in range(3):
        for a, b in zip(chain(), first):
            assert torch.equal(a, b), "the same bits every run"
    assert not any(t.isnan().any() for t in first)


def test_llama_adds_qkv_delta_where_the_rotary_launch_does_not_run(monkeypatch):
    """Without the fused rotary launch (the torch attention path: rotary and cache write in torch) a delta qkv_proj
    left is added by LlamaAttention itself (``PendingQKVDelta.add_to``): the logits equal those of every GEMM adding
    its own delta (``_run_lora_steps(epilogues=True)``; the shrink of the rounded norm output, ``FOLD_MAX_BLOCK`` 0,
    and gate/up's delta outside its GEMM's K, as test_norm_shrink's decoder test)."""
    from loraserve.layers import attention
    from loraserve.lora.ops import delta_in_k

    monkeypatch.setattr(delta_in_k, "MAX_SLOT_COLUMNS", 0)
    monkeypatch.setattr(ns, "FOLD_MAX_BLOCK", 0)
    model, mapping, fdp = _lora_model(seed=4)
    fdp.take_gpu_path(monkeypatch)
    monkeypatch.setattr(attention, "_select_kernel", lambda device: None)
    want = _run_lora_steps(model, mapping, fdp, epilogues=True)
    added = []
    real = PendingQKVDelta.add_to
    monkeypatch.setattr(PendingQKVDelta, "add_to", lambda self, y: added.append(1) or real(self, y))
    got = _run_lora_steps(model, mapping, fdp)
    assert len(added) == 2 * len(fdp.STEPS), f"each layer's qkv delta added by the model: {len(added)}"
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m, i=i: f"step {i}: {m}")
