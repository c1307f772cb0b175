"""Group-aligned blocks for the grouped GEMMs of MoE: assignments sorted by group, padded per group.

A group is an expert (the base experts) or an (adapter slot, expert) pair (expert LoRA). The grouped
kernels give each program ``block_m`` rows of one group, so each group's rows are padded to a
multiple of ``block_m``; a block then reads one expert's (or one pair's) weights for all its rows.

Everything here is torch ops on the assignments' device with shapes fixed by (n, num_groups,
block_m): no host sync, so a CUDA graph can capture it and the next replay sees new routing. The
capacity bound: at most min(num_groups, n) groups are non-empty, each padded by < block_m rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AlignedBlocks:
    """``sorted_ids`` (capacity,) int32: assignment index per row, ``num_valid`` in padding rows;
    ``block_group`` (capacity // block_m,) int32: the group of each block, -1 for an unused block."""

    sorted_ids: torch.Tensor
    block_group: torch.Tensor
    num_valid: int  # n: padding rows hold this value (>= every real assignment index)
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_group.numel()


def aligned_capacity(n: int, num_groups: int, block_m: int) -> int:
    """Rows needed for n assignments over num_groups groups, each group padded to block_m."""
    rows = n + min(num_groups, n) * (block_m - 1)
    return -(-rows // block_m) * block_m


def align_by_group(groups: torch.Tensor, num_groups: int, block_m: int) -> AlignedBlocks:
    """groups (n,) int64 in [0, num_groups]; the value num_groups = excluded (not in any block).

    Within a group, assignments keep their original order (stable sort).
    """
    assert groups.dim() == 1 and groups.dtype == torch.long, "groups: (n,) int64"
    n, G, dev = groups.numel(), num_groups, groups.device
    counts = torch.zeros(G + 1, dtype=torch.long, device=dev).scatter_add_(0, groups, torch.ones_like(groups))[:G]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(groups, stable=True)
    g_sorted = groups[order]
    g_safe = g_sorted.clamp(max=G - 1)
    pos = pad_start[g_safe] + torch.arange(n, device=dev) - count_start[g_safe]
    capacity = aligned_capacity(n, G, block_m)
    pos = torch.where(g_sorted < G, pos, capacity)  # excluded assignments land in a dump row, cut below
    sorted_ids = torch.full((capacity + 1,), n, dtype=torch.long, device=dev)
    sorted_ids.scatter_(0, pos, order)
    block_starts = torch.arange(capacity // block_m, device=dev) * block_m
    block_group = torch.searchsorted(pad_end, block_starts, right=True)  # first group ending past the start
    block_group = torch.where(block_group < G, block_group, -1)
    return AlignedBlocks(sorted_ids[:capacity].to(torch.int32), block_group.to(torch.int32), n, block_m)


def pick_block_m(n: int, num_groups: int, largest: int = 64) -> int:
    """Rows per block from the mean rows per non-empty group: small blocks for decode (few tokens per
    expert), large ones for prefill, at most ``largest`` (the base GEMM takes 128; the LoRA kernels,
    whose per-block work is small, stay at 64). 16 is the smallest tensor-core tile."""
    mean = n / max(1, min(num_groups, n))
    m = 16 if mean <= 16 else (32 if mean <= 48 else (64 if mean <= 192 else 128))
    return min(m, largest)
