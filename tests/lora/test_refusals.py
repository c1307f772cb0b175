"""Unsupported PEFT features and malformed adapters raise a LoRAError naming the file, module and fix;
nothing is registered and the engine keeps serving the same answers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_model
from safetensors.torch import load_file, save_file

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.errors import (
    LoRAAdapterNotFoundError,
    LoRAError,
    LoRAFormatError,
    LoRARankError,
    LoRAShapeError,
    LoRAUnknownModuleError,
    LoRAUnsupportedFeatureError,
)

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    base = root / "base"
    make_tiny_model(base, "llama")
    good = make_peft_adapter(base, root / "good", seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16)
    return root, base, good, llm


def _variant(root, good, name, config_update=None, tensors_update=None, drop=()):
    d = root / name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(good, d)
    if config_update is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(config_update)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors_update is not None or drop:
        sd = load_file(str(d / "adapter_model.safetensors"))
        for k in drop:
            sd.pop(k)
        sd.update(tensors_update or {})
        save_file(sd, str(d / "adapter_model.safetensors"))
    return d


UNSUPPORTED = {
    # expert parameters are served (tests/moe); raw parameters of other layers are not
    "target_parameters": ({"target_parameters": ["self_attn.q_proj.weight"]}, "target_parameters"),
    "pissa": ({"init_lora_weights": "pissa"}, "pissa"),
    "olora": ({"init_lora_weights": "olora"}, "olora"),
    "loftq": ({"init_lora_weights": "loftq"}, "loftq"),
    "corda": ({"init_lora_weights": "corda"}, "corda"),
    "layer_replication": ({"layer_replication": [[0, 2], [1, 2]]}, "layer_replication"),
    "alora": ({"alora_invocation_tokens": [5, 6]}, "aLoRA"),
}


def _assert_refused_and_serving(llm, req, exc_type, *needles):
    before = llm.generate([PROMPT], SP)[0].outputs[0].token_ids
    with pytest.raises(exc_type) as info:
        llm.generate([PROMPT], SP, lora_request=req)
    msg = str(info.value)
    assert isinstance(info.value, LoRAError)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert req.lora_int_id not in llm.list_loras()
    assert llm.generate([PROMPT], SP)[0].outputs[0].token_ids == before
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    return msg


@pytest.mark.parametrize("feature", list(UNSUPPORTED))
def test_unsupported_feature_is_refused_by_name(feature, setup):
    root, _, good, llm = setup
    update, needle = UNSUPPORTED[feature]
    d = _variant(root, good, feature, config_update=update)
    req = LoRARequest(feature, 500 + list(UNSUPPORTED).index(feature), str(d))
    _assert_refused_and_serving(llm, req, LoRAUnsupportedFeatureError, needle, str(d))


def test_dora_config_without_magnitudes_is_malformed(setup):
    root, _, good, llm = setup
    d = _variant(root, good, "dora_no_m", config_update={"use_dora": True})
    _assert_refused_and_serving(llm, LoRARequest("dnm", 600, str(d)), LoRAFormatError, "lora_magnitude_vector", "q_proj")


def test_lora_bias_of_wrong_shape(setup):
    root, _, good, llm = setup
    key = next(k for k in load_file(str(good / "adapter_model.safetensors")) if k.endswith("q_proj.lora_B.weight"))
    d = _variant(root, good, "bias_key", tensors_update={key.replace(".weight", ".bias"): torch.ones(3)})
    _assert_refused_and_serving(llm, LoRARequest("bk", 601, str(d)), LoRAShapeError, "lora_B.bias", "q_proj")


def test_missing_dir(setup):
    root, *_ = setup
    llm = setup[3]
    _assert_refused_and_serving(llm, LoRARequest("nope", 700, str(root / "does-not-exist")), LoRAAdapterNotFoundError, "does-not-exist")


def test_missing_config_and_weights(setup):
    root, _, good, llm = setup
    d = _variant(root, good, "no_config")
    (d / "adapter_config.json").unlink()
    _assert_refused_and_serving(llm, LoRARequest("nc", 701, str(d)), LoRAFormatError, "adapter_config.json")
    d = _variant(root, good, "no_weights")
    (d / "adapter_model.safetensors").unlink()
    _assert_refused_and_serving(llm, LoRARequest("nw", 702, str(d)), LoRAFormatError, "adapter_model.safetensors")


def test_bad_json(setup):
    root, _, good, llm = setup
    d = _variant(root, good, "bad_json")
    (d / "adapter_config.json").write_text("{not json")
    _assert_refused_and_serving(llm, LoRARequest("bj", 703, str(d)), LoRAFormatError, "invalid JSON", "adapter_config.json")


def test_rank_above_max_lora_rank(setup):
    root, base, _, llm = setup
    d = make_peft_adapter(base, root / "rank32", seed=4, r=32, lora_alpha=32, target_modules=["q_proj"])
    msg = _assert_refused_and_serving(llm, LoRARequest("r32", 704, str(d)), LoRARankError, "max_lora_rank 16", "--max-lora-rank 32")
    assert "rank32" in msg


def test_rank_disagrees_with_config(setup):
    root, _, good, llm = setup
    d = _variant(root, good, "wrong_r", config_update={"r": 4})
    _assert_refused_and_serving(llm, LoRARequest("wr", 705, str(d)), LoRARankError, "r=4", "q_proj")


def test_shape_that_does_not_fit(setup):
    root, _, good, llm = setup
    sd = load_file(str(good / "adapter_model.safetensors"))
    key = next(k for k in sd if "q_proj.lora_A" in k)
    d = _variant(root, good, "bad_shape", tensors_update={key: torch.randn(8, 99)})
    _assert_refused_and_serving(llm, LoRARequest("bs", 706, str(d)), LoRAShapeError, "q_proj", "another base model")


def test_key_naming_a_missing_module(setup):
    root, _, good, llm = setup
    sd = load_file(str(good / "adapter_model.safetensors"))
    a = next(k for k in sd if "layers.0.self_attn.q_proj.lora_A" in k)
    b = a.replace("lora_A", "lora_B")
    extra = {a.replace("layers.0", "layers.7"): sd[a].clone(), b.replace("layers.0", "layers.7"): sd[b].clone()}
    d = _variant(root, good, "unknown_module", tensors_update=extra)
    _assert_refused_and_serving(llm, LoRARequest("um", 707, str(d)), LoRAUnknownModuleError, "model.layers.7.self_attn.q_proj")


def test_incomplete_pair(setup):
    root, _, good, llm = setup
    sd = load_file(str(good / "adapter_model.safetensors"))
    b = next(k for k in sd if "lora_B" in k)
    d = _variant(root, good, "incomplete", drop=[b])
    _assert_refused_and_serving(llm, LoRARequest("inc", 708, str(d)), LoRAFormatError, "lora_B")


def test_good_adapter_still_serves_after_refusals(setup):
    _, _, good, llm = setup
    base_out = llm.generate([PROMPT], SP)[0].outputs[0].token_ids
    out = llm.generate([PROMPT], SP, lora_request=LoRARequest("good", 1, str(good)))[0].outputs[0].token_ids
    assert len(out) == 6 and all(0 <= t < 256 for t in out)
    assert 1 in llm.list_loras()
    assert llm.generate([PROMPT], SP)[0].outputs[0].token_ids == base_out
