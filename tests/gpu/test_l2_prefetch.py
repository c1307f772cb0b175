"""The decode attention's LoRA L2 prefetch (``paged_attention(..., prefetch=)``, ``l2_prefetch``): the launch
compiles and runs with it and its outputs are the same bits as without it, for slots shared by several
tokens, base tokens and one slot for all. CUDA only: the prefetch is inline PTX, which the Triton interpreter
cannot run (``region_table`` gives None there).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the prefetch is inline PTX)", allow_module_level=True)
pytest.importorskip("triton")
DEV = torch.device("cuda")

from loraserve.layers.triton_attention import paged_attention  # noqa: E402
from loraserve.lora.ops.triton import l2_prefetch  # noqa: E402
from tests.gpu.attention_batches import make_batch  # noqa: E402
from tests.gpu.test_decode_linear import lora_stacks, mapping_of  # noqa: E402

CASES = [
    # tokens, q heads, kv heads, head_dim, slots, the slots of the tokens
    (32, 14, 2, 64, 8, "round-robin"),  # Qwen2.5-0.5B's step: 8 adapters, 4 tokens each
    (7, 8, 2, 32, 3, "with base"),  # base tokens ask nothing
    (5, 4, 4, 32, 2, "one slot"),  # every token's part of one slot
    (32, 32, 8, 128, 8, "round-robin"),  # Llama-8B's shape
]


@pytest.fixture(autouse=True)
def prefetch_on(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "ENABLED", True)  # opt-in (LORASERVE_LORA_L2_PREFETCH=1)


def token_slots(kind: str, T: int, S: int) -> list[int]:
    if kind == "round-robin":
        return [t % S for t in range(T)]
    if kind == "with base":
        return [-1 if t % 3 == 2 else t % S for t in range(T)]
    return [S - 1] * T


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-KV{c[2]}-D{c[3]}-S{c[4]}-{c[5]}")
def test_prefetch_keeps_the_attention_bits(case):
    """With a table of six stacks (gate/up-, down- and o-like A and B), the output equals the launch without
    the prefetch, bit for bit; with o's shrink in the same launch, its partials too."""
    T, H, KV, D, S, kind = case
    g = torch.Generator().manual_seed(T + H + KV + D + S)
    md = make_batch(g, [1] * T, torch.randint(1, 60, (T,), generator=g).tolist(), 16, 8 * T, DEV)
    q = torch.randn(T, H, D, generator=g).to(DEV, torch.bfloat16)
    k_cache = torch.randn(8 * T * 16, KV, D, generator=g).to(DEV, torch.bfloat16)
    v_cache = torch.randn(8 * T * 16, KV, D, generator=g).to(DEV, torch.bfloat16)
    ranks = [16] * S
    (a_o,), (b_o,) = lora_stacks(g, S, 16, H * D, (256,), ranks, torch.float16)
    gate_up_a, gate_up_b = lora_stacks(g, S, 16, 256, (512, 512), ranks, torch.float16)
    table = l2_prefetch.region_table([a_o, b_o, *gate_up_a, *gate_up_b])
    assert table is not None and table.shape == (6, 3)
    mapping, _ = mapping_of(token_slots(kind, T, S))
    want = paged_attention(q, k_cache, v_cache, md, D**-0.5, None)
    got = paged_attention(q, k_cache, v_cache, md, D**-0.5, None, prefetch=(table, mapping.token_slots))
    assert torch.equal(got, want)
    if kind != "one slot":  # o's shrink and the prefetch share the slots' pointer
        rank_dev = torch.tensor(ranks, dtype=torch.int32, device=DEV)
        shrink = (a_o, rank_dev, mapping.token_slots)
        out, obuf = paged_attention(q, k_cache, v_cache, md, D**-0.5, None, shrink=shrink)
        out_pf, obuf_pf = paged_attention(
            q, k_cache, v_cache, md, D**-0.5, None, shrink=shrink, prefetch=(table, mapping.token_slots)
        )
        assert torch.equal(out_pf, out) and torch.equal(out_pf, want)
        lora_rows = [t for t, s in enumerate(token_slots(kind, T, S)) if s >= 0]
        assert torch.equal(obuf_pf[:, :, lora_rows], obuf[:, :, lora_rows])
