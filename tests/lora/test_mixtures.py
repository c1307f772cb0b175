"""Per-request adapter mixtures vs PEFT's add_weighted_adapter (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_model, max_logprob_diff, peft_model

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.request import LoRAMixture

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 3, 5, 77]]
SP = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1, prompt_logprobs=1)
TARGETS = ["q_proj", "v_proj", "down_proj", "embed_tokens"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    base = root / "base"
    make_tiny_model(base, "llama")
    a = make_peft_adapter(base, root / "a", seed=1, r=4, lora_alpha=8, target_modules=TARGETS)
    b = make_peft_adapter(base, root / "b", seed=2, r=4, lora_alpha=16, target_modules=["q_proj", "o_proj", "embed_tokens"])
    llm = LLM(str(base), enable_lora=True, max_loras=4, max_lora_rank=16)
    return base, a, b, llm


def _reference(base, a, b, weights, combination, density=1.0):
    ref = peft_model(base, {"a": a, "b": b})
    ref.add_weighted_adapter(["a", "b"], weights, "mix", combination_type=combination, density=density)
    ref.set_adapter("mix")
    return ref


@pytest.mark.parametrize("ours,peft_type,density", [("linear", "cat", 1.0), ("ties", "ties", 0.5), ("dare_linear", "linear", 1.0)])
def test_mixture_matches_peft(world, ours, peft_type, density):
    base, a, b, llm = world
    ra, rb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    mix = LoRAMixture(f"mix-{ours}", 10 + ["linear", "ties", "dare_linear"].index(ours), components=((ra, 0.7), (rb, -0.4)),
                      combination=ours, density=density)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, lora_request=mix)
    ref = _reference(base, a, b, [0.7, -0.4], peft_type, density)
    for p, o in zip(PROMPTS, outs):
        assert max_logprob_diff(ref, o, p) < 1e-4
        want = ref.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, eos_token_id=None)[0, len(p):]
        assert o.outputs[0].token_ids == want.tolist()


def test_mixture_differs_from_its_parts_and_mixes_in_a_batch(world):
    base, a, b, llm = world
    ra, rb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    mix = LoRAMixture("mix2", 20, components=((ra, 0.5), (rb, 0.5)))
    reqs = [ra, rb, mix, None]
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * 4
    mixed = llm.generate(prompts, SP, lora_request=reqs)
    lps = []
    for r, o in zip(reqs, mixed):
        alone = llm.generate(prompts[:1], SP, lora_request=r)[0]
        lp = [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], PROMPTS[0][1:])]
        alp = [d[t].logprob for d, t in zip(alone.prompt_logprobs[1:], PROMPTS[0][1:])]
        assert max(abs(x - y) for x, y in zip(lp, alp)) < 1e-5
        lps.append(lp)
    for i in range(3):
        for j in range(i + 1, 4):
            assert max(abs(x - y) for x, y in zip(lps[i], lps[j])) > 1e-3


def test_dare_is_seeded_and_drops(world):
    base, a, b, llm = world
    ra, rb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    runs = []
    for i, seed in enumerate((0, 0, 1)):
        mix = LoRAMixture(f"dare{i}", 30 + i, components=((ra, 0.7), (rb, 0.4)), combination="dare_linear", density=0.5, seed=seed)
        o = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SP, lora_request=mix)[0]
        runs.append([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], PROMPTS[0][1:])])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_mixture_rules(world):
    base, a, b, llm = world
    with pytest.raises(ValueError, match="2 to 4"):
        LoRAMixture("m", 40, components=((LoRARequest("a", 1, str(a)), 1.0),))
    big = make_peft_adapter(base, a.parent / "big", seed=3, r=8, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(Exception, match="equal ranks"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SP, lora_request=LoRAMixture(
            "m2", 41, components=((LoRARequest("a", 1, str(a)), 1.0), (LoRARequest("big", 3, str(big)), 1.0)), combination="ties"))
