"""The server at TP=2 (gloo, 2 ranks on the CPU): same greedy answers as the TP=1 offline API,
with adapters by name, in both LoRA sharding modes."""

from __future__ import annotations

import pytest
from helpers import make_peft_adapter, make_tiny_model

from loraserve import LLM, LoRARequest, SamplingParams

PROMPTS = ["t5 t9 t33 t2", "t100 t101 t7"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_server")
    model = root / "model"
    make_tiny_model(model, "llama", tied=True, num_key_value_heads=1)
    a = make_peft_adapter(model, root / "a", seed=1, r=8, lora_alpha=16, target_modules="all-linear")
    return model, a


@pytest.mark.parametrize("fully_sharded", [False, True])
def test_server_at_tp2_equals_tp1(tiny, fully_sharded):
    import openai
    from server.conftest import ServerThread

    from loraserve.server.app import ServerConfig, build_app

    model, a = tiny
    ref = LLM(str(model), enable_lora=True, max_lora_rank=8, max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {
        lora: [o.outputs[0].text for o in ref.generate(PROMPTS, sp, lora_request=LoRARequest("a", 1, str(a)) if lora else None)]
        for lora in (False, True)
    }
    tp = LLM(str(model), enable_lora=True, max_lora_rank=8, max_model_len=64, tensor_parallel_size=2,
             fully_sharded_loras=fully_sharded)
    try:
        app = build_app(tp.engine, ServerConfig(lora_modules=[("a", str(a))]))
        with ServerThread(app) as s:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
            for lora in (False, True):
                name = "a" if lora else tp.engine.model_name
                got = [
                    client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True}).choices[0].text
                    for p in PROMPTS
                ]
                assert got == want[lora]
    finally:
        tp.shutdown()
