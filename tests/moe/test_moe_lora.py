"""LoRA on MoE experts: parity with transformers + PEFT 0.21 on tiny Qwen3-MoE and Mixtral (fp32, CPU).

Adapters built by PEFT with ``target_parameters`` (experts only, attention + experts, rsLoRA with
rank/alpha patterns on the expert parameters, down_proj only) and per-expert 2-D adapters in the
transformers-4 layout (Qwen ``mlp.experts.N.gate_proj``, Mixtral ``block_sparse_moe.experts.N.w1``),
which PEFT converts on load. Each request is compared with PEFT running that adapter alone (PEFT
refuses mixed batches with target_parameters), also when served in one mixed batch with the base model
and more adapters than slots. Then the layer on its own: the W_e + s B_e A_e reference for gated,
interleaved and non-gated experts with several slots in one batch, and the TP shard rule.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_peft_adapter, max_logprob_diff, peft_model
from moe_fixtures import INTER, TOP_K, E, H, make_moe_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import LoRAConfig
from loraserve.distributed import parallel_state
from loraserve.forward_context import forward_context
from loraserve.layers.moe import FusedMoE, RoutingConfig
from loraserve.lora.errors import LoRARankError, LoRAShapeError
from loraserve.lora.layers import FusedMoEWithLoRA
from loraserve.lora.peft import LoRAModuleWeights, load_adapter, resolve_param_targets
from loraserve.lora.punica import LoRAMapping

# PEFT warns that patterns on parameters match "no targeted module", yet applies them (see the file shapes test)
pytestmark = pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning")
ATOL = 1e-4
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 3, 17, 250, 9, 9, 60, 61, 62]]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ARCHS = ["qwen3_moe", "mixtral"]
CASES = {
    "experts": dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS),
    "attn_experts": dict(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS
    ),
    "rslora_patterns": dict(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "v_proj"],
        target_parameters=EXPERTS,
        rank_pattern={"gate_up_proj": 2, "model.layers.1.mlp.experts.down_proj": 6, "q_proj": 8},
        alpha_pattern={"down_proj": 3, "layers.0.mlp.experts.gate_up_proj": 5},
    ),
    "down_only": dict(r=4, lora_alpha=4, target_modules=[], target_parameters=["mlp.experts.down_proj"]),
    "per_expert_2d": None,  # hand-written, transformers-4 layout
}


def per_expert_adapter(base_dir, out_dir, arch: str, seed: int, r: int = 4, alpha: int = 8):
    """A per-expert LoRA as PEFT wrote them for transformers 4 (experts were nn.Linear modules)."""
    block, names = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if arch == "mixtral"
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(2):
        for e in range(E):
            for nm, (fin, fout) in zip(names, [(H, INTER), (H, INTER), (INTER, H)]):
                key = f"base_model.model.model.layers.{layer}.{block}.experts.{e}.{nm}"
                sd[f"{key}.lora_A.weight"] = torch.randn(r, fin, generator=g) * 0.2
                sd[f"{key}.lora_B.weight"] = torch.randn(fout, r, generator=g) * 0.2
    out_dir.mkdir(parents=True)
    save_file(sd, str(out_dir / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(names), "task_type": "CAUSAL_LM",
           "base_model_name_or_path": None, "bias": "none", "inference_mode": True}  # fmt: skip
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg))
    return out_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_lora")
    bases, adapters, engines = {}, {}, {}
    for arch in ARCHS:
        bases[arch] = root / arch
        make_moe_model(bases[arch], arch, seed=3)
        for i, (case, kw) in enumerate(CASES.items()):
            out = root / f"{arch}-{case}"
            if kw is None:
                adapters[arch, case] = per_expert_adapter(bases[arch], out, arch, seed=50 + i)
            else:
                adapters[arch, case] = make_peft_adapter(bases[arch], out, seed=50 + i, **kw)
        engines[arch] = LLM(
            str(bases[arch]),
            dtype="float32",
            enable_lora=True,
            max_loras=3,
            max_lora_rank=8,
            max_model_len=64,
        )
    refs: dict = {}

    def ref(arch, case):  # PEFT with this adapter alone (None = the HF base)
        if (arch, case) not in refs:
            refs[arch, case] = (
                peft_model(bases[arch], {case: adapters[arch, case]})
                if case
                else peft_model_base(bases[arch])
            )
        return refs[arch, case]

    return bases, adapters, engines, ref


def peft_model_base(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def req(arch: str, case: str, adapters) -> LoRARequest:
    return LoRARequest(case, 1 + list(CASES).index(case), str(adapters[arch, case]))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_matches_peft(arch, case, setup):
    bases, adapters, engines, ref = setup
    llm = engines[arch]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SP, lora_request=req(arch, case, adapters)
    )
    base_outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP)
    model = ref(arch, case)
    for p, o, b in zip(PROMPTS, outs, base_outs):
        assert max_logprob_diff(model, o, p) < ATOL
        want = model.generate(
            torch.tensor([p]), max_new_tokens=SP.max_tokens, do_sample=False, eos_token_id=None
        )
        assert o.outputs[0].token_ids == want[0, len(p) :].tolist()
        lp = [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
        blp = [b.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
        assert max(abs(x - y) for x, y in zip(lp, blp)) > 1e-3, f"{case} did not change the output"


def test_adapter_files_use_the_layouts_under_test(setup):
    """PEFT nests gate_up_proj as experts.base_layer.lora_* and down_proj as experts.lora_*; rank_pattern
    gives per-expert ranks (A has E*r rows), which our parse recovers by parameter path."""
    _, adapters, _, _ = setup
    path = adapters["qwen3_moe", "rslora_patterns"]
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_tensor(k).shape) for k in f.keys()}
    pre = "base_model.model.model.layers."
    assert shapes[pre + "0.mlp.experts.base_layer.lora_A.weight"] == (E * 2, H)  # gate_up_proj, r=2
    assert shapes[pre + "0.mlp.experts.base_layer.lora_B.weight"] == (2 * INTER, E * 2)
    assert shapes[pre + "0.mlp.experts.lora_A.weight"] == (E * 4, INTER)  # down_proj, r=4
    assert shapes[pre + "1.mlp.experts.lora_A.weight"] == (E * 6, INTER)  # down_proj, r=6 in layer 1
    ad = load_adapter(path, "x", max_rank=8)
    gu0, d0, d1 = (
        ad.modules[f"model.layers.{n}"]
        for n in ("0.mlp.experts.gate_up_proj", "0.mlp.experts.down_proj", "1.mlp.experts.down_proj")
    )
    assert (gu0.rank, gu0.num_experts, gu0.scaling) == (2, E, 5 / 2**0.5)  # alpha_pattern, rsLoRA
    assert (d0.rank, d0.scaling, d1.rank, d1.scaling) == (4, 3 / 2, 6, 3 / 6**0.5)
    assert tuple(gu0.lora_a.shape) == (E, 2, H) and tuple(gu0.lora_b.shape) == (E, 2 * INTER, 2)
    # A_e = A[e*r:(e+1)*r], B_e = B[:, e::E] (scaled)
    sd = load_file(str(path / "adapter_model.safetensors"))
    a, b = (
        sd[pre + "0.mlp.experts.base_layer.lora_A.weight"],
        sd[pre + "0.mlp.experts.base_layer.lora_B.weight"],
    )
    assert torch.equal(gu0.lora_a[1], a[2:4])
    torch.testing.assert_close(gu0.lora_b[1], b[:, 1::E] * gu0.scaling)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_equals_each_adapter_alone_in_peft(arch, setup):
    """Five adapters and the base in one generate call (max_loras=3): each request == PEFT with its adapter alone."""
    _, adapters, engines, ref = setup
    llm = engines[arch]
    names = ["experts", "attn_experts", None, "rslora_patterns", "per_expert_2d", "down_only"]
    prompts, loras = [], []
    for i in range(12):
        prompts.append({"prompt_token_ids": PROMPTS[i % 2]})
        name = names[i % len(names)]
        loras.append(None if name is None else req(arch, name, adapters))
    mixed = llm.generate(prompts, SP, lora_request=loras)
    for p, lr, o in zip(prompts, loras, mixed):
        assert max_logprob_diff(ref(arch, lr.lora_name if lr else None), o, p["prompt_token_ids"]) < ATOL
        alone = llm.generate([p], SP, lora_request=lr)[0]
        assert o.outputs[0].token_ids == alone.outputs[0].token_ids


def test_adapter_for_other_experts_is_refused(setup, tmp_path):
    _, adapters, engines, _ = setup
    src = adapters["qwen3_moe", "experts"]
    sd = load_file(str(src / "adapter_model.safetensors"))
    cfg = json.loads((src / "adapter_config.json").read_text())
    for name, edit, cfg_edit, err, needle in [
        ("two_experts", lambda k, t: t[: 2 * 4] if "lora_A" in k else t.reshape(t.shape[0], 4, E)[..., :2].reshape(t.shape[0], -1), {},
         LoRAShapeError, "does not fit 4 experts"),
        ("bad_rank", lambda k, t: t, {"r": 3}, LoRARankError, "E*r"),
    ]:  # fmt: skip
        d = tmp_path / name
        d.mkdir()
        save_file({k: edit(k, t).contiguous() for k, t in sd.items()}, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({**cfg, **cfg_edit}))
        with pytest.raises(err, match=needle):
            engines["qwen3_moe"].add_lora(LoRARequest(name, 90 + len(name), str(d)))


def test_nesting_is_told_apart_by_shapes():
    """Two pairs on one experts module: gate_up (A (., H), B (2I, .)) vs down (A (., INTER), B (H, .)), whichever nests."""
    r = 2
    gu = {"lora_A": torch.zeros(E * r, H), "lora_B": torch.zeros(2 * INTER, E * r)}
    down = {"lora_A": torch.zeros(E * r, INTER), "lora_B": torch.zeros(H, E * r)}
    cfg = {"target_parameters": EXPERTS}
    m = "model.layers.0.mlp.experts"
    assert resolve_param_targets(cfg, {f"{m}.base_layer": gu, m: down}, None) == {
        f"{m}.base_layer": f"{m}.gate_up_proj", m: f"{m}.down_proj"}  # fmt: skip
    assert resolve_param_targets(cfg, {f"{m}.base_layer": down, m: gu}, None) == {
        f"{m}.base_layer": f"{m}.down_proj", m: f"{m}.gate_up_proj"}  # fmt: skip
    assert resolve_param_targets({"target_parameters": EXPERTS[1:]}, {m: down}, None) == {m: f"{m}.down_proj"}
    assert resolve_param_targets(cfg, {"model.layers.0.self_attn.q_proj": down}, None) == {}


# ---- the layer on its own ------------------------------------------------------------------------
def _expert_lora(E_, fin, fout, r, seed) -> LoRAModuleWeights:
    g = torch.Generator().manual_seed(seed)
    return LoRAModuleWeights(
        "x",
        torch.randn(E_, r, fin, generator=g) * 0.3,
        torch.randn(E_, fout, r, generator=g) * 0.3,
        r,
        1.0,
        num_experts=E_,
    )


def _layer(gated=True, interleaved=False, w13=None, w2=None, seed=0):
    base = FusedMoE(
        E,
        H,
        INTER,
        RoutingConfig(TOP_K, renormalize=True),
        gated=gated,
        interleaved=interleaved,
        reduce_results=False,
    )
    g = torch.Generator().manual_seed(seed)
    n13 = (2 if gated else 1) * INTER
    w13 = torch.randn(E, n13, H, generator=g) * 0.2 if w13 is None else w13
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2 if w2 is None else w2
    base.gate_up_proj.weight_loader(base.gate_up_proj, w13)
    base.down_proj.weight_loader(base.down_proj, w2)
    layer = FusedMoEWithLoRA(base)
    layer.create_lora_weights(3, LoRAConfig(max_loras=3, max_lora_rank=8))
    return layer, w13, w2


def _reference(layer, w13, w2, slot_loras, slots, x, logits):
    """Token by token with merged weights W_e + B_e A_e of the token's slot (w13 in its stored row layout)."""
    base = layer.base_layer
    out = torch.zeros_like(x)
    probs = torch.softmax(logits, -1)
    for t, s in enumerate(slots):
        w, ids = torch.topk(probs[t], TOP_K)
        w = w / w.sum()
        for wk, e in zip(w, ids.tolist()):
            m13, m2 = w13[e].clone(), w2[e].clone()
            if s >= 0 and slot_loras[s] is not None:
                gu, down = slot_loras[s]
                if gu is not None:
                    m13 += gu.lora_b[e] @ gu.lora_a[e]
                if down is not None:
                    m2 += down.lora_b[e] @ down.lora_a[e]
            out[t] += wk * (m2 @ base.activate((m13 @ x[t])[None])[0])
    return out


@pytest.mark.parametrize("layout", ["gated", "interleaved", "non_gated"])
def test_layer_equals_merged_weights_with_several_slots(layout):
    """Slots 0 (gate_up + down), 1 (down only), 2 (reset) and the base in one batch."""
    layer, w13, w2 = _layer(gated=layout != "non_gated", interleaved=layout == "interleaved")
    n13 = w13.shape[1]
    loras = [
        (_expert_lora(E, H, n13, 3, 1), _expert_lora(E, INTER, H, 5, 2)),
        (None, _expert_lora(E, INTER, H, 2, 3)),
        None,
    ]
    m = "model.layers.0.mlp.experts"
    for s, pair in enumerate(loras[:2]):
        mods = {f"{m}.{n}": w for n, w in zip(layer.base_layer.hf_param_names, pair) if w is not None}
        a, b, used = layer.gather_adapter(mods, [f"{m}.{n}" for n in layer.base_layer.hf_param_names], str)
        assert sorted(used) == sorted(mods)
        layer.set_lora(s, a, b)
    layer.set_lora(
        2,
        *layer.gather_adapter(
            {f"{m}.down_proj": _expert_lora(E, INTER, H, 2, 4)}, [None, f"{m}.down_proj"], str
        )[:2],
    )
    layer.reset_lora(2)
    assert layer.adapter_enabled == [True, True, False]
    g = torch.Generator().manual_seed(9)
    T = 17
    x, logits = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    slots = [(-1, 0, 1, 2)[t % 4] for t in range(T)]
    with forward_context(lora=LoRAMapping.build(slots, slots, torch.device("cpu"))):
        got = layer(x, logits)
    want = _reference(layer, w13, w2, loras, slots, x, logits)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    base_only = layer.base_layer(x, logits)
    # NOTE: 1e-5, not bit-equal: a batch of other rows changes the matmul's blocking (seen: 2.4e-6 on
    # an AMD EPYC host, within 1e-6 on Intel); a leaked delta is > 1e-2 (the last assert)
    torch.testing.assert_close(got[0::4], base_only[0::4], rtol=0, atol=1e-5)  # base tokens
    torch.testing.assert_close(got[3::4], base_only[3::4], rtol=0, atol=1e-5)  # the reset slot
    assert (got[1::4] - base_only[1::4]).abs().max() > 1e-2


def test_per_expert_2d_and_3d_layouts_give_the_same_layer():
    """gate_proj/up_proj/down_proj per expert (each with its own A) == the 3-D layout when A is shared."""
    layer2d, w13, w2 = _layer()
    layer3d, _, _ = _layer(w13=w13, w2=w2)
    gu, down = _expert_lora(E, H, 2 * INTER, 3, 5), _expert_lora(E, INTER, H, 4, 6)
    m = "model.layers.0.block_sparse_moe.experts"  # Mixtral's transformers-4 names, our path is mlp.experts
    mods = {}
    for e in range(E):
        for nm, a, b in (
            ("w1", gu.lora_a[e], gu.lora_b[e, :INTER]),
            ("w3", gu.lora_a[e], gu.lora_b[e, INTER:]),
            ("w2", down.lora_a[e], down.lora_b[e]),
        ):
            mods[f"{m}.{e}.{nm}"] = LoRAModuleWeights(f"{m}.{e}.{nm}", a, b, a.shape[0], 1.0)
    pieces = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    a, b, used = layer2d.gather_adapter(mods, pieces, str)
    assert sorted(used) == sorted(mods)
    layer2d.set_lora(0, a, b)
    layer3d.set_lora(0, *layer3d.gather_adapter(dict(zip(pieces, (gu, down))), pieces, str)[:2])
    g = torch.Generator().manual_seed(10)
    x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)
    with forward_context(lora=LoRAMapping.build([0] * 9, [0] * 9, torch.device("cpu"))):
        torch.testing.assert_close(layer2d(x, logits), layer3d(x, logits), rtol=0, atol=1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
def test_tensor_parallel_lora_shards_sum_to_the_whole(interleaved):
    """w13 LoRA B sliced by output (gate and up each), w2 LoRA A by input: two ranks' partials == the whole."""
    gu, down = _expert_lora(E, H, 2 * INTER, 3, 7), _expert_lora(E, INTER, H, 4, 8)
    m = "model.layers.0.mlp.experts"
    pieces = [f"{m}.gate_up_proj", f"{m}.down_proj"]
    g = torch.Generator().manual_seed(11)
    x, logits = torch.randn(13, H, generator=g), torch.randn(13, E, generator=g)
    slots = [0, -1, 0, 0, -1, 0, 0, 0, -1, 0, 0, 0, 0]
    mapping = LoRAMapping.build(slots, slots, torch.device("cpu"))

    def run(w13=None, w2=None):
        layer, w13, w2 = _layer(interleaved=interleaved, w13=w13, w2=w2)
        layer.set_lora(0, *layer.gather_adapter(dict(zip(pieces, (gu, down))), pieces, str)[:2])
        with forward_context(lora=mapping):
            return layer(x, logits), w13, w2

    whole, w13, w2 = run()
    parts = []
    try:
        for rank in range(2):
            parallel_state.set_tp_state(rank, 2)
            parts.append(run(w13, w2)[0])
    finally:
        parallel_state.reset()
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=0, atol=1e-5)
