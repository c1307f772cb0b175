"""The PEFT features other engines refuse, served as PEFT computes them (fp32, CPU):
DoRA (linear and embedding), lora_bias, bias="all"/"lora_only", modules_to_save, differing embedding
copies, trainable tokens (tied and untied). Each alone vs PeftModel, and all in one mixed batch with
plain adapters and the base (PEFT refuses such mixes, so each request is compared with PEFT alone)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_model, max_logprob_diff, peft_model
from safetensors.torch import load_file, save_file

from loraserve import LLM, LoRARequest, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 3, 5], [100, 3, 17, 250, 9, 7, 60, 61, 62]]
SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
ATOL = 1e-4


def _perturb(path, match, scale=0.3, seed=0):
    """Change saved tensors as training would (the oracle, PEFT, loads them over the base)."""
    st = path / "adapter_model.safetensors"
    sd = load_file(str(st))
    g = torch.Generator().manual_seed(seed)
    hits = [k for k in sd if match(k)]
    assert hits, f"no key matched in {path}"
    for k in hits:
        sd[k] = sd[k] + scale * torch.randn(sd[k].shape, generator=g)
    save_file(sd, str(st))


# name -> (arch, tied, LoraConfig kwargs, post-processing of the saved file)
CASES = {
    "dora_linear": ("llama", False, dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]), "magnitude"),
    "dora_embedding": ("qwen2", True, dict(r=4, lora_alpha=8, use_dora=True, target_modules=["embed_tokens", "k_proj"]), "magnitude"),
    "dora_lm_head_untied": ("llama", False, dict(r=4, lora_alpha=8, use_dora=True, target_modules=["lm_head", "up_proj"]), "magnitude"),
    "lora_bias": ("qwen2", True, dict(r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "o_proj", "gate_proj"]),
                  lambda p: _perturb(p, lambda k: k.endswith("lora_B.bias"))),
    "bias_all": ("qwen2", True, dict(r=4, lora_alpha=8, bias="all", target_modules=["q_proj"]),
                 lambda p: _perturb(p, lambda k: k.endswith(".bias"))),
    "bias_lora_only": ("qwen2", True, dict(r=4, lora_alpha=8, bias="lora_only", target_modules=["q_proj", "v_proj"]),
                       lambda p: _perturb(p, lambda k: k.endswith(".bias"))),
    "modules_to_save_lm_head_tied": ("qwen2", True, dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
                                     lambda p: _perturb(p, lambda k: k.endswith("lm_head.weight"), 0.1)),
    "modules_to_save_embed_untied": ("llama", False, dict(r=4, lora_alpha=8, target_modules=["v_proj"], modules_to_save=["embed_tokens"]),
                                     lambda p: _perturb(p, lambda k: k.endswith("embed_tokens.weight"), 0.1)),
    "changed_embedding_copy_tied": ("qwen2", True, dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
                                    lambda p: _perturb(p, lambda k: k.endswith("embed_tokens.base_layer.weight"), 0.1)),
    "changed_embedding_copy_untied": ("llama", False, dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "lm_head"]),
                                      lambda p: _perturb(p, lambda k: k.endswith("base_layer.weight"), 0.1)),
    "trainable_tokens_tied": ("qwen2", True, dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[5, 9, 40, 100]),
                              lambda p: _perturb(p, lambda k: "trainable_tokens_delta" in k, 0.5)),
    "trainable_tokens_untied": ("llama", False, dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[5, 9, 40, 100]),
                                lambda p: _perturb(p, lambda k: "trainable_tokens_delta" in k, 0.5)),
}
PLAIN = {"llama": dict(r=8, lora_alpha=16, target_modules="all-linear"), "qwen2": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("features")
    bases = {}
    for arch, tied in {(a, t) for a, t, _, _ in CASES.values()}:
        d = root / f"{arch}-{tied}"
        make_tiny_model(d, arch, tied=tied)
        bases[(arch, tied)] = d
    adapters = {}
    for i, (name, (arch, tied, kw, post)) in enumerate(CASES.items()):
        p = make_peft_adapter(bases[(arch, tied)], root / name, seed=200 + i, **kw)
        if post == "magnitude":  # at init m = ||W + sBA||, so DoRA == LoRA; trained magnitudes differ
            _perturb(p, lambda k: "lora_magnitude_vector" in k, 0.3)
        elif post:
            post(p)
        adapters[name] = p
    for (arch, tied), d in bases.items():
        adapters[f"plain-{arch}-{tied}"] = make_peft_adapter(d, root / f"plain-{arch}-{tied}", seed=7, **PLAIN[arch])
    engines = {k: LLM(str(d), enable_lora=True, max_loras=4, max_lora_rank=8, max_model_len=128) for k, d in bases.items()}
    return bases, adapters, engines


def _req(name):
    return LoRARequest(name, 1 + sorted(list(CASES) + [f"plain-{a}-{t}" for a in ("llama", "qwen2") for t in (False, True)]).index(name), "")


@pytest.mark.parametrize("case", list(CASES))
def test_feature_matches_peft(case, world):
    bases, adapters, engines = world
    arch, tied, _, _ = CASES[case]
    llm = engines[(arch, tied)]
    req = LoRARequest(case, _req(case).lora_int_id, str(adapters[case]))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, lora_request=req)
    ref = peft_model(bases[(arch, tied)], {case: adapters[case]})
    base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP)
    for p, o in zip(PROMPTS, outs):
        assert max_logprob_diff(ref, o, p) < ATOL
        want = ref.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None)[0, len(p):]
        assert o.outputs[0].token_ids == want.tolist()
    changed = max(
        abs(o.prompt_logprobs[i][p[i]].logprob - b.prompt_logprobs[i][p[i]].logprob)
        for p, o, b in zip(PROMPTS, outs, base) for i in range(1, len(p))
    )
    assert changed > 1e-3, f"{case} did not change the output"


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_features_in_one_mixed_batch(arch, tied, world):
    """All feature adapters of a base + a plain adapter + the base model in one generate call."""
    bases, adapters, engines = world
    llm = engines[(arch, tied)]
    names = [n for n, (a, t, _, _) in CASES.items() if (a, t) == (arch, tied)] + [f"plain-{arch}-{tied}"]
    reqs = [LoRARequest(n, _req(n).lora_int_id, str(adapters[n])) for n in names] + [None]
    prompts, loras = [], []
    for i in range(2 * len(reqs)):
        prompts.append({"prompt_token_ids": PROMPTS[i % 3]})
        loras.append(reqs[i % len(reqs)])
    mixed = llm.generate(prompts, SP, lora_request=loras)
    refs = {}
    for p, lr, o in zip(prompts, loras, mixed):
        name = lr.lora_name if lr else None
        if name not in refs:
            refs[name] = peft_model(bases[(arch, tied)], {name: adapters[name]}) if name else peft_model(bases[(arch, tied)], {names[-1]: adapters[names[-1]]})
        ref = refs[name]
        if name is None:
            with ref.disable_adapter():
                assert max_logprob_diff(ref, o, p["prompt_token_ids"]) < ATOL
        else:
            assert max_logprob_diff(ref, o, p["prompt_token_ids"]) < ATOL
        alone = llm.generate([p], SP, lora_request=lr)[0]
        assert alone.outputs[0].token_ids == o.outputs[0].token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_manager_flags_slots_with_extras(case, world):
    """Every feature adapter's slot is flagged (CUDA graphs then run its steps eagerly); plain ones are not."""
    bases, adapters, engines = world
    arch, tied, _, _ = CASES[case]
    llm = engines[(arch, tied)]
    plain = f"plain-{arch}-{tied}"
    reqs = [LoRARequest(n, _req(n).lora_int_id, str(adapters[n])) for n in (case, plain)]
    llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, SP, lora_request=reqs)
    lm = llm.engine.lora_manager
    feature_slot, plain_slot = (lm.slot_of(r.lora_int_id) for r in reqs)
    assert lm.slots_have_extras([feature_slot, -1])
    assert not lm.slots_have_extras([plain_slot, -1, -1])
