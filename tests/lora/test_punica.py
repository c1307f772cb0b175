"""LoRAMapping segments and the reference ops (torch_ops) against naive per-token loops."""

from __future__ import annotations

import pytest
import torch

from loraserve.forward_context import forward_context
from loraserve.lora.ops import torch_ops
from loraserve.lora.punica import LoRAMapping, PunicaWrapper

CPU = torch.device("cpu")
MAX_LORAS, R = 5, 8
RANKS = [3, 1, 0, R, 6]  # per slot; slot 2 has rank 0 (empty)


def random_slot_list(g: torch.Generator, n: int, max_loras: int = MAX_LORAS) -> list[int]:
    return torch.randint(-1, max_loras, (n,), generator=g).tolist()


def check_segments(slots: list[int], segments, order=None, starts=None, lens=None) -> None:
    expected_slots = sorted({s for s in slots if s >= 0})
    assert [s for s, _ in segments] == expected_slots  # one segment per slot, ascending, -1 excluded
    for s, idx in segments:
        assert idx.dtype == torch.long
        assert idx.tolist() == [t for t, x in enumerate(slots) if x == s]  # every token of s, in order
    if order is not None:
        assert sorted(order.tolist()) == list(range(len(slots)))  # a permutation
        sorted_slots = [slots[i] for i in order.tolist()]
        assert sorted_slots == sorted(slots)
        assert len(starts) == len(lens) == len(segments)
        for (s, idx), st, ln in zip(segments, starts, lens):
            assert ln == len(idx) > 0
            assert st == sum(1 for x in slots if x < s)  # position in the sorted order
            assert torch.equal(order[st : st + ln], idx)


@pytest.mark.parametrize("seed", range(8))
def test_mapping_segments_random(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    slots = random_slot_list(g, n)
    logit_slots = random_slot_list(g, int(torch.randint(1, 10, (1,), generator=g)))
    m = LoRAMapping.build(slots, logit_slots, CPU)
    assert m.token_slots.tolist() == slots and m.logit_slots.tolist() == logit_slots
    check_segments(slots, m.token_segments, m.token_order, m.seg_starts, m.seg_lens)
    check_segments(logit_slots, m.logit_segments)
    assert m.active_slots == sorted({s for s in slots if s >= 0})
    assert m.has_lora == any(s >= 0 for s in slots)
    assert m.has_logits_lora == any(s >= 0 for s in logit_slots)


def test_mapping_interleaved_and_edge_cases():
    slots = [2, -1, 0, 2, 2, -1, 0, 3]
    m = LoRAMapping.build(slots, [3, -1, 0], CPU)
    assert [(s, i.tolist()) for s, i in m.token_segments] == [(0, [2, 6]), (2, [0, 3, 4]), (3, [7])]
    assert m.seg_starts == [2, 4, 7] and m.seg_lens == [2, 3, 1]
    assert m.token_order.tolist() == [1, 5, 2, 6, 0, 3, 4, 7]
    assert [(s, i.tolist()) for s, i in m.logit_segments] == [(0, [2]), (3, [0])]

    base_only = LoRAMapping.build([-1, -1, -1], [-1], CPU)
    assert base_only.token_segments == [] and base_only.logit_segments == []
    assert not base_only.has_lora and not base_only.has_logits_lora and base_only.active_slots == []

    empty = LoRAMapping.build([], [], CPU)
    assert not empty.has_lora and empty.token_order.numel() == 0

    logits_only = LoRAMapping.build([-1, -1], [1], CPU)
    assert not logits_only.has_lora and logits_only.has_logits_lora


# ---- ops ------------------------------------------------------------------------------------------------


def stacked_with_garbage(g, n_in: int, n_out: int, ranks: list[int]):
    """A (S, 1, R, in), B (S, 1, out, R): real values up to each slot's rank, large garbage beyond it."""
    a = torch.randn(MAX_LORAS, 1, R, n_in, generator=g)
    b = torch.randn(MAX_LORAS, 1, n_out, R, generator=g)
    for s, r in enumerate(ranks):
        a[s, 0, r:] = 1e6 + torch.rand(R - r, n_in, generator=g)
        b[s, 0, :, r:] = -1e6 + torch.rand(n_out, R - r, generator=g)
    return a, b


def naive_shrink(x, a, slots, ranks):
    out = torch.zeros(x.shape[0], R, dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0 and ranks[s] > 0:
            r = ranks[s]
            for j in range(r):
                out[t, j] = (a[s, 0, j].double() * x[t].double()).sum()
    return out


def naive_expand(buf, b, slots, ranks):
    out = torch.zeros(buf.shape[0], b.shape[2], dtype=torch.float64)
    for t, s in enumerate(slots):
        if s >= 0 and ranks[s] > 0:
            r = ranks[s]
            for o in range(b.shape[2]):
                out[t, o] = (b[s, 0, o, :r].double() * buf[t, :r].double()).sum()
    return out


@pytest.mark.parametrize("seed", range(3))
def test_lora_shrink_heterogeneous_ranks_ignores_padding(seed):
    g = torch.Generator().manual_seed(seed)
    T, n_in = 23, 12
    slots = random_slot_list(g, T)
    slots[:5] = [0, 1, 2, 3, 4]  # every slot present
    a, _ = stacked_with_garbage(g, n_in, 4, RANKS)
    x = torch.randn(T, n_in, generator=g)
    m = LoRAMapping.build(slots, [], CPU)
    sentinel = 7.25
    out = torch.full((T, R), sentinel)
    torch_ops.lora_shrink(x, a, m.token_segments, RANKS, out)
    ref = naive_shrink(x, a, slots, RANKS)
    for t, s in enumerate(slots):
        r = RANKS[s] if s >= 0 else 0
        torch.testing.assert_close(out[t, :r].double(), ref[t, :r], atol=1e-5, rtol=1e-5)
        # columns at or beyond the rank, and tokens without a slot, are not written
        assert (out[t, r:] == sentinel).all(), (t, s)


@pytest.mark.parametrize("seed", range(3))
def test_lora_expand_heterogeneous_ranks_ignores_padding(seed):
    g = torch.Generator().manual_seed(seed)
    T, n_out, offset, total = 23, 10, 6, 20
    slots = random_slot_list(g, T)
    slots[:5] = [4, 3, 2, 1, 0]
    _, b = stacked_with_garbage(g, 4, n_out, RANKS)
    buf = torch.randn(T, R, generator=g)
    for t, s in enumerate(slots):  # garbage in buf beyond each token's rank
        r = RANKS[s] if s >= 0 else 0
        buf[t, r:] = 1e6
    y0 = torch.randn(T, total, generator=g)
    y = y0.clone()
    m = LoRAMapping.build(slots, [], CPU)
    torch_ops.lora_expand(y, buf, b, m.token_segments, RANKS, offset, act_dtype=torch.float32)
    ref = y0.double()
    ref[:, offset : offset + n_out] += naive_expand(buf, b, slots, RANKS)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    # outside [offset, offset + n_out), and for -1 / rank-0 tokens, y is untouched bit for bit
    assert torch.equal(y[:, :offset], y0[:, :offset]) and torch.equal(
        y[:, offset + n_out :], y0[:, offset + n_out :]
    )
    untouched = torch.tensor([s < 0 or RANKS[s] == 0 for s in slots])
    assert torch.equal(y[untouched], y0[untouched])


def test_lora_embedding_heterogeneous_ranks_ignores_padding():
    g = torch.Generator().manual_seed(0)
    T, V, H = 25, 30, 8
    slots = random_slot_list(g, T)
    slots[:5] = [0, 1, 2, 3, 4]
    emb_a = torch.randn(MAX_LORAS, V, R, generator=g)  # A^T
    b = torch.randn(MAX_LORAS, 1, H, R, generator=g)
    for s, r in enumerate(RANKS):
        emb_a[s, :, r:] = 1e6
        b[s, 0, :, r:] = -1e6
    ids = torch.randint(0, V, (T,), generator=g)
    y0 = torch.randn(T, H, generator=g)
    y = y0.clone()
    torch_ops.lora_embedding(y, ids, emb_a, b, LoRAMapping.build(slots, [], CPU).token_segments, RANKS)
    ref = y0.double()
    for t, s in enumerate(slots):
        if s >= 0 and RANKS[s] > 0:
            r = RANKS[s]
            ref[t] += b[s, 0, :, :r].double() @ emb_a[s, ids[t], :r].double()
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


def test_punica_add_lora_linear_slices_and_logits_segments():
    """add_lora_linear: per-slice shrink+expand at each slice's offset; add_lora_logits uses the logit slots."""
    g = torch.Generator().manual_seed(1)
    T, n_in, sizes = 17, 12, (5, 7, 3)
    slots = random_slot_list(g, T)
    slots[:5] = [0, 1, 2, 3, 4]
    stacks = [stacked_with_garbage(g, n_in, n, RANKS) for n in sizes]
    x = torch.randn(T, n_in, generator=g)
    y0 = torch.randn(T, sum(sizes), generator=g)
    pw = PunicaWrapper(MAX_LORAS, CPU)
    y = y0.clone()
    with forward_context(lora=LoRAMapping.build(slots, [], CPU)):
        pw.add_lora_linear(y, x, tuple(a for a, _ in stacks), tuple(b for _, b in stacks), sizes, RANKS)
    ref = y0.double()
    off = 0
    for (a, b), n in zip(stacks, sizes):
        ref[:, off : off + n] += naive_expand(naive_shrink(x, a, slots, RANKS), b, slots, RANKS)
        off += n
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)

    logit_slots = [4, -1, 0, 3]
    h = torch.randn(len(logit_slots), n_in, generator=g)
    a, b = stacks[0]
    y0 = torch.randn(len(logit_slots), sizes[0], generator=g)
    y = y0.clone()
    with forward_context(lora=LoRAMapping.build(slots, logit_slots, CPU)):
        pw.add_lora_logits(y, h, a, b, RANKS)
    ref = y0.double() + naive_expand(naive_shrink(h, a, logit_slots, RANKS), b, logit_slots, RANKS)
    torch.testing.assert_close(y.double(), ref, atol=1e-4, rtol=1e-5)
