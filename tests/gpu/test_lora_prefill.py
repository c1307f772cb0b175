"""The one-launch prefill LoRA kernel (``lora_prefill``: shrink and expand items in one grid, the expand
items waiting on per-block counters) against the torch reference and the two-launch path.

Random data, garbage past each slot's rank, tokens of no adapter (slot -1) that must stay bit-identical,
a rank-0 slot, slices that are not multiples of the column tile. Runs on CUDA or under TRITON_INTERPRET=1
(there programs run one at a time in ticket order: the waits are exercised on the GPU only).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.triton_device import triton_device

DEV = triton_device()

from loraserve.lora.ops.triton import lora_prefill as prefill_mod  # noqa: E402
from loraserve.lora.ops.triton import utils as triton_utils  # noqa: E402
from loraserve.lora.ops.triton_ops import TritonLoRAOps  # noqa: E402
from tests.gpu.test_triton_lora import assert_delta_matches, meta_of, random_case, reference, sync  # noqa: E402

CASES = [
    # T, max_loras, R, n_in, slice outs, x dtype, weight dtype, y dtype
    (300, 6, 64, 512, (700, 300), torch.float32, torch.float32, torch.float32),
    (260, 3, 16, 896, (896, 128, 128), torch.float16, torch.float16, torch.float16),
    (200, 2, 16, 512, (384,), torch.float32, torch.float32, torch.float32),
    (400, 3, 16, 1024, (2048, 256), torch.bfloat16, torch.float16, torch.bfloat16),  # auto's GPU storage
    (600, 4, 32, 4096, (4096, 1024, 1024), torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (300, 4, 16, 1024, (1000, 200, 200), torch.bfloat16, torch.float32, torch.float32),
]
TILES = [
    prefill_mod.FusedPrefillTiles(),  # the defaults
    prefill_mod.FusedPrefillTiles(block_m=32, block_k=128, block_n=64, programs=64, num_warps=4, num_stages=2),
    prefill_mod.FusedPrefillTiles(block_m=64, block_k=32, block_n=256, programs=1024, num_warps=8, num_stages=4),
]


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"m{t.block_m}-k{t.block_k}-n{t.block_n}-p{t.programs}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-R{c[2]}-{len(c[4])}sl-{c[5]}-{c[6]}-{c[7]}")
def test_one_launch_prefill_matches_reference(case, tiles):
    """Every tile candidate: the delta equals the reference's, tokens of no adapter untouched; a second
    launch gives the same bits and every counter is back to zero after each."""
    mapping, ranks, As, Bs, x, y0, base = random_case(case, seed=1)
    meta = meta_of(mapping)
    assert meta.max_seg_len > 32, "the case must be prefill-size"
    ref = reference(y0, x, As, Bs, mapping.token_segments, ranks)
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    y = y0.clone()
    prefill_mod.lora_prefill(y, x, As, Bs, meta, rank_dev, tiles=tiles)
    again = y0.clone()
    prefill_mod.lora_prefill(again, x, As, Bs, meta, rank_dev, tiles=tiles)
    sync()
    assert_delta_matches(y, y0, ref, base, *case[5:])
    assert torch.equal(again, y), "a second launch must give the same bits (counters reset, planes in order)"
    pool = triton_utils._PERSISTENT.get(("lora_prefill/sync", x.device, torch.int32), [])
    assert pool and not any(c.any() for c in pool), "the ticket and block counters must be back to zero"


def test_one_launch_prefill_at_an_offset_into_a_wider_y():
    """Slices written at a column offset of a wider y leave the other columns untouched."""
    case = CASES[1]
    mapping, ranks, As, Bs, x, y0, base = random_case(case, seed=2)
    wide = torch.randn(x.shape[0], 40 + y0.shape[1] + 24, dtype=y0.dtype).to(DEV)
    wide[:, 40 : 40 + y0.shape[1]] = y0
    ref = reference(y0, x, As, Bs, mapping.token_segments, ranks)
    out = wide.clone()
    rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
    prefill_mod.lora_prefill(out, x, As, Bs, meta_of(mapping), rank_dev, offset=40)
    sync()
    assert torch.equal(out[:, :40], wide[:, :40]) and torch.equal(out[:, -24:], wide[:, -24:])
    assert_delta_matches(out[:, 40:-24], y0, ref, base, *case[5:])


def test_add_lora_linear_takes_one_launch_at_prefill_only(monkeypatch):
    """TritonLoRAOps.add_lora_linear takes two launches by default; with the knob on, the one-launch path
    for prefill-size segments with ranks up to MAX_RANK, still two launches for decode sizes and larger ranks."""
    calls = []
    real = prefill_mod.lora_prefill
    monkeypatch.setattr(prefill_mod, "lora_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    ops = TritonLoRAOps(DEV)

    def run(T, R, S=2):
        case = (T, S, R, 256, (128, 64), torch.float32, torch.float32, torch.float32)
        mapping, ranks, As, Bs, x, y0, base = random_case(case, seed=3)
        y = y0.clone()
        ops.add_lora_linear(y, x, As, Bs, ranks, meta_of(mapping))
        sync()
        assert_delta_matches(y, y0, reference(y0, x, As, Bs, mapping.token_segments, ranks), base, *case[5:])
        took = bool(calls)
        calls.clear()
        return took

    if "LORASERVE_FUSED_PREFILL" not in os.environ:
        assert not run(T=120, R=16), "off by default: prefill takes the shrink and the expand"
    monkeypatch.setattr(prefill_mod, "ENABLED", True)
    assert run(T=120, R=16), "with the knob on, prefill-size segments take one launch"
    assert not run(T=40, R=16, S=4), "decode-size segments (<= 32 tokens) take the shrink and the expand"
    assert not run(T=120, R=prefill_mod.MAX_RANK * 2), "ranks past MAX_RANK take two launches"
    monkeypatch.setattr(prefill_mod, "ENABLED", False)
    assert not run(T=120, R=16), "the knob off again: two launches"
