"""Loading: sharded safetensors, dtypes, clear errors for missing models."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_model

from loraserve import LLM, SamplingParams
from loraserve.config import ConfigError
from loraserve.models.loader import ModelNotFoundError

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    single = root / "single"
    hf = make_tiny_model(single, "qwen2", tied=True)
    sharded = root / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    for f in single.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith("_map.json"):
            (sharded / f.name).write_bytes(f.read_bytes())
    return single, sharded, hf


def test_sharded_checkpoint_loads_the_same(dirs):
    single, sharded, _ = dirs
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    a = LLM(str(single)).generate([{"prompt_token_ids": PROMPT}], SP)[0]
    b = LLM(str(sharded)).generate([{"prompt_token_ids": PROMPT}], SP)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert [d[t].logprob for d, t in zip(a.prompt_logprobs[1:], PROMPT[1:])] == [
        d[t].logprob for d, t in zip(b.prompt_logprobs[1:], PROMPT[1:])
    ]


def test_bfloat16_matches_transformers_in_bfloat16(dirs):
    single, _, _ = dirs
    llm = LLM(str(single), dtype="bfloat16")
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
    out = llm.generate([{"prompt_token_ids": PROMPT}], SP)[0]
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(single), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0].float(), -1)
    ours = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], PROMPT[1:])]
    theirs = [lp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]
    assert max(abs(x - y) for x, y in zip(ours, theirs)) < 2e-2


def test_dtype_choices(dirs):
    single, _, _ = dirs
    assert next(LLM(str(single), dtype="float16").engine.model.parameters()).dtype == torch.float16
    assert next(LLM(str(single), dtype="auto").engine.model.parameters()).dtype == torch.float32
    with pytest.raises(ConfigError, match="unknown dtype"):
        LLM(str(single), dtype="float8")
    with pytest.raises(ConfigError, match="lora_dtype.*unknown dtype 'bf17'"):  # the adapters' dtype, before any load
        LLM(str(single), enable_lora=True, lora_dtype="bf17")


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="never downloads"):
        LLM("some-org/some-model-that-is-not-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"))
