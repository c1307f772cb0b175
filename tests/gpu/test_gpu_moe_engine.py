"""MoE models with expert LoRA on the GPU (Triton grouped GEMM + expert LoRA kernels) against HF + PEFT.

Tiny random Qwen3-MoE and Mixtral, adapters on experts only and on attention + experts (PEFT
``target_parameters``), served in one batch with the base model: eager fp32 logprobs equal PEFT's with
each adapter alone (PEFT refuses mixed batches with target_parameters); CUDA graphs give the same tokens
and logprobs as eager. Runs only where CUDA is present (the device machine); CI has no GPU.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from helpers import engine_logprobs, hf_logprobs, make_peft_adapter  # noqa: E402
from moe.moe_fixtures import make_moe_model  # noqa: E402

from loraserve import LLM, LoRARequest, SamplingParams  # noqa: E402

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "experts": dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS),
    "attn_experts": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS,
                         use_rslora=True),
}  # fmt: skip
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 3, 17, 250, 9, 9, 60, 61, 62], [40, 41], [7] * 12]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def setup(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"gpu_moe_{arch}")
    make_moe_model(root / "base", arch, seed=3)
    dirs = {n: make_peft_adapter(root / "base", root / n, seed=20 + i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    names = [None, *ADAPTERS]
    per_prompt = [names[i % len(names)] for i in range(len(PROMPTS))]
    return root / "base", dirs, per_prompt


def serve(setup, graphs: bool):
    base, dirs, per_prompt = setup
    llm = LLM(str(base), dtype="float32", device="cuda", enable_lora=True, max_loras=4, max_lora_rank=8,
              max_model_len=64, enforce_eager=True)  # fmt: skip
    if graphs:
        llm.engine.runner.enable_cuda_graphs(8, 64)
    ids = {n: i + 1 for i, n in enumerate(dirs)}
    reqs = [None if n is None else LoRARequest(n, ids[n], str(dirs[n])) for n in per_prompt]
    return llm, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, lora_request=reqs)


def test_eager_fp32_matches_peft_per_adapter(setup):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, dirs, per_prompt = setup
    _, outs = serve(setup, graphs=False)
    for prompt, name, out in zip(PROMPTS, per_prompt, outs):
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, str(dirs[name]))
        model = model.eval()
        ids = prompt + out.outputs[0].token_ids
        ref = hf_logprobs(model, ids, None)
        ours = [x for part in engine_logprobs(out, prompt) for x in part]
        theirs = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-3, name


def test_cuda_graphs_equal_eager(setup):
    _, eager = serve(setup, graphs=False)
    llm, graphed = serve(setup, graphs=True)
    stats = llm.engine.runner.graphs.stats
    assert stats["replays"] >= SP.max_tokens - 1, stats
    for prompt, a, b in zip(PROMPTS, eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = engine_logprobs(a, prompt), engine_logprobs(b, prompt)
        assert max(abs(x - y) for x, y in zip(la[1], lb[1])) < 1e-4
