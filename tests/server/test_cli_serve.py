"""`loraserve serve`: vLLM's flag names, the demo adapters by default, checks before the model loads."""

from __future__ import annotations

import pytest
import torch

from loraserve.cli import build_parser
from loraserve.config import ConfigError
from loraserve.server.cli_serve import demo_adapters, make_app, run_serve


def test_serve_flags_parse(tmp_path):
    args = build_parser().parse_args(
        [
            "serve",
            "/models/m",
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "512",
            "--lora-modules",
            "sql=/a/sql",
            "chat=/a/chat",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "32",
            "--lora-dtype",
            "bfloat16",
            "--max-cpu-loras",
            "8",
            "--lora-target-modules",
            "q_proj",
            "v_proj",
            "--api-key",
            "k",
            "--allow-runtime-lora-updating",
            "--lora-root",
            str(tmp_path),
            "--max-num-seqs",
            "32",
            "--seed",
            "3",
        ]
    )
    assert args.func is run_serve
    assert args.model == "/models/m" and args.port == 9000 and args.max_model_len == 512
    assert args.lora_modules == [("sql", "/a/sql"), ("chat", "/a/chat")]
    assert args.lora_target_modules == ["q_proj", "v_proj"] and args.max_cpu_loras == 8
    assert args.lora_dtype == "bfloat16"
    assert build_parser().parse_args(["serve"]).model is None
    assert build_parser().parse_args(["serve"]).lora_dtype == "auto"


def test_demo_adapters_are_found():
    names = {n for n, _ in demo_adapters()}
    assert names == {
        "pirate",
        "french",
        "json",
    }  # the dirs in loraserve/demo_adapters with an adapter_config.json


def test_bad_flags_fail_before_the_model_loads(tmp_path):
    p = build_parser()
    with pytest.raises(ConfigError, match="--lora-root"):
        make_app(p.parse_args(["serve", str(tmp_path / "no-model"), "--allow-runtime-lora-updating"]))
    with pytest.raises(ConfigError, match="not a directory"):
        make_app(
            p.parse_args(["serve", str(tmp_path / "no-model"), "--lora-modules", f"x={tmp_path / 'nope'}"])
        )


def test_make_app_loads_the_lora_modules(files):
    args = build_parser().parse_args(
        [
            "serve",
            str(files.base),
            "--device",
            "cpu",
            "--num-kv-blocks",
            "32",
            "--lora-modules",
            f"a0={files.a0}",
        ]
    )
    server = make_app(args).state.server
    assert server.model_name == "tiny-llama"
    assert list(server.engine.adapters.snapshot()) == ["a0"]
    assert server.engine.engine.lora_manager is not None


def test_lora_flags_reach_the_engine_config(tmp_path):
    """`generate`'s LoRA flags (one definition with `serve`'s) reach LoRAConfig; a --lora-dtype not in
    the choices fails at parse time."""
    from loraserve.cli import _make_llm
    from loraserve.server.cli_serve import build_engine
    from tests.helpers import make_tiny_model

    make_tiny_model(tmp_path / "m")
    flags = ["--max-loras", "3", "--max-lora-rank", "16", "--lora-dtype", "bfloat16", "--max-cpu-loras", "5"]
    args = build_parser().parse_args(["generate", "hi", "--model", str(tmp_path / "m"), "--device", "cpu",
                                      "--lora", f"a={tmp_path}", *flags])  # fmt: skip
    for lora in (_make_llm(args).config.lora,
                 build_engine(build_parser().parse_args(["serve", str(tmp_path / "m"), "--device", "cpu",
                                                         "--enable-lora", *flags]), []).config.lora):  # fmt: skip
        assert lora.resolved_dtype() == torch.bfloat16
        assert (lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (3, 16, 5)
        assert lora.fully_sharded_loras is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--lora-dtype", "bf17"])
