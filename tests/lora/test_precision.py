"""fp16 LoRA storage balanced per rank, and the rule that picks the products' dtype (lora/ops/precision.py).

The GPU stores LoRA weights in fp16 by default for bf16 models (their products with fp32 weights were
tf32, which reads fp16's 10 mantissa bits); these tests pin down on the CPU that the stored pairs keep
the product B A to fp16's precision where a plain cast would not, what is refused, and who resolves it.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_model, max_logprob_diff, peft_model

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import LoRAConfig
from loraserve.lora.errors import LoRAFormatError
from loraserve.lora.mixtures import combine_adapters
from loraserve.lora.ops import precision
from loraserve.lora.ops.precision import balance_to_fp16, compute_dtype
from loraserve.lora.peft import load_adapter
from loraserve.lora.request import LoRAMixture

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def rel(prod: torch.Tensor, ref: torch.Tensor) -> float:
    return ((prod - ref).norm() / ref.norm()).item()


def trained_like(r=8, n_in=64, n_out=48, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """A (r, in) and a scaled B (out, r) at the magnitudes of a trained adapter: A ~ 1e-2, B ~ 1e-6 to
    1e-4 (small learning rates, alpha / r folded in), with one rank 100x smaller than the others."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, n_in, generator=g) * 1e-2
    b = torch.randn(n_out, r, generator=g) * 3e-5
    b[:, 1] *= 0.01
    return a, b


def worst_rank_error(a16: torch.Tensor, b16: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest relative error over ranks i of the rank's own term B[:, i] A[i]."""
    return max(rel(torch.outer(b16[:, i].double(), a16[i].double()), torch.outer(b[:, i].double(), a[i].double()))
               for i in range(a.shape[0]))  # fmt: skip


def test_balanced_fp16_keeps_the_product_where_a_plain_cast_loses_it():
    a, b = trained_like()
    a16, b16 = balance_to_fp16(a, b, "test")
    assert a16.dtype == b16.dtype == FP16
    assert worst_rank_error(a16, b16, a, b) < 2**-10  # fp16's (and tf32's) 10 mantissa bits, every rank
    assert rel(b16.double() @ a16.double(), b.double() @ a.double()) < 2**-10
    assert worst_rank_error(a.half(), b.half(), a, b) > 1e-2  # a plain cast: the small rank's B is subnormal
    # each rank's scale is a power of two (up to fp16's rounding of each value): A's row and B's column
    # change by inverse factors
    ratio_a = a16.float() / a
    ratio_b = b16.float() / b
    for i in range(a.shape[0]):
        e = torch.log2(ratio_a[i].median())
        assert abs(e - torch.round(e)) < 1e-3
        assert torch.allclose(ratio_b[:, i].median() * ratio_a[i].median(), torch.tensor(1.0), rtol=1e-3)


def test_balance_per_expert_and_zero_ranks():
    """Leading dims (MoE experts) balance separately; a rank whose B column is zero is stored as zeros even
    with an A row fp16 cannot hold (it adds nothing; inf * 0 would be NaN)."""
    a, b = trained_like(r=4)
    a3 = torch.stack([a, a * 1e3])  # (E, r, in): expert 1's A 1000x larger
    b3 = torch.stack([b, b])
    b3[0, :, 2] = 0.0
    a3[0, 2] = 1e6
    a16, b16 = balance_to_fp16(a3, b3, "test")
    for e in range(2):
        ref = b3[e].double() @ a3[e].double()
        assert rel(b16[e].double() @ a16[e].double(), ref) < 2**-10
    assert torch.equal(a16[0, 2], torch.zeros_like(a16[0, 2])) and torch.equal(b16[0, :, 2], torch.zeros_like(b16[0, :, 2]))
    assert torch.isfinite(a16).all() and torch.isfinite(b16).all()


def test_balance_refuses_what_fp16_cannot_hold():
    a, b = trained_like(r=2)
    a[0, 0], b[0, 0] = 3e5, 3e5  # a rank scale of 9e10: its balanced maximum is 3e5 > 65504
    with pytest.raises(ValueError, match=r"module 'x'.*beyond fp16 storage.*--lora-dtype float32"):
        balance_to_fp16(a, b, "module 'x'")
    a, b = trained_like(r=2)
    b[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf; the adapter file is broken"):
        balance_to_fp16(a, b, "module 'x'")


def test_products_of_mixed_half_precisions_run_in_fp32(monkeypatch):
    assert compute_dtype(BF16, FP16) == FP32  # bf16 x, fp16 weights: tf32 on the GPU, exact for both
    assert compute_dtype(FP16, BF16) == FP32
    assert compute_dtype(BF16, BF16) == BF16
    assert compute_dtype(FP16, FP16) == FP16
    assert compute_dtype(FP32, FP16) == FP16  # fp32 x with half weights: the weights' dtype, as before
    assert compute_dtype(BF16, FP32) == FP32
    monkeypatch.setattr(precision, "MIXED_HALVES_IN_FP32", False)
    assert compute_dtype(BF16, FP16) == FP16


def test_auto_lora_dtype_is_fp16_on_the_gpu_for_bf16_models_only():
    cfg = LoRAConfig()
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert cfg.resolved_dtype(cuda, BF16) == FP16
    assert cfg.resolved_dtype(cuda, FP16) == FP32  # fp16 weights with fp16 x would multiply in fp16
    assert cfg.resolved_dtype(cuda, FP32) == FP32
    assert cfg.resolved_dtype(cpu, BF16) == FP32
    assert cfg.resolved_dtype() == FP32
    assert LoRAConfig(lora_dtype="bfloat16").resolved_dtype(cuda, BF16) == BF16
    assert LoRAConfig(lora_dtype="float32").resolved_dtype(cuda, BF16) == FP32


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp16")
    base = root / "base"
    make_tiny_model(base, "llama")
    targets = ["q_proj", "v_proj", "down_proj", "embed_tokens"]
    a = make_peft_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    b = make_peft_adapter(base, root / "b", seed=2, r=4, lora_alpha=16, target_modules=["q_proj", "o_proj"])
    return base, a, b


def test_load_adapter_stores_balanced_pairs_and_keeps_extras_fp32(world, tmp_path):
    base, a_dir, _ = world
    exact = load_adapter(a_dir, "a", 16, FP32)
    stored = load_adapter(a_dir, "a", 16, FP16)
    assert stored.modules.keys() == exact.modules.keys()
    for name, m in stored.modules.items():
        assert m.lora_a.dtype == m.lora_b.dtype == FP16
        e = exact.modules[name]
        assert rel(m.lora_b.double() @ m.lora_a.double(), e.lora_b.double() @ e.lora_a.double()) < 2**-10, name
    c_dir = make_peft_adapter(base, tmp_path / "c", seed=3, r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj"])
    with_bias = load_adapter(c_dir, "c", 16, FP16)
    biases = [m.lora_bias for m in with_bias.modules.values() if m.lora_bias is not None]
    assert biases and all(t.dtype == FP32 for t in biases)  # rounded once, where used


def test_an_adapter_fp16_cannot_hold_is_refused_naming_the_module_and_the_fix(world, tmp_path):
    from safetensors.torch import load_file, save_file

    _, a_dir, _ = world
    bad = tmp_path / "huge"
    shutil.copytree(a_dir, bad)
    sd = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in sd if "layers.0.self_attn.q_proj.lora_A" in k)
    sd[key] = sd[key] * 1e7
    sd[key.replace("lora_A", "lora_B")] = sd[key.replace("lora_A", "lora_B")] * 1e7
    save_file(sd, str(bad / "adapter_model.safetensors"))
    assert load_adapter(bad, "huge", 16, FP32).modules  # fp32 storage holds it
    with pytest.raises(LoRAFormatError, match=r"q_proj.*beyond fp16 storage.*--lora-dtype float32"):
        load_adapter(bad, "huge", 16, FP16)


def test_mixture_combines_before_storing_in_fp16(world):
    """ties merges A and B elementwise: the components combine in fp32, then the result is balanced (a merge of
    balanced components would merge rows scaled by different powers of two)."""
    base, a_dir, b_dir = world
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, lora_dtype="float16")
    mgr = llm.engine.lora_manager
    assert mgr.lora_dtype == FP16
    ra, rb = LoRARequest("a", 1, str(a_dir)), LoRARequest("b", 2, str(b_dir))
    mix = LoRAMixture("mix", 3, components=((ra, 0.7), (rb, -0.4)), combination="ties", density=0.5)
    got = mgr._load(mix)
    want = combine_adapters("mix", [load_adapter(a_dir, "a", 16), load_adapter(b_dir, "b", 16)], [0.7, -0.4], "ties", 16, 0.5)
    for name, m in want.modules.items():
        g = got.modules[name]
        assert g.lora_a.dtype == FP16
        assert rel(g.lora_b.double() @ g.lora_a.double(), m.lora_b.double() @ m.lora_a.double()) < 2**-10, name


def test_fp16_lora_weights_serve_within_rounding_of_peft(world):
    """An fp16-stored adapter (slots and host copies fp16) through the engine: PEFT's logprobs within the
    bound the bf16-stored one meets (test_peft_parity)."""
    base, a_dir, _ = world
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, lora_dtype="float16")
    q = next(m for path, m in llm.engine.lora_manager.modules.items() if path.endswith("qkv_proj"))
    assert q.lora_a_stacked[0].dtype == q.lora_b_stacked[0].dtype == FP16
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 3, 5, 77]]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, lora_request=LoRARequest("a", 1, str(a_dir)))
    ref = peft_model(base, {"a": a_dir})
    for p, o in zip(prompts, outs):
        assert max_logprob_diff(ref, o, p) < 2e-2


def test_a_near_dead_rank_balances_to_zeros_not_nan():
    """A rank whose two maxima are ~2^130 apart (a stray fp32-subnormal A value, the rest zero): its scale
    ratio overflows fp32, so the exponent comes from the logs; stored as zeros or finite values, never NaN."""
    a, b = trained_like(r=2)
    b[:, 1] = 1.0
    a[1] = 0.0
    a[1, 0] = 1e-39
    a16, b16 = balance_to_fp16(a, b, "test")
    assert torch.isfinite(a16).all() and torch.isfinite(b16).all()
    assert rel(b16.double() @ a16.double(), b.double() @ a.double()) < 2**-10
    a = torch.full((1, 4), 65504.0)  # fp16's largest value, paired with a unit column: times 2^-8
    a16, b16 = balance_to_fp16(a, torch.ones(3, 1), "test")
    assert a16.float().max() == 65504.0 / 256 and b16.float().max() == 256.0


def test_punica_shrink_then_expand_keeps_s_in_fp32_with_fp16_weights():
    """The fully-sharded layers under TP > 1 take PunicaWrapper.add_shrink then add_expand, which must pick
    the products of the default path (add_lora_linear): bf16 x with fp16 weights keeps s in fp32. Here
    |s| > 65504, which fp16 would make inf."""
    from loraserve.forward_context import forward_context
    from loraserve.lora.punica import LoRAMapping, PunicaWrapper

    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(0)
    T, K, N, R = 4, 64, 32, 8
    a, b = torch.randn(R, K, generator=g) * 0.5, torch.randn(N, R, generator=g) * 0.5
    a16, b16 = balance_to_fp16(a, b, "t")
    A, B = a16.view(1, 1, R, K).clone(), b16.view(1, 1, N, R).clone()
    x = (torch.randn(T, K, generator=g) * 12000).to(BF16)
    ref = x.double() @ a.double().t() @ b.double().t()
    pw = PunicaWrapper(1, cpu)
    with forward_context(lora=LoRAMapping.build([0] * T, [], cpu)):
        fused = torch.zeros(T, N)
        pw.add_lora_linear(fused, x, (A,), (B,), (N,), [R])
        buf = torch.zeros(T, R)
        pw.add_shrink(buf, x, A, [R])
        split = torch.zeros(T, N)
        pw.add_expand(split, buf, B, [R], 0, x.dtype)
    assert buf.abs().max() > 65504, "the case must overflow fp16 in s"
    assert torch.isfinite(split).all()
    assert rel(split, ref) < 2**-9 and rel(fused, ref) < 2**-9
    torch.testing.assert_close(split, fused, rtol=0, atol=0)


def test_the_manager_resolves_auto_once_for_its_layers(world, monkeypatch):
    """The LoRA manager resolves auto with the device and the model's dtype and hands its layers a config
    holding the result (layers build their slots from it without knowing the device's rule): simulated
    here by an auto that picks fp16 whenever it is told a device, as the GPU's rule does for bf16."""
    base, a_dir, _ = world
    original = LoRAConfig.resolved_dtype

    def gpu_like(self, device=None, model_dtype=None):
        if self.lora_dtype == "auto" and device is not None:
            return FP16
        return original(self, device, model_dtype)

    monkeypatch.setattr(LoRAConfig, "resolved_dtype", gpu_like)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16)
    mgr = llm.engine.lora_manager
    assert mgr.lora_dtype == FP16
    for module in mgr.modules.values():
        stacks = module.lora_a_stacked if isinstance(module.lora_a_stacked, tuple) else (module.lora_a_stacked,)
        assert all(t.dtype == FP16 for t in stacks), type(module).__name__
    packed = mgr._load(LoRARequest("a", 1, str(a_dir)))
    assert all(m.lora_a.dtype == FP16 for m in packed.modules.values())  # the host copies too
