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
