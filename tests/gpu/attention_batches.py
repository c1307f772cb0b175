"""Paged-attention metadata for the kernel tests: sequences whose cache blocks are scattered over the cache."""

from __future__ import annotations

import torch

from loraserve.forward_context import AttentionMetadata


def make_batch(g, q_lens, ctx_lens, block_size, num_blocks, device, blocks: list[int] | None = None):
    """Metadata with each sequence's blocks drawn at random from the whole cache (no sharing); ``blocks``:
    the order to hand them out in instead (tables are padded with block 0 either way)."""
    perm = torch.randperm(num_blocks, generator=g).tolist() if blocks is None else list(blocks)
    tables, starts, slot_mapping, kv_slots = [], [], [], []
    pos = 0
    for n, c in zip(q_lens, ctx_lens):
        nb = -(-c // block_size)
        table, perm = perm[:nb], perm[nb:]
        tables.append(table)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(c)]
        kv_slots.append(torch.tensor(slots, dtype=torch.long, device=device))
        slot_mapping.extend(slots[c - n :])
        starts.append(pos)
        pos += n
    width = max(len(t) for t in tables)
    packed = torch.tensor(
        [[s, n, c] + t + [0] * (width - len(t)) for s, n, c, t in zip(starts, q_lens, ctx_lens, tables)],
        dtype=torch.int32,
    ).to(device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        query_starts=starts,
        query_lens=list(q_lens),
        context_lens=list(ctx_lens),
        kv_slots=kv_slots,
        block_tables=packed[:, 3:],
        seq_info=packed[:, :3],
        block_size=block_size,
    )
