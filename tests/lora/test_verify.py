"""`loraserve verify` passes a correctly served adapter and fails, readably, one served wrong."""

from __future__ import annotations

import pytest
from helpers import make_peft_adapter, make_tiny_model

import loraserve.lora.manager as manager
from loraserve.lora.peft import load_adapter
from loraserve.verify import verify_adapter


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    base = root / "base"
    make_tiny_model(base, "llama", tied=True)  # its tokenizer loads as-is (Qwen2Tokenizer rebuilds ours)
    good = make_peft_adapter(base, root / "good", seed=3, r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True)
    return base, good


PROMPTS = ["t5 t6 t7 t8", "t40 t41 t42"]


def test_verify_passes_a_good_adapter(setup):
    base, good = setup
    report = verify_adapter(str(good), str(base), PROMPTS, max_tokens=6, threshold=1e-4)
    assert report.passed, report.render()
    assert report.max_abs_diff < 1e-4 and report.token_agreement == 1.0
    assert "PASS" in report.render()


def test_verify_fails_an_adapter_served_with_a_wrong_scale(setup, monkeypatch):
    base, good = setup

    def wrong_scale(*args, **kw):
        adapter = load_adapter(*args, **kw)
        for m in adapter.modules.values():
            m.lora_b = m.lora_b * 1.5  # e.g. alpha / r instead of alpha / sqrt(r)
        return adapter

    monkeypatch.setattr(manager, "load_adapter", wrong_scale)
    report = verify_adapter(str(good), str(base), PROMPTS, max_tokens=6, threshold=1e-4)
    assert not report.passed
    text = report.render()
    assert "FAIL" in text and "max |dlogprob|" in text and "do not deploy" in text
    assert report.max_abs_diff > 1e-3


def test_verify_cli_exit_codes(setup, capsys):
    from loraserve.cli import main

    base, good = setup
    code = main(["verify", str(good), "--model", str(base), "--prompt", PROMPTS[0], "--max-tokens", "4", "--threshold", "1e-4"])
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out
