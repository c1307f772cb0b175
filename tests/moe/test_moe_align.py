"""``align_by_group``: the expert-aligned blocks the grouped MoE kernels run on (pure torch, any device)."""

from __future__ import annotations

import pytest
import torch

from loraserve.layers.moe_align import align_by_group, aligned_capacity, pick_block_m


def check(groups: torch.Tensor, G: int, block_m: int) -> None:
    a = align_by_group(groups, G, block_m)
    n = groups.numel()
    ids, bg = a.sorted_ids.long(), a.block_group.long()
    assert ids.numel() == aligned_capacity(n, G, block_m) == bg.numel() * block_m
    # every assignment of a real group exactly once, the excluded ones never
    real = ids[ids < n]
    want = torch.nonzero(groups < G).flatten()
    assert sorted(real.tolist()) == want.tolist()
    for b in range(bg.numel()):
        rows = ids[b * block_m : (b + 1) * block_m]
        valid = rows[rows < n]
        if bg[b] < 0:
            assert valid.numel() == 0, "an unused block holds assignments"
            continue
        assert valid.numel() > 0, "a used block holds only padding"
        assert (groups[valid] == bg[b]).all(), "a block mixes groups"
        assert (rows[: valid.numel()] == valid).all(), "padding before real rows"
    # each group's rows: stable (original order), groups in ascending order
    order = [i for i in ids.tolist() if i < n]
    assert order == sorted(order, key=lambda i: (groups[i].item(), i))


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_blocks_hold_each_assignment_once_grouped_and_padded(block_m, seed):
    g = torch.Generator().manual_seed(seed)
    G = int(torch.randint(1, 20, (1,), generator=g))
    n = int(torch.randint(0, 80, (1,), generator=g))
    groups = torch.randint(0, G + 1, (n,), generator=g)  # value G = excluded
    check(groups, G, block_m)


def test_edge_cases():
    check(torch.zeros(0, dtype=torch.long), 3, 16)  # no assignments
    check(torch.full((5,), 3), 3, 16)  # all excluded
    check(torch.full((40,), 2), 3, 16)  # one group spans three blocks
    check(torch.arange(7), 7, 16)  # every group non-empty, one row each


def test_block_size_follows_rows_per_group():
    assert pick_block_m(32 * 8, 128) == 16  # decode: two rows per expert
    assert pick_block_m(4096 * 8, 128) == 64  # prefill
    assert pick_block_m(0, 8) == 16
    assert pick_block_m(4096 * 2, 8, largest=128) == 128  # Mixtral prefill: 1024 rows per expert
    assert pick_block_m(4096 * 2, 8) == 64  # the default cap
