"""How the decode attention finds the LoRA weights it pulls into L2 (``l2_prefetch``): the region table of
the stacks, and the decoder layer's modules looked up at each step (the LoRA wrappers, which replace the
modules after the model is built). The prefetch itself runs on the GPU (tests/gpu/test_l2_prefetch.py).
"""

from __future__ import annotations

import pytest
import torch

from loraserve import LLM
from loraserve.lora.layers import BaseLayerWithLoRA
from tests.helpers import make_tiny_model


def test_region_table_lists_each_stack_by_slot(monkeypatch):
    """A row per stack: its address, the bytes between two slots and the bytes of a slot; one table per set
    of stacks (the same tensor again); none when the prefetch is off or there is nothing to prefetch."""
    pytest.importorskip("triton")  # the module holds the kernel helper too
    from loraserve.lora.ops.triton import l2_prefetch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)  # opt-in (LORASERVE_LORA_L2_PREFETCH=1)
    a = torch.zeros(8, 1, 16, 896, dtype=torch.float16)
    b = torch.zeros(8, 1, 4864, 16, dtype=torch.float32)
    table = l2_prefetch.region_table([a, b])
    assert table.dtype == torch.int64 and table.tolist() == [
        [a.data_ptr(), 16 * 896 * 2, 16 * 896 * 2],
        [b.data_ptr(), 4864 * 16 * 4, 4864 * 16 * 4],
    ]
    assert l2_prefetch.region_table([a, b]) is table
    assert l2_prefetch.region_table([]) is None
    monkeypatch.setattr(l2_prefetch, "ENABLED", False)
    assert l2_prefetch.region_table([a, b]) is None


def test_attention_finds_the_layers_lora_wrappers(tmp_path):
    """Each decoder layer's attention gives the current o, gate/up and down modules: after LoRA is enabled,
    the wrappers, whose stacks it would prefetch (none outside a step with adapters)."""
    make_tiny_model(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    for layer in llm.engine.model.model.layers:
        mods = layer.self_attn.attn.lora_prefetch_from()
        assert mods == (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        assert all(isinstance(m, BaseLayerWithLoRA) for m in mods)
        assert all(m.l2_prefetch_stacks() == [] for m in mods)  # no step, no mapping: not the fused path
