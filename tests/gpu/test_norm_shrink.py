"""norm_shrink (RMSNorm, with or without the residual add, and the LoRA shrink of its output in one launch)
against the kernels it replaces, on random data.

- the norm's outputs are bit-equal to ``fused_add_rms_norm`` / ``rms_norm``'s (the same jit helper);
- buf equals out @ A_i[slot]^T per token with a slot, in float64 from the rounded norm output (the
  products of half operands are exact in fp32; only the fp32 sum's order differs): 1e-5 relative, for rows past
  ``FOLD_MAX_BLOCK``; up to it, the same of the unrounded norm (the fold); columns past a slot's rank are
  exactly zero though A holds garbage there;
- through ``TritonLoRAOps.linear_with_lora(..., shrunk=buf)`` (the GEMM with the delta in its epilogue,
  and the gated SiLU-and-mul path) the outputs equal those of the path with its own shrink launch;
- a tiny LoRA'd Llama through the Triton LoRA path: its norms hand qkv and gate/up their shrink, no shrink
  launch is left, o's and down's deltas go to the norms after them and qkv's to the rotary launch, and the logits
  equal those of the GEMMs adding their own deltas.

Runs on CUDA, or on the CPU under TRITON_INTERPRET=1 (fp16 there: the interpreter has no bf16).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_decode_linear import lora_stacks, mapping_of, rel_err
from tests.gpu.triton_device import triton_device

DEV = triton_device()

from loraserve.layers import triton_elementwise as tew  # noqa: E402
from loraserve.lora.ops.triton import norm_shrink as ns  # noqa: E402
from loraserve.lora.ops.triton_ops import TritonLoRAOps  # noqa: E402
from loraserve.lora.punica import LoRAMapping, SegmentMeta  # noqa: E402

HALF = [torch.float16] + ([torch.bfloat16] if DEV.type == "cuda" else [])

CASES = [
    # T, K, slices, S, R
    (32, 896, 3, 8, 16),  # Qwen2.5-0.5B's hidden size: K masked to a block of 1024
    (5, 256, 2, 3, 32),  # two rank blocks
    (1, 128, 1, 2, 16),
    (9, 512, 3, 5, 48),  # three rank blocks, R not a power of two
    (3, 2304, 2, 3, 16),  # a row block of 4096 (16 warps on the GPU)
]


def random_case(T, K, n, S, R, xdt, adt, seed):
    g = torch.Generator().manual_seed(seed)
    ranks = torch.randint(1, R + 1, (S,), generator=g).tolist()
    ranks[0] = R
    if S > 2:
        ranks[1] = 0  # a slot with no rank: its tokens' rows are zeros
    x = torch.randn(T, K, generator=g).to(DEV, xdt)
    res = torch.randn(T, K, generator=g).to(DEV, xdt)
    w = (1 + 0.3 * torch.randn(K, generator=g)).to(DEV, xdt)
    As, Bs = lora_stacks(g, S, R, K, (64,) * n, ranks, adt)  # A holds 1e4 past each slot's rank
    slots = [-1 if t % 4 == 3 else t % S for t in range(T)]
    return x, res, w, As, Bs, ranks, slots


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-{c[2]}sl-S{c[3]}-R{c[4]}")
@pytest.mark.parametrize("residual", [True, False], ids=["add-norm", "norm"])
@pytest.mark.parametrize("dtypes", [(x, a) for x in HALF for a in HALF], ids=lambda d: f"{d[0]}-A{d[1]}"[6:])
def test_norm_shrink_matches_the_norm_and_the_shrink(case, residual, dtypes, monkeypatch):
    """The shrink of the rounded norm output, which rows past FOLD_MAX_BLOCK take (set to 0 here: every row; the
    fold, the test after)."""
    monkeypatch.setattr(ns, "FOLD_MAX_BLOCK", 0)
    T, K, n, S, R = case
    xdt, adt = dtypes
    x, res, w, As, _, ranks, slots = random_case(T, K, n, S, R, xdt, adt, seed=T + K + n)
    mapping, _ = mapping_of(slots)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    out, new_res, buf = ns.norm_shrink(x, res if residual else None, w, 1e-6, As, mapping.token_slots, rank_dev)
    if residual:
        want_out, want_res = tew.fused_add_rms_norm(x, res, w, 1e-6)
        assert torch.equal(new_res, want_res)
    else:
        want_out = tew.rms_norm(x, w, 1e-6)
        assert new_res is None
    assert torch.equal(out, want_out)
    assert buf.shape == (1, n, T, R) and buf.dtype == torch.float32
    h = out.double().cpu()
    for i, a in enumerate(As):
        for t, s in enumerate(slots):
            if s < 0:
                continue  # rows of base tokens are not read
            r = ranks[s]
            want = h[t] @ a[s, 0, :r].double().cpu().T
            got = buf[0, i, t].cpu()
            assert torch.equal(got[r:], torch.zeros(R - r)), f"slice {i} token {t}: columns past rank {r}"
            if r:
                err = (got[:r].double() - want).abs().max() / want.abs().max()
                assert err < 1e-5, f"slice {i} token {t}: rel err {err}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-K{c[1]}-{c[2]}sl-S{c[3]}-R{c[4]}")
@pytest.mark.parametrize("residual", [True, False], ids=["add-norm", "norm"])
def test_the_folded_shrink_is_the_shrink_of_the_unrounded_norm(case, residual, monkeypatch):
    """The fold: the norm's outputs are the same bits as without it (``FOLD_MAX_BLOCK`` 0: every row unfolded);
    where the row's block is at most ``FOLD_MAX_BLOCK``, buf is (x' * rstd * w) @ A_i[slot]^T in float64 from the
    row after the add, x', unrounded (1e-5 relative), which the shrink of the rounded output misses by more; past
    it, the unfolded bits."""
    T, K, n, S, R = case
    x, res, w, As, _, ranks, slots = random_case(T, K, n, S, R, HALF[-1], torch.float16, seed=T + K + n)
    mapping, _ = mapping_of(slots)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    got = {True: ns.norm_shrink(x, res if residual else None, w, 1e-6, As, mapping.token_slots, rank_dev)}
    fold_max = ns.FOLD_MAX_BLOCK
    monkeypatch.setattr(ns, "FOLD_MAX_BLOCK", 0)
    got[False] = ns.norm_shrink(x, res if residual else None, w, 1e-6, As, mapping.token_slots, rank_dev)
    (out, new_res, buf), (out_f, new_res_f, buf_f) = got[False], got[True]
    assert torch.equal(out_f, out) and (new_res_f is None if new_res is None else torch.equal(new_res_f, new_res))
    if 1 << (K - 1).bit_length() > fold_max:  # the row's block
        assert torch.equal(buf_f, buf), "past FOLD_MAX_BLOCK the unfolded shrink runs"
        return
    xr = (new_res if residual else x).double().cpu()
    h = xr / torch.sqrt((xr * xr).mean(dim=1, keepdim=True) + 1e-6) * w.double().cpu()
    worst_default = 0.0
    for i, a in enumerate(As):
        for t, s in enumerate(slots):
            r = ranks[s] if s >= 0 else 0
            if not r:
                continue
            want = h[t] @ a[s, 0, :r].double().cpu().T
            assert torch.equal(buf_f[0, i, t, r:].cpu(), torch.zeros(R - r)), f"slice {i} token {t}: columns past rank {r}"
            err = (buf_f[0, i, t, :r].cpu().double() - want).abs().max() / want.abs().max()
            assert err < 1e-5, f"slice {i} token {t}: rel err {err}"
            worst_default = max(worst_default, ((buf[0, i, t, :r].cpu().double() - want).abs().max() / want.abs().max()).item())
    assert worst_default > 1e-5, "the unfolded shrink (of the rounded output) differs from the unrounded one's"


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"T{c[0]}-K{c[1]}-{c[2]}sl-S{c[3]}-R{c[4]}")
def test_the_shrink_as_more_columns_of_the_output(case):
    """``in_k`` (``delta_in_k``): the norm's outputs are the same bits, ``out`` is the first K columns of the
    wider output, and column K + (i*S + j)*R + r holds token t's s_i[r] rounded to out's dtype where j is its slot
    (the fp32 shrink of the default call, rounded), zeros in every other slot's columns and for base tokens."""
    T, K, n, S, R = case
    x, res, w, As, _, ranks, slots = random_case(T, K, n, S, R, HALF[-1], torch.float16, seed=T + K + n)
    mapping, _ = mapping_of(slots)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    out, new_res, buf = ns.norm_shrink(x, res, w, 1e-6, As, mapping.token_slots, rank_dev)
    out_k, new_res_k, wide = ns.norm_shrink(x, res, w, 1e-6, As, mapping.token_slots, rank_dev, in_k=True)
    assert torch.equal(out_k, out) and torch.equal(new_res_k, new_res)
    assert wide.shape == (T, K + n * S * R) and out_k.data_ptr() == wide.data_ptr() and out_k.stride(0) == wide.stride(0)
    want = torch.zeros(T, n, S, R, dtype=out.dtype)
    for t, s in enumerate(slots):
        if s >= 0:
            want[t, :, s] = buf[0, :, t].cpu().to(out.dtype)
    assert torch.equal(wide[:, K:].cpu(), want.reshape(T, -1))


def test_supports_refuses_what_it_cannot_do():
    x = torch.zeros(4, 256, dtype=torch.float16, device=DEV)
    a = torch.zeros(2, 1, 16, 256, dtype=torch.float16, device=DEV)
    assert ns.supports(x, (a, a, a))
    assert not ns.supports(x, (a.float(),)), "fp32 A: the shrink takes its products in tf32"
    assert not ns.supports(x.float(), (a,)), "fp32 x"
    assert not ns.supports(x, (a,) * 4), "four slices"
    big = torch.zeros(4, 2 * ns.MAX_HIDDEN, dtype=torch.float16, device=DEV)
    assert not ns.supports(big, (torch.zeros(2, 1, 16, 2 * ns.MAX_HIDDEN, dtype=torch.float16, device=DEV),))


@pytest.mark.parametrize("gated", [False, True], ids=["epilogue", "gated-silu"])
def test_linear_with_lora_takes_the_norms_shrink(gated, monkeypatch):
    """The GEMM given the norm's buf (no shrink launch) gives what it gives with its own shrink."""
    from loraserve.lora.ops.triton import gated_lora, lora_shrink

    monkeypatch.setattr(gated_lora, "prefer", lambda N, K: True)
    T, K, S, R = 12, 256, 4, 16
    n = 2 if gated else 3
    x, res, w, As, _, ranks, slots = random_case(T, K, n, S, R, torch.float16, torch.float16, seed=7)
    g = torch.Generator().manual_seed(8)
    outs = (128,) * n
    _, Bs = lora_stacks(g, S, R, K, outs, ranks, torch.float16)
    weight = (torch.randn(sum(outs), K, generator=g) * 0.05).to(DEV, torch.float16)
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    fused = ops.norm_shrink(x, res, w, 1e-6, As, Bs, ranks, weight, meta, mapping.token_slots)
    assert fused is not None, "decode sizes with fp16 A take the fused norm"
    out, _, buf = fused
    launches = []
    real = lora_shrink.lora_shrink
    monkeypatch.setattr("loraserve.lora.ops.triton_ops.lora_shrink", lambda *a, **k: launches.append(1) or real(*a, **k))
    y = ops.linear_with_lora(out, weight, None, As, Bs, ranks, meta, mapping.token_slots, gated, shrunk=buf)
    assert y is not None and not launches, "the norm's buf is used, no shrink launched"
    want = ops.linear_with_lora(out, weight, None, As, Bs, ranks, meta, mapping.token_slots, gated)
    assert launches, "the reference path launches its own shrink"
    assert rel_err(y, want) < 1e-3
    lora_rows = [t for t, s in enumerate(slots) if s >= 0 and ranks[s] > 0]
    base = ops.linear_with_lora(out, weight, None, As, Bs, [0] * S, meta, mapping.token_slots, gated)
    if base is not None:
        assert not torch.equal(y[lora_rows], base[lora_rows]), "the delta was added"


def test_norm_shrink_declines_what_it_does_not_support():
    T, K, S, R = 4, 256, 2, 16
    x, res, w, As, Bs, ranks, slots = random_case(T, K, 1, S, R, torch.float16, torch.float16, seed=3)
    weight = torch.zeros(64, K, dtype=torch.float16, device=DEV)
    mapping, meta = mapping_of(slots)
    ops = TritonLoRAOps(DEV)
    args = (ranks, weight, meta, mapping.token_slots)
    assert ops.norm_shrink(x, res, w, 1e-6, As, Bs, *args) is not None
    As32 = tuple(a.float() for a in As)
    assert ops.norm_shrink(x, res, w, 1e-6, As32, Bs, *args) is None, "fp32 A: the separate shrink"
    assert ops.norm_shrink(x, res, w, 1e-6, As, Bs, [0] * S, weight, meta, mapping.token_slots) is None, "no rank"


def _lora_model(seed: int):
    """test_fused_decoder_path's tiny Llama in fp16 with its four linear layers LoRA'd (fp16 A and B, random
    within each slot's rank: 16, 8, 4, 0), on the Triton LoRA kernels whatever the device."""
    import dataclasses

    import transformers

    from loraserve.config import LoRAConfig
    from loraserve.lora.layers.base_linear import BaseLinearLayerWithLoRA
    from loraserve.lora.manager import LoRAManager
    from loraserve.models.loader import init_dummy_weights
    from loraserve.models.registry import get_model_class
    from tests.gpu import test_fused_decoder_path as fdp

    # k and v of 64 columns: the decode GEMM's column block (fdp's SMALL model has 32, which it refuses)
    hf_cfg = transformers.LlamaConfig(**{**fdp.SMALL, "hidden_size": 128, "num_attention_heads": 4},
                                      intermediate_size=128, architectures=["LlamaForCausalLM"])  # fmt: skip
    model = get_model_class(hf_cfg)(hf_cfg)
    init_dummy_weights(model, seed=seed, std=0.15)
    model = model.half().to(DEV).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg = LoRAConfig(max_loras=4, max_lora_rank=16, lora_dtype=torch.float16, lora_target_modules=targets)
    mgr = LoRAManager(model, cfg, hf_cfg, DEV)
    mgr.punica.kernels, mgr.punica.fuses_linear = TritonLoRAOps(DEV), True
    g = torch.Generator().manual_seed(seed)
    layers = [m for m in mgr.modules.values() if isinstance(m, BaseLinearLayerWithLoRA)]
    assert len(layers) == 8
    for layer in layers:
        for s, r in enumerate((16, 8, 4, 0)):
            for a, b in zip(layer.lora_a_stacked, layer.lora_b_stacked):
                a[s, 0, :r] = (torch.randn(r, a.shape[3], generator=g) * 0.2).to(a)
                b[s, 0, :, :r] = (torch.randn(b.shape[2], r, generator=g) * 0.2).to(b)
            layer.slot_ranks[s] = r

    def mapping(n_tokens: int):
        slots = [-1 if t % 5 == 4 else t % 4 for t in range(n_tokens)]
        m = LoRAMapping.build(slots, slots, DEV)
        if m.token_meta is None:  # built on the CPU: the kernels' view, as CUDA's build makes it
            meta = SegmentMeta.build(m.token_order.cpu(), m.active_slots, m.seg_starts, m.seg_lens, DEV)
            m = dataclasses.replace(m, token_meta=meta)
        return m

    return model, mapping, fdp


def _run_lora_steps(model, mapping, fdp, epilogues: bool = False) -> list[torch.Tensor]:
    """The logits of fdp.STEPS. ``epilogues``: the model marks no projection's output as read by the norm after it or
    by the rotary launch (``output_feeds_norm`` / ``output_feeds_rotary``, as a model with q/k norms or MoE blocks
    does), so that every LoRA'd GEMM adds its own delta in its epilogue (or the gated SiLU-and-mul): the reference
    of the deferred deltas. Forwards marked as a CUDA graph's (run eagerly): the base GEMMs (lm_head) take the decode
    GEMM there too."""
    from loraserve.engine.model_runner import attention_layers
    from loraserve.forward_context import forward_context

    marks = [(m.base_layer, name) for m in model.modules() if hasattr(m, "base_layer")
             for name in ("output_feeds_norm", "output_feeds_rotary") if getattr(m.base_layer, name, False)]  # fmt: skip
    if epilogues:
        for base, name in marks:
            setattr(base, name, False)
    try:
        return _steps(model, mapping, fdp, attention_layers, forward_context)
    finally:
        for base, name in marks:
            setattr(base, name, True)


def _steps(model, mapping, fdp, attention_layers, forward_context) -> list[torch.Tensor]:
    for attn in attention_layers(model):
        k = torch.zeros(fdp.NUM_BLOCKS * fdp.BLOCK_SIZE, attn.num_kv_heads, attn.head_dim, dtype=torch.float16, device=DEV)
        attn.bind_kv_cache(k, torch.zeros_like(k))
    g = torch.Generator().manual_seed(0)
    logits = []
    for step in fdp.STEPS:
        md, pos = fdp.metadata(step, DEV)
        ids = torch.randint(2, 256, (pos.shape[0],), generator=g).to(DEV)
        with torch.inference_mode(), forward_context(attn=md, lora=mapping(pos.shape[0]), cuda_graph=True):
            logits.append(model.compute_logits(model(ids, pos)).float().cpu())
    return logits


@pytest.mark.parametrize("gated", [True, False], ids=["gated-silu", "gate-up-epilogue"])
def test_decoder_defers_its_lora_deltas_to_their_readers(gated, monkeypatch):
    """A tiny LoRA'd Llama's steps (fp16, prefill, decode and mixed steps of 4-8 tokens; slots of ranks 16/8/4/0 and
    base tokens) through the Triton LoRA path. The norms compute qkv's (3 slices) and gate/up's (2) shrink, and no
    shrink launch is left: o's and down's are their GEMMs' extra columns (4 slots x 16 ranks <= their 128 columns).
    qkv's delta is added by each layer's rotary launch, o's and down's by the norm after them (the post-attention
    one, the next layer's input norm, the final one); no GEMM runs an epilogue but gate/up's where the gated
    SiLU-and-mul does not take it. The logits equal those of the same model whose GEMMs add their own deltas
    (``_run_lora_steps(epilogues=True)``). The shrink of the rounded norm output (``FOLD_MAX_BLOCK`` 0) and gate/up's
    delta outside its GEMM's K (``delta_in_k.MAX_SLOT_COLUMNS`` 0), the fallbacks of larger shapes: the fold's and
    delta_in_k's other roundings are checked against HF + PEFT by test_gpu_engine."""
    from loraserve import forward_context
    from loraserve.layers import triton_decode_linear
    from loraserve.lora.ops import delta_in_k
    from loraserve.lora.ops.triton import gated_lora, row_delta

    monkeypatch.setattr(delta_in_k, "MAX_SLOT_COLUMNS", 0)  # (read when the wrappers are created)
    monkeypatch.setattr(ns, "FOLD_MAX_BLOCK", 0)
    model, mapping, fdp = _lora_model(seed=1)
    fdp.take_gpu_path(monkeypatch)
    monkeypatch.setattr(gated_lora, "prefer", lambda N, K: gated)
    want = _run_lora_steps(model, mapping, fdp, epilogues=True)
    shrinks, norms, deltas, qkv_deltas, gemms = [], [], [], [], []
    real_shrink, real_norm = TritonLoRAOps.__init__.__globals__["lora_shrink"], ns.norm_shrink
    real_args, real_qkv_args, real_gemm = row_delta.kernel_args, row_delta.qkv_kernel_args, triton_decode_linear.decode_linear
    monkeypatch.setattr("loraserve.lora.ops.triton_ops.lora_shrink", lambda *a, **k: shrinks.append(len(a[1])) or real_shrink(*a, **k))
    monkeypatch.setattr(ns, "norm_shrink", lambda *a, **k: norms.append(len(a[4])) or real_norm(*a, **k))
    monkeypatch.setattr(row_delta, "kernel_args", lambda d, x: deltas.append(d is not None) or real_args(d, x))
    monkeypatch.setattr(row_delta, "qkv_kernel_args", lambda d, q, h: qkv_deltas.append(d is not None) or real_qkv_args(d, q, h))
    monkeypatch.setattr(triton_decode_linear, "decode_linear",
                        lambda *a, **k: gemms.append((k.get("lora") is not None, k.get("shrink_into") is not None,
                                                      k.get("trigger_after_wait", False)))
                        or real_gemm(*a, **k))  # fmt: skip
    got = _run_lora_steps(model, mapping, fdp)
    n_steps, n_layers = len(fdp.STEPS), 2
    assert norms == [3, 2] * n_layers * n_steps, f"each layer's two norms, qkv's then gate/up's: {norms}"
    assert not shrinks, f"no shrink launch left: {shrinks}"
    assert deltas.count(True) == 2 * n_layers * n_steps, f"o's and down's deltas, each taken by a norm: {deltas}"
    assert qkv_deltas == [True] * n_layers * n_steps, f"each layer's rotary launch takes qkv's delta: {qkv_deltas}"
    # per layer: qkv (its dependent launched after its wait), o (its shrink as more columns), gate/up, down; then lm_head
    layer = [(False, False, True), (False, True, False), (not gated, False, False), (False, True, False)]
    assert gemms == (layer * n_layers + [(False, False, False)]) * n_steps, gemms
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=lambda m, i=i: f"step {i}: {m}")
    for module in model.modules():
        assert getattr(module, "_shrunk_input", None) is None, "every shrink the norms made was taken"
    assert forward_context.get_forward_context_or_none() is None
