"""Tiny random models and tokenizers, built on the fly (no hub access)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VOCAB = 256


def make_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A word-level tokenizer over 't0'..'t{V-1}' (t1 = eos), with a ChatML-like chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="t1", unk_token="t0", pad_token="t0")
    tok.chat_template = "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}{% if add_generation_prompt %}t4{% endif %}"
    tok.save_pretrained(str(path))


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_tiny_model(path: Path, arch: str = "llama", tied: bool = False, seed: int = 0, **overrides):
    """Save a tiny random HF model (fp32) plus tokenizer at path; return the HF model (eval mode)."""
    import transformers

    cfg_name, model_name = ARCHS[arch]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        eos_token_id=1,
        bos_token_id=None,
        pad_token_id=0,
    )
    if arch == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    cfg = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    model.save_pretrained(str(path))
    make_tokenizer(path, cfg.vocab_size)
    return model


def hf_logprobs(model, token_ids: list[int], adapter_names: list[str] | None = None) -> torch.Tensor:
    """log-softmax of HF logits for one sequence: (len, V) fp32."""
    with torch.no_grad():
        kw = {"adapter_names": adapter_names} if adapter_names is not None else {}
        logits = model(torch.tensor([token_ids]), **kw).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int = 0, safe_serialization: bool = True, **lora_kwargs):
    """Train-free PEFT adapter with random (non-zero) A and B, saved like a user's adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    cfg = LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **lora_kwargs)
    model = get_peft_model(base, cfg)
    model.save_pretrained(str(out_dir), safe_serialization=safe_serialization)
    return out_dir


def peft_model(base_dir: Path, adapters: dict[str, Path]):
    """HF base + PEFT adapters loaded under their names (the reference for mixed batches)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    names = list(adapters)
    model = PeftModel.from_pretrained(base, str(adapters[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(str(adapters[n]), adapter_name=n)
    return model.eval()


def engine_logprobs(output, prompt: list[int]) -> tuple[list[float], list[float]]:
    """(prompt logprobs of tokens 1.., logprobs of each generated token) from one RequestOutput."""
    comp = output.outputs[0]
    pl = [output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    dl = [comp.logprobs[j][t].logprob for j, t in enumerate(comp.token_ids)]
    return pl, dl


def max_logprob_diff(model, output, prompt: list[int], adapter_names: list[str] | None = None) -> float:
    """Max |Δ| between the engine's prompt+decode logprobs and the HF model's on the same tokens."""
    ids = prompt + output.outputs[0].token_ids
    ref = hf_logprobs(model, ids, adapter_names)
    pl, dl = engine_logprobs(output, prompt)
    theirs = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    return max(abs(a - b) for a, b in zip(pl + dl, theirs))
