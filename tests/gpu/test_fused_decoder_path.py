"""A tiny model's forward through the GPU path (Triton norms, rotary + KV-cache write, attention) against
the torch path, end to end.

Three steps over a paged cache (a prefill of two sequences, a decode, then a chunked-prefill chunk beside
a decode): logits within 1e-4 of the torch path's (fp32), and the KV caches the fused rotary + cache
kernel filled equal to the ones the torch path's ``cache[slot_mapping] = k`` filled. For Llama also the
launch count: 4 small kernels per decoder layer (add + RMSNorm twice, rotary + KV write, SiLU-and-mul)
plus the first layer's plain RMSNorm, and no torch residual add or index_put left.

On CUDA the model simply runs on the GPU. On the CPU under ``TRITON_INTERPRET=1`` the dispatch is
patched so that CPU tensors take the Triton kernels (the interpreter runs them), i.e. exactly the code
the GPU runs, minus CUDA graphs.
"""

from __future__ import annotations

import collections

import pytest
import torch
from gpu.triton_device import triton_device

DEV = triton_device()

import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import loraserve.layers.activation as activation_mod  # noqa: E402
import loraserve.layers.attention as attention_mod  # noqa: E402
import loraserve.layers.linear as linear_mod  # noqa: E402
import loraserve.layers.norm as norm_mod  # noqa: E402
import loraserve.layers.rotary as rotary_mod  # noqa: E402
import loraserve.layers.triton_elementwise as tew  # noqa: E402
from loraserve.engine.model_runner import attention_layers  # noqa: E402
from loraserve.forward_context import AttentionMetadata, forward_context  # noqa: E402
from loraserve.layers.triton_attention import paged_attention  # noqa: E402
from loraserve.models.loader import init_dummy_weights  # noqa: E402
from loraserve.models.registry import get_model_class  # noqa: E402

# NOTE: the interpreter running the attention kernel warns on numpy scalar conversions (its own code)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

BLOCK_SIZE, NUM_BLOCKS = 4, 6
TABLES = [[2, 0, 4], [3, 1]]  # each sequence's cache blocks
# per step, per sequence: (first position, new tokens)
STEPS = [[(0, 5), (0, 3)], [(5, 1), (3, 1)], [(6, 3), (4, 1)]]
SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)  # fmt: skip


def config(name: str):
    if name.startswith("llama"):
        cfg = transformers.LlamaConfig(intermediate_size=128, architectures=["LlamaForCausalLM"], **SMALL)
        if name == "llama_partial_rope":  # rotary over half of head_dim, the rest passed through
            cfg.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
        return cfg
    if name == "qwen3":  # per-head q/k RMSNorm before rotary
        return transformers.Qwen3Config(intermediate_size=128, head_dim=16, architectures=["Qwen3ForCausalLM"], **SMALL)
    if name == "olmoe":  # q/k RMSNorm over the whole projections, clip_qkv, MoE MLP
        return transformers.OlmoeConfig(
            intermediate_size=24, num_experts=4, num_experts_per_tok=2, clip_qkv=0.6, architectures=["OlmoeForCausalLM"],
            **SMALL,
        )  # fmt: skip
    raise KeyError(name)


def metadata(step: list[tuple[int, int]], device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """The step's metadata for both paths (kv_slots for torch, seq_info/block_tables for Triton), positions."""
    slots, positions, starts, lens, ctx, kv_slots = [], [], [], [], [], []
    for table, (p0, n) in zip(TABLES, step):
        starts.append(len(positions))
        lens.append(n)
        ctx.append(p0 + n)
        positions.extend(range(p0, p0 + n))
        slots.extend(table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(p0, p0 + n))
        kv_slots.append(torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(p0 + n)]))
    width = max(len(t) for t in TABLES)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in TABLES], dtype=torch.int32, device=device)
    info = torch.tensor([[s, n, c] for s, n, c in zip(starts, lens, ctx)], dtype=torch.int32, device=device)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), query_starts=starts, query_lens=lens, context_lens=ctx,
        kv_slots=[s.to(device) for s in kv_slots], block_tables=tables, seq_info=info, block_size=BLOCK_SIZE,
    )  # fmt: skip
    return md, torch.tensor(positions, device=device)


def run(model: torch.nn.Module, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Bind fresh caches, run STEPS; (logits of each step, every layer's k and v cache) on the CPU."""
    caches = []
    for attn in attention_layers(model):
        k = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, attn.num_kv_heads, attn.head_dim, device=device)
        v = torch.zeros_like(k)
        attn.bind_kv_cache(k, v)
        caches += [k, v]
    g = torch.Generator().manual_seed(0)
    logits = []
    for step in STEPS:
        md, pos = metadata(step, device)
        ids = torch.randint(2, 256, (pos.shape[0],), generator=g).to(device)
        with torch.inference_mode(), forward_context(attn=md):
            logits.append(model.compute_logits(model(ids, pos)).cpu())
    return logits, [c.cpu() for c in caches]


def take_gpu_path(monkeypatch) -> None:
    """Make DEV's tensors take the Triton kernels: CUDA ones do already; on the CPU patch the dispatch (the base
    linear layers' too, which take the decode GEMM in a CUDA-graph forward only)."""
    if DEV.type == "cpu":
        for mod in (norm_mod, rotary_mod, activation_mod, linear_mod):
            monkeypatch.setattr(mod, "on_triton", lambda x: True)
        monkeypatch.setattr(attention_mod, "_select_kernel", lambda device: paged_attention)


def build(name: str) -> torch.nn.Module:
    cfg = config(name)
    model = get_model_class(cfg)(cfg)
    init_dummy_weights(model, seed=1, std=0.15)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.mark.parametrize("name", ["llama", "llama_partial_rope", "qwen3", "olmoe"])
def test_gpu_path_equals_torch_path(name, monkeypatch):
    model = build(name)
    want_logits, want_caches = run(model, torch.device("cpu"))  # the torch path
    take_gpu_path(monkeypatch)
    got_logits, got_caches = run(model.to(DEV), DEV)
    assert all(a._kernel is paged_attention for a in attention_layers(model)), "the Triton path was not taken"
    for i, (got, want) in enumerate(zip(got_logits, want_logits)):
        assert want.abs().max() > 0.1, "degenerate logits"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")
    for got, want in zip(got_caches, want_caches):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _AtenOps(TorchDispatchMode):
    """Counts the aten ops run under it (what torch launches; Triton kernels are not aten ops)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_llama_layer_launches_four_small_kernels(monkeypatch):
    """Per decoder layer: add + RMSNorm (x2), rotary + KV write, SiLU-and-mul; the first layer's input norm
    plain (no residual yet), the final norm an add + RMSNorm. No torch add, index_put or norm math left."""
    model = build("llama")
    take_gpu_path(monkeypatch)
    model.to(DEV)
    run(model, DEV)  # binds the caches, warms up
    calls = collections.Counter()
    for fn in ("rms_norm", "fused_add_rms_norm", "rotary", "rotary_kv_cache", "silu_and_mul"):
        orig = getattr(tew, fn)

        def spy(*a, _fn=fn, _orig=orig, **kw):
            calls[_fn] += 1
            return _orig(*a, **kw)

        monkeypatch.setattr(tew, fn, spy)
    md, pos = metadata(STEPS[1], DEV)
    L = len(model.model.layers)
    with torch.inference_mode(), forward_context(attn=md), _AtenOps() as rec:
        model(torch.tensor([7, 8], device=DEV), pos)
    assert calls == {"rms_norm": 1, "fused_add_rms_norm": 2 * L, "rotary_kv_cache": L, "silu_and_mul": L}
    leftover = {"add", "add_", "index_put", "index_put_", "rsqrt", "pow", "mean", "silu", "neg"} & set(rec.ops)
    assert not leftover, f"torch elementwise ops left on the GPU path: {leftover}"
