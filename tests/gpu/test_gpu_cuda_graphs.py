"""CUDA graphs by default on the GPU: on unless enforce_eager; a capture that fails falls back to eager.

Runs only where CUDA is present (the device machine); CI has no GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from helpers import make_tiny_model  # noqa: E402

from loraserve import LLM, SamplingParams  # noqa: E402

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i]} for i in range(3)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs_default")
    make_tiny_model(path, "llama")
    return path


def make(model_dir, **kw):
    return LLM(str(model_dir), device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=64, **kw)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_default_llm_replays_graphs_and_enforce_eager_does_not(model_dir):
    llm = make(model_dir)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.max_batch == 8
    graphed = ids(llm.generate(PROMPTS, SP))
    assert graphs.stats["replays"] > 0 and graphs.stats["captures"] >= 1
    eager = make(model_dir, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert ids(eager.generate(PROMPTS, SP)) == graphed
    assert eager.engine.runner.graphs is None


def test_a_layer_that_syncs_to_the_host_falls_back_to_eager(model_dir, caplog):
    want = ids(make(model_dir, enforce_eager=True).generate(PROMPTS, SP))
    llm = make(model_dir)
    model = llm.engine.model
    real_forward = model.forward

    def syncing_forward(input_ids, positions):
        hidden = real_forward(input_ids, positions)
        if hidden.sum().item() == float("inf"):  # a host sync: illegal while a graph is captured
            raise AssertionError("unreachable")
        return hidden

    model.forward = syncing_forward
    with caplog.at_level(logging.WARNING, logger="loraserve.engine.model_runner"):
        got = ids(llm.generate(PROMPTS, SP))
    assert got == want
    assert llm.engine.runner.graphs is None
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "enforce_eager=True" in msgs[0], msgs
    assert ids(llm.generate(PROMPTS, SP)) == want  # and it serves on, eagerly


def test_graphs_apply_peft_extras_of_any_slot(tmp_path):
    """A DoRA / lora_bias adapter in a slot other than the one seen at capture: graph steps with it must
    run what eager runs (a graph bakes in the host's per-layer extras decision; SGLang #28371's
    silently dropped deltas, for extras). Plain adapters load first so the feature ones land in slots 1+."""
    from helpers import make_peft_adapter
    from safetensors.torch import load_file, save_file

    from loraserve import LoRARequest

    base = tmp_path / "base"
    make_tiny_model(base, "llama")
    plain = make_peft_adapter(base, tmp_path / "plain", seed=1, r=4, lora_alpha=8, target_modules="all-linear")
    dora = make_peft_adapter(base, tmp_path / "dora", seed=2, r=4, lora_alpha=8, use_dora=True,
                             target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    bias = make_peft_adapter(base, tmp_path / "bias", seed=3, r=4, lora_alpha=8, lora_bias=True,
                             target_modules=["o_proj", "gate_proj"])  # fmt: skip
    for path, key in ((dora, "lora_magnitude_vector"), (bias, "lora_B.bias")):  # trained, not at init
        sd = load_file(str(path / "adapter_model.safetensors"))
        g = torch.Generator().manual_seed(0)
        sd = {k: v + 0.3 * torch.randn(v.shape, generator=g) if key in k else v for k, v in sd.items()}
        save_file(sd, str(path / "adapter_model.safetensors"))
    reqs = [LoRARequest("plain", 1, str(plain)), LoRARequest("dora", 2, str(dora)), LoRARequest("bias", 3, str(bias))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i]} for i in range(4)]
    loras = [reqs[0], reqs[1], reqs[2], None]
    out = {}
    for eager in (True, False):
        llm = LLM(str(base), device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=64,
                  enable_lora=True, max_loras=4, max_lora_rank=8, enforce_eager=eager)  # fmt: skip
        llm.generate(prompts[:1], sp, lora_request=reqs[0])  # plain takes slot 0 and a graph is captured
        out[eager] = llm.generate(prompts, sp, lora_request=loras)
        if not eager:
            assert llm.engine.runner.graphs.stats["replays"] > 0
    for e, g in zip(out[True], out[False]):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        lp_e = [d[t].logprob for d, t in zip(e.outputs[0].logprobs, e.outputs[0].token_ids)]
        lp_g = [d[t].logprob for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(lp_e, lp_g)) < 1e-4


def test_pdl_chain_changes_no_bit(tmp_path, monkeypatch):
    """The decode step's PDL chain (utils.pdl_chain: every small kernel and each LoRA op's shrink launched
    while the kernel before it runs, each waiting before it touches memory) gives the same bits as the
    ordinary launches a GPU before sm_90 takes (``utils._pdl_on`` False): bf16 (the decode GEMM and its LoRA
    epilogue take part), 3 adapters and a base request in one batch, CUDA graphs. A link that read or wrote
    before its wait would race here."""
    from helpers import make_peft_adapter

    from loraserve import LoRARequest
    from loraserve.lora.ops.triton import utils as triton_utils

    base = tmp_path / "base"
    make_tiny_model(base, "llama")
    reqs = [
        LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(base, tmp_path / f"a{i}", seed=i, r=8, lora_alpha=16,
                                                          target_modules="all-linear")))  # fmt: skip
        for i in range(3)
    ]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i, 9]} for i in range(8)]
    loras = [reqs[i % 3] if i % 4 != 3 else None for i in range(8)]
    out = {}
    if not triton_utils.pdl_chain(torch.device("cuda")):
        pytest.skip("no PDL before sm_90: nothing to compare")
    for chain in (True, False):
        if not chain:
            monkeypatch.setattr(triton_utils, "_pdl_on", lambda index: False)
        assert triton_utils.pdl_chain(torch.device("cuda")) == chain
        llm = LLM(str(base), device="cuda", dtype="bfloat16", max_num_seqs=8, num_kv_blocks=64,
                  enable_lora=True, max_loras=4, max_lora_rank=8)  # fmt: skip
        out[chain] = llm.generate(prompts, sp, lora_request=loras)
        assert llm.engine.runner.graphs.stats["replays"] > 0
        del llm
    for on, off in zip(out[True], out[False]):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        lp_on = [d[t].logprob for d, t in zip(on.outputs[0].logprobs, on.outputs[0].token_ids)]
        lp_off = [d[t].logprob for d, t in zip(off.outputs[0].logprobs, off.outputs[0].token_ids)]
        assert lp_on == lp_off


def test_an_adapter_with_an_lm_head_delta_replays_a_graph_that_runs_it(tmp_path):
    """Whether the embedding and lm_head add their deltas is part of a graph's key (``LoRAMapping.vocab_lora``):
    steps of adapters without them replay a graph that skips those launches; a step with an adapter whose
    embedding and lm_head carry A and B, once that graph exists, replays another that runs them. Every sequence's
    tokens and logprobs equal eager's (fp32), which adds every delta."""
    from helpers import make_peft_adapter

    from loraserve import LoRARequest

    base = tmp_path / "base"
    make_tiny_model(base, "llama")
    plain = LoRARequest("plain", 1, str(make_peft_adapter(base, tmp_path / "plain", seed=1, r=8, lora_alpha=16,
                                                           target_modules=["q_proj", "v_proj"])))  # fmt: skip
    vocab = LoRARequest("vocab", 2, str(make_peft_adapter(base, tmp_path / "vocab", seed=2, r=8, lora_alpha=16,
                                                           target_modules=["q_proj", "embed_tokens", "lm_head"])))  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8 + i]} for i in range(4)]
    batches = [[plain, None, plain, None], [plain, vocab, None, vocab]]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, num_kv_blocks=64, enable_lora=True, max_loras=2,
              max_lora_rank=8)  # fmt: skip
    llm = LLM(str(base), **kw)
    graphs = llm.engine.runner.graphs
    got = llm.generate(prompts, sp, lora_request=batches[0])
    # keys: (bucket, LoRA, the embedding's and lm_head's deltas, A exactly in W's dtype)
    assert any(key[1] and not key[2] for key in graphs.graphs), list(graphs.graphs)
    assert not any(key[2] for key in graphs.graphs), "no adapter with an lm_head delta yet"
    got += llm.generate(prompts, sp, lora_request=batches[1])
    assert any(key[2] for key in graphs.graphs), list(graphs.graphs)
    eager = LLM(str(base), enforce_eager=True, **kw)
    want = eager.generate(prompts, sp, lora_request=batches[0]) + eager.generate(prompts, sp, lora_request=batches[1])
    for g, e in zip(got, want):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        lp_g = [d[t].logprob for d, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        lp_e = [d[t].logprob for d, t in zip(e.outputs[0].logprobs, e.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(lp_g, lp_e)) < 1e-4
