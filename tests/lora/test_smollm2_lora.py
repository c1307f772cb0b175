"""The real default model (SmolLM2-135M-Instruct GGUF, tied embeddings) with an adapter made here
with PEFT: loraserve equals transformers + PEFT on the same GGUF."""

from __future__ import annotations

import pytest
import torch

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.models.loader import default_gguf_path

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    load = lambda: AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)  # noqa: E731
    base = load()
    torch.manual_seed(0)
    cfg = LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False, task_type="CAUSAL_LM",
        target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],  # lm_head is tied to embed_tokens here
    )
    path = tmp_path_factory.mktemp("smol") / "adapter"
    model = get_peft_model(base, cfg)
    with torch.no_grad():  # random init is large for 30 layers: keep the adapter's effect moderate
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    model.save_pretrained(str(path))
    ref = PeftModel.from_pretrained(load(), str(path)).eval()
    llm = LLM(dtype="float32", enable_lora=True, max_lora_rank=8)
    return llm, ref, path


def test_smollm2_adapter_matches_peft(world):
    llm, ref, path = world
    req = LoRARequest("smol-test", 1, str(path))
    chats = [[{"role": "user", "content": q}] for q in ("What is the capital of France?", "Name a colour.")]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    outs = llm.chat(chats, sp, lora_request=req)
    base = llm.chat(chats, sp)
    assert llm.engine.model.lm_head.weight.data_ptr() == llm.engine.model.model.embed_tokens.base_layer.weight.data_ptr()
    for o, b in zip(outs, base):
        prompt, gen = o.prompt_token_ids, o.outputs[0].token_ids
        ids = prompt + gen
        with torch.no_grad():
            lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
            want = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)[0, len(prompt):]
        ours = [o.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        ours += [d[t].logprob for d, t in zip(o.outputs[0].logprobs, gen)]
        theirs = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert max(abs(x - y) for x, y in zip(ours, theirs)) < 1e-4
        assert gen == want.tolist()
        base_lp = [b.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        assert max(abs(x - y) for x, y in zip(ours, base_lp)) > 1e-2  # the adapter matters
