"""End-to-end parity with transformers + PEFT on tiny random models (fp32, CPU).

Each case builds a real PEFT adapter (random non-zero A and B), serves it through LLM.generate and
compares prompt and decode logprobs (1e-4) and greedy tokens with PeftModel.from_pretrained.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_model, max_logprob_diff, peft_model
from safetensors import safe_open

from loraserve import LLM, LoRARequest, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100, 3, 17, 250, 9, 9, 9, 60, 61, 62, 63]]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
ATOL = 1e-4

# name -> (arch, tied, LoraConfig kwargs, save as .bin)
CASES = {
    "qv_only": ("llama", False, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), False),
    "all_linear": ("llama", False, dict(r=4, lora_alpha=8, target_modules="all-linear"), False),
    "patterns": (
        "llama",
        False,
        dict(
            r=8,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
            rank_pattern={"k_proj": 2, "model.layers.1.self_attn.q_proj": 4},
            alpha_pattern={"v_proj": 32, "down_proj": 3},
        ),
        False,
    ),
    "rslora": ("qwen2", True, dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "gate_proj", "up_proj"]), False),
    "embed_and_lm_head_tied": ("qwen2", True, dict(r=4, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "v_proj"]), False),
    "lm_head_only_tied": ("qwen2", True, dict(r=8, lora_alpha=16, target_modules=["lm_head"]), False),
    "ensure_weight_tying": (
        "qwen2",
        True,
        dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head"], ensure_weight_tying=True),
        False,
    ),
    "layers_to_transform": ("qwen2", True, dict(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj", "up_proj"], layers_to_transform=[1]), False),
    "regex_targets": ("llama", False, dict(r=4, lora_alpha=4, target_modules=r".*layers\.0\..*(q_proj|gate_proj)"), False),
    "bin_file": ("llama", False, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]), True),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for arch, tied in {(a, t) for a, t, _, _ in CASES.values()}:
        d = root / f"{arch}-{'tied' if tied else 'untied'}"
        make_tiny_model(d, arch, tied=tied)
        out[(arch, tied)] = d
    return out


@pytest.fixture(scope="module")
def adapters(bases, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (arch, tied, kw, as_bin)) in enumerate(CASES.items()):
        out[name] = make_peft_adapter(bases[(arch, tied)], root / name, seed=100 + i, safe_serialization=not as_bin, **kw)
    return out


@pytest.fixture(scope="module")
def engines(bases):
    return {key: LLM(str(d), enable_lora=True, max_loras=3, max_lora_rank=16, max_model_len=128) for key, d in bases.items()}


def _prompts():
    return [{"prompt_token_ids": p} for p in PROMPTS]


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_matches_peft(case, bases, adapters, engines):
    arch, tied, _, as_bin = CASES[case]
    path = adapters[case]
    assert (path / ("adapter_model.bin" if as_bin else "adapter_model.safetensors")).exists()
    if case == "ensure_weight_tying":  # the file carries lm_head keys its target_modules does not list
        cfg = json.loads((path / "adapter_config.json").read_text())
        assert not any("lm_head" in t for t in cfg["target_modules"])
        assert any(k.startswith("base_model.model.lm_head.lora_A") for k in safe_open(str(path / "adapter_model.safetensors"), "pt").keys())
    llm = engines[(arch, tied)]
    req = LoRARequest(case, 1 + list(CASES).index(case), str(path))
    outs = llm.generate(_prompts(), SP, lora_request=req)
    ref = peft_model(bases[(arch, tied)], {case: path})
    for p, o in zip(PROMPTS, outs):
        assert max_logprob_diff(ref, o, p) < ATOL
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(p) :]
        assert o.outputs[0].token_ids == want.tolist()
    # the adapter really changes the output, and nothing is NaN
    base_outs = llm.generate(_prompts(), SP)
    for p, o, b in zip(PROMPTS, outs, base_outs):
        lp = [o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
        blp = [b.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]
        assert all(x == x for x in lp), "NaN logprob"
        assert max(abs(x - y) for x, y in zip(lp, blp)) > 1e-3, f"{case} did not change the output"


def test_tied_lm_head_shares_the_embedding_weight(engines):
    llm = engines[("qwen2", True)]
    model = llm.engine.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.base_layer.weight.data_ptr()


def test_mixed_batch_equals_alone_and_peft(bases, adapters, engines):
    """Several adapters and the base in one generate call == each alone == PEFT with adapter_names."""
    key = ("qwen2", True)
    names = ["rslora", "embed_and_lm_head_tied", "lm_head_only_tied", "layers_to_transform"]
    reqs = {n: LoRARequest(n, 1 + list(CASES).index(n), str(adapters[n])) for n in names}
    llm = engines[key]
    prompts, loras = [], []
    for i in range(10):  # 5 requests of 4 adapters + base, interleaved, more adapters than max_loras=3
        prompts.append({"prompt_token_ids": PROMPTS[i % 3]})
        loras.append(None if i % 5 == 4 else reqs[names[i % 4]])
    mixed = llm.generate(prompts, SP, lora_request=loras)
    ref = peft_model(bases[key], {n: adapters[n] for n in names})
    for p, lr, o in zip(prompts, loras, mixed):
        alone = llm.generate([p], SP, lora_request=lr)[0]
        assert o.outputs[0].token_ids == alone.outputs[0].token_ids
        a_pl = [x[t].logprob for x, t in zip(alone.prompt_logprobs[1:], p["prompt_token_ids"][1:])]
        m_pl = [x[t].logprob for x, t in zip(o.prompt_logprobs[1:], p["prompt_token_ids"][1:])]
        assert max(abs(a - b) for a, b in zip(a_pl, m_pl)) < 1e-5
        adapter_names = [lr.lora_name if lr else "__base__"]
        assert max_logprob_diff(ref, o, p["prompt_token_ids"], adapter_names) < ATOL


def test_unembed_tokens_is_lm_head(bases, adapters, engines, tmp_path):
    """Tinker exports name lm_head 'model.unembed_tokens': same adapter, renamed keys, same outputs."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = adapters["lm_head_only_tied"]
    dst = tmp_path / "unembed"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "adapter_model.safetensors"))
    renamed = {k.replace("base_model.model.lm_head.", "base_model.model.model.unembed_tokens."): v for k, v in sd.items()}
    assert any("unembed_tokens.lora_A" in k for k in renamed)
    save_file(renamed, str(dst / "adapter_model.safetensors"))
    llm = engines[("qwen2", True)]
    outs = llm.generate(_prompts(), SP, lora_request=LoRARequest("unembed", 99, str(dst)))
    ref = peft_model(bases[("qwen2", True)], {"lm_head_only_tied": src})
    for p, o in zip(PROMPTS, outs):
        assert max_logprob_diff(ref, o, p) < ATOL


def test_bf16_lora_weights_stay_close_to_peft(bases, adapters):
    """lora_dtype='bfloat16' (half the slot memory) serves the adapter within bf16 rounding of PEFT."""
    key = ("llama", False)
    llm = LLM(str(bases[key]), enable_lora=True, max_loras=2, max_lora_rank=16, lora_dtype="bfloat16")
    outs = llm.generate(_prompts(), SP, lora_request=LoRARequest("all_linear", 2, str(adapters["all_linear"])))
    ref = peft_model(bases[key], {"all_linear": adapters["all_linear"]})
    for p, o in zip(PROMPTS, outs):
        assert max_logprob_diff(ref, o, p) < 2e-2
