"""Each TP base layer and LoRA layer family alone: 2 gloo ranks (spawned) against one process.

The single-process (TP=1) result is the reference; tests/lora/test_layers.py checks it against an
independent float64 computation. Both LoRA modes (default, --fully-sharded-loras) at TP=2 must give
the TP=1 output within fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
from dist_util import run_on_ranks
from layer_cases import CASES, reassemble, run_all, run_fp16_large_activations

TP = 2
BY_NAME = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    per_rank = run_on_ranks(run_all, TP, tmp_path_factory.mktemp("tp_layers"))
    return per_rank, run_all()  # (TP=2 outputs by rank, TP=1 outputs)


def test_every_rank_took_part(results):
    per_rank, _ = results
    for r, out in enumerate(per_rank):
        assert out["gathered_ranks"][0].tolist() == [0.0, 1.0], f"rank {r}"


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_base_layer_tp2_equals_tp1(results, name):
    per_rank, single = results
    got = reassemble(BY_NAME[name], [out[f"base/{name}"][0] for out in per_rank])
    torch.testing.assert_close(got, single[f"base/{name}"][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["default", "sharded"])
@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_lora_layer_tp2_equals_tp1(results, mode, name):
    per_rank, single = results
    case = BY_NAME[name]
    ref, ref_cls = single[f"default/{name}"]
    assert not torch.allclose(ref, single[f"base/{name}"][0], atol=1e-3), (
        "the adapters must change the output"
    )
    got = reassemble(case, [out[f"{mode}/{name}"][0] for out in per_rank])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    cls = {out[f"{mode}/{name}"][1] for out in per_rank}
    expected = case.sharded_cls if mode == "sharded" and case.sharded_cls else ref_cls
    assert cls == {expected}


@pytest.mark.parametrize("name", [c.name for c in CASES if c.sharded_cls])
def test_fully_sharded_at_tp1_equals_default(results, name):
    _, single = results
    assert single[f"sharded/{name}"][1] == BY_NAME[name].sharded_cls
    torch.testing.assert_close(single[f"sharded/{name}"][0], single[f"default/{name}"][0], rtol=0, atol=0)


def test_vocab_shard_of_only_padding_holds_no_token():
    """V=5 over 4 ranks pads to 8 (shards of 2): rank 3's shard is all padding; it loads and holds no token."""
    from loraserve.distributed.parallel_state import reset, set_tp_state
    from loraserve.layers.vocab import VocabParallelEmbedding

    set_tp_state(3, 4)
    try:
        emb = VocabParallelEmbedding(5, 8)
        emb.weight_loader(emb.weight, torch.randn(5, 8))
        assert (emb.vocab_start, emb.vocab_end) == (5, 5)
        assert not emb.weight.any()
    finally:
        reset()


def test_fully_sharded_fp16_lora_keeps_s_in_fp32(tmp_path):
    """fp16 LoRA weights (auto's GPU storage) with bf16 activations whose s exceeds fp16's range: the fully
    sharded layers at TP=2 (shrink, all-gather or all-reduce of s, expand) give the default mode's output,
    finite (s rounded to fp16 would be inf)."""
    per_rank = run_on_ranks(run_fp16_large_activations, TP, tmp_path)
    for out in per_rank:
        for layer in ("row", "column"):
            (got, cls), (ref, _) = out[f"sharded/{layer}"], out[f"default/{layer}"]
            assert "Sharded" in cls
            assert torch.isfinite(got).all(), f"{layer}: s went through fp16"
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
