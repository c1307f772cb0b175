"""CUDA graphs are on by default on the GPU, off with enforce_eager; on the CPU nothing changes.

What needs no GPU is checked here: the flag's way from LLM(...) and the CLIs into the config, no
graphs on the CPU, and the fallback to eager when a capture fails (with a stand-in for the graphs).
The GPU half is tests/gpu/test_gpu_cuda_graphs.py.
"""

from __future__ import annotations

import logging

import pytest
from helpers import make_tiny_model

from loraserve import LLM, SamplingParams
from loraserve.cli import build_parser
from loraserve.config import ModelConfig
from loraserve.engine.cuda_graphs import GraphCaptureError
from loraserve.server.cli_serve import build_engine

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10, 11, 12]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs_cfg")
    make_tiny_model(path, "llama")
    return path


def test_enforce_eager_defaults_off_and_reaches_the_config(model_dir):
    assert ModelConfig().enforce_eager is False
    assert LLM(str(model_dir), device="cpu").config.model.enforce_eager is False
    assert LLM(str(model_dir), device="cpu", enforce_eager=True).config.model.enforce_eager is True


@pytest.mark.parametrize("cmd", [["generate", "hi"], ["chat"], ["serve"]])
def test_cli_flag_parses(cmd):
    p = build_parser()
    assert p.parse_args(cmd).enforce_eager is False
    assert p.parse_args([*cmd, "--enforce-eager"]).enforce_eager is True


def test_serve_builds_its_engine_with_the_flag(model_dir):
    args = build_parser().parse_args(["serve", str(model_dir), "--device", "cpu", "--enforce-eager"])
    assert build_engine(args, []).config.model.enforce_eager is True


def test_no_graphs_on_the_cpu(model_dir):
    llm = LLM(str(model_dir), device="cpu")
    assert not llm.engine._use_cuda_graphs()
    llm.generate(PROMPTS, SP)
    assert llm.engine.runner.graphs is None


class FailingGraphs:
    """Stands in for DecodeGraphs: takes every decode step, and its capture always fails."""

    def __init__(self):
        self.calls = 0

    def can_run(self, step) -> bool:
        return max(step.query_lens) == 1

    def run(self, step):
        self.calls += 1
        raise GraphCaptureError("batch bucket 2: RuntimeError: operation not permitted when stream is capturing")


def test_a_failed_capture_turns_graphs_off_and_runs_eagerly(model_dir, caplog):
    llm = LLM(str(model_dir), device="cpu")
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]
    fake = FailingGraphs()
    llm.engine.runner.graphs = fake
    with caplog.at_level(logging.WARNING, logger="loraserve.engine.model_runner"):
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]
    assert got == want  # the request did not fail, and the step ran eagerly
    assert fake.calls == 1 and llm.engine.runner.graphs is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "operation not permitted" in warnings[0].getMessage()
    assert "enforce_eager=True" in warnings[0].getMessage()
