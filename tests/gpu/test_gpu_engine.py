"""The engine on the GPU (Triton LoRA + attention kernels, CUDA graphs) against HF + PEFT.

A tiny random Llama with six PEFT adapters of different ranks and targets (embeddings and lm_head
included), served in one mixed batch with base-model requests:

- eager, fp32: prompt and decode logprobs equal HF + PEFT's (1e-3);
- CUDA graphs, fp32: the same tokens and logprobs as eager (enforce_eager=True) (1e-4), with every
  adapter in the batch;
- CUDA graphs, bf16: logprobs within 2e-2 of HF + PEFT in bf16.

Runs only where CUDA is present (the device machine); CI has no GPU.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from helpers import engine_logprobs, make_peft_adapter, make_tiny_model  # noqa: E402

from loraserve import LLM, LoRARequest, SamplingParams  # noqa: E402

ADAPTERS = {
    "all16": dict(r=16, lora_alpha=32, target_modules="all-linear"),
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "emb_head8": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "o_proj"]),
    "mlp16": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "ko2": dict(r=2, lora_alpha=4, target_modules=["k_proj", "o_proj"]),
    "pattern8": dict(r=8, lora_alpha=8, target_modules="all-linear", rank_pattern={"down_proj": 3}),
}
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1, prompt_logprobs=1)


def make_models(root, num_attention_heads: int):
    """A tiny Llama (hidden 128; k and v of 2 * 128 / heads columns each), ADAPTERS on it, and the prompts."""
    base = root / "base"
    make_tiny_model(
        base, "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=num_attention_heads, num_key_value_heads=2,
    )  # fmt: skip
    dirs = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        dirs[name] = make_peft_adapter(base, root / name, seed=10 + i, **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(2, 256, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 40, (14,), generator=g)
    ]
    names = [None, *ADAPTERS]
    per_prompt = [names[i % len(names)] for i in range(len(prompts))]
    return base, dirs, prompts, per_prompt


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("gpu_engine"), num_attention_heads=8)


@pytest.fixture(scope="module")
def models_kv64(tmp_path_factory):
    """k and v of 64 columns: the decode GEMM's column block (32 it refuses: its qkv then runs unfused)."""
    return make_models(tmp_path_factory.mktemp("gpu_engine_kv64"), num_attention_heads=4)


def serve(models, dtype: str, graphs: bool):
    base, dirs, prompts, per_prompt = models
    llm = LLM(
        str(base), dtype=dtype, device="cuda", enable_lora=True, max_loras=8, max_lora_rank=16,
        num_kv_blocks=128, max_num_seqs=16, enforce_eager=not graphs,
    )  # fmt: skip
    if graphs:  # the explicit API, as the default would (max_num_seqs, max_model_len)
        llm.engine.runner.enable_cuda_graphs(16, llm.engine.max_model_len)
    ids = {name: i + 1 for i, name in enumerate(dirs)}
    reqs = [None if n is None else LoRARequest(n, ids[n], str(dirs[n])) for n in per_prompt]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SP, lora_request=reqs)
    return llm, outs


def hf_peft(base, dirs, dtype: torch.dtype):
    """HF base in ``dtype`` on the GPU + the adapters, which PEFT upcasts to fp32 (autocast_adapter_dtype)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=dtype).to("cuda")
    names = list(dirs)
    model = PeftModel.from_pretrained(model, str(dirs[names[0]]), adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(str(dirs[n]), adapter_name=n)
    return model.eval()


def hf_diffs(models, outs, dtype: torch.dtype) -> list[float]:
    base, dirs, prompts, per_prompt = models
    model = hf_peft(base, dirs, dtype)
    diffs = []
    for prompt, name, out in zip(prompts, per_prompt, outs):
        ids = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids], device="cuda"), adapter_names=[name or "__base__"]).logits[0]
        ref = torch.log_softmax(logits.float(), dim=-1)
        ours = [x for part in engine_logprobs(out, prompt) for x in part]
        theirs = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
        diffs.append(max(abs(a - b) for a, b in zip(ours, theirs)))
    return diffs


def test_eager_fp32_matches_peft(models):
    _, outs = serve(models, "float32", graphs=False)
    diffs = hf_diffs(models, outs, torch.float32)
    assert max(diffs) < 1e-3, diffs


def test_cuda_graphs_equal_eager_with_many_adapters(models):
    _, eager = serve(models, "float32", graphs=False)
    llm, graphed = serve(models, "float32", graphs=True)
    stats = llm.engine.runner.graphs.stats
    assert stats["replays"] >= SP.max_tokens - 1 and stats["captures"] >= 1, stats
    _, prompts, per_prompt = models[1:]
    for prompt, a, b in zip(prompts, eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = engine_logprobs(a, prompt), engine_logprobs(b, prompt)
        assert max(abs(x - y) for x, y in zip(la[1], lb[1])) < 1e-4


def test_cuda_graphs_bf16_matches_peft(models):
    _, outs = serve(models, "bfloat16", graphs=True)
    diffs = hf_diffs(models, outs, torch.bfloat16)
    assert max(diffs) <= 2e-2, diffs


@pytest.mark.parametrize("in_k", [False, True], ids=["gate-up-gated", "gate-up-in-k"])
def test_norm_shrink_under_graphs_matches_peft(models_kv64, monkeypatch, in_k):
    """The decoder's norms compute the shrink of qkv and gate/up (``norm_shrink``, from the row before its
    normalization: the fold's own numbers are test_norm_shrink's unit test), with gate/up's delta as more K of its
    GEMM (the default where it fits) or in the gated SiLU-and-mul (``delta_in_k.MAX_SLOT_COLUMNS`` 0: what more slot
    columns than measured take): the fused norm runs for qkv and gate/up under CUDA graphs with every adapter in the
    batch, and bf16 logprobs are within 2e-2 of HF + PEFT's."""
    from loraserve.lora.ops import delta_in_k
    from loraserve.lora.ops.triton import norm_shrink as ns

    if not in_k:
        monkeypatch.setattr(delta_in_k, "MAX_SLOT_COLUMNS", 0)
    calls = []
    real = ns.norm_shrink
    monkeypatch.setattr(ns, "norm_shrink", lambda *a, **k: calls.append((len(a[4]), k.get("in_k", False))) or real(*a, **k))
    _, outs = serve(models_kv64, "bfloat16", graphs=True)
    assert (3, False) in calls and (2, in_k) in calls, f"gate/up (2 slices) and qkv (3) took the fused norm: {calls}"
    diffs = hf_diffs(models_kv64, outs, torch.bfloat16)
    assert max(diffs) <= 2e-2, diffs


def test_delta_in_k_under_graphs_matches_peft(models_kv64, monkeypatch):
    """gate/up's delta as more K of its GEMM (``delta_in_k``): the wider W built when the wrappers are (the base
    weight its view), the norm's wider output taken by the GEMM under CUDA graphs with every adapter in the batch,
    and bf16 logprobs within 2e-2 of HF + PEFT's."""
    from loraserve.layers import triton_decode_linear as dl

    widths = []
    real = dl.decode_linear

    def counting(x, w, *a, **k):
        if k.get("in_k") is not None:
            widths.append((x.shape[1], w.shape[1]))
        return real(x, w, *a, **k)

    monkeypatch.setattr(dl, "decode_linear", counting)
    llm, outs = serve(models_kv64, "bfloat16", graphs=True)
    mlps = [layer.mlp.gate_up_proj for layer in llm.engine.model.model.layers]
    assert all(m.w_in_k is not None and m.base_layer.weight.data_ptr() == m.w_in_k.data_ptr() for m in mlps)
    # K 128; 8 slots of rank 16: W 128 more columns, x one set a slice
    assert (128 + 2 * 8 * 16, 128 + 8 * 16) in widths, f"the wider x and W were not taken: {widths}"
    diffs = hf_diffs(models_kv64, outs, torch.bfloat16)
    assert max(diffs) <= 2e-2, diffs


def _with_bf16_a(dirs: dict, root) -> dict:
    """Copies of these adapters with every lora_A rounded to a bf16 number (kept in its file's dtype)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = {}
    for name, d in dirs.items():
        new = root / name
        shutil.copytree(d, new)
        tensors = load_file(str(new / "adapter_model.safetensors"))
        tensors = {k: v.to(torch.bfloat16).to(v.dtype) if "lora_A" in k else v for k, v in tensors.items()}
        save_file(tensors, str(new / "adapter_model.safetensors"))
        out[name] = new
    return out


def test_a_exact_in_bf16_lets_the_shrink_gemm_read_one_piece(models_kv64, tmp_path, monkeypatch):
    """Adapters whose A are bf16 numbers, stored in fp16 for a bf16 model (the second bf16 piece of A is zeros): o's
    and down's GEMM computes their shrink from one piece (S*R more rows of W, not 2*S*R) under CUDA graphs, and
    logprobs stay within 2e-2 of HF + PEFT's. With one adapter whose A is not (the fixture's fp32 all16) in the batch,
    the step replays another graph, whose GEMMs would read both pieces, with the same bound: here they refuse them
    (2*S*R more rows than o's and down's 128 columns) and the shrink runs as its own launch."""
    from loraserve.layers import triton_decode_linear as dl

    base, dirs, prompts, per_prompt = models_kv64
    exact = _with_bf16_a(dirs, tmp_path)
    rows = []
    real = dl.decode_linear

    def counting(x, w, *a, **k):
        if k.get("shrink_into") is not None:
            rows.append(k["shrink_into"][0].shape[0])
        return real(x, w, *a, **k)

    monkeypatch.setattr(dl, "decode_linear", counting)
    S, R = 8, 16  # serve's max_loras and max_lora_rank
    for adapters, one_piece in ((exact, True), ({**exact, "all16": dirs["all16"]}, False)):
        rows.clear()
        models = (base, adapters, prompts, per_prompt)
        llm, outs = serve(models, "bfloat16", graphs=True)
        # every decode step has an all16 request (they end together): never one piece in the second run
        assert (S * R in rows) == one_piece and set(rows) <= {S * R}, f"A's pieces the GEMMs read: {sorted(set(rows))}"
        keys = list(llm.engine.runner.graphs.graphs)  # (bucket, LoRA, vocab deltas, A exact in W's dtype)
        assert any(k[1] and k[3] == one_piece for k in keys), keys
        diffs = hf_diffs(models, outs, torch.bfloat16)
        assert max(diffs) <= 2e-2, diffs
        del llm
