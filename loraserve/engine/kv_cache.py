"""Paged KV block manager: a free list of fixed-size blocks; sequences own block tables.

Paired verbs: ``can_allocate / allocate / free``. Every block returns to the free list when its
sequence finishes, is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque

from loraserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table), 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold its cached tokens plus num_new_tokens."""
        n = self._needed(seq, num_new_tokens)
        assert n <= len(self._free), "allocate() without can_allocate()"
        seq.block_table.extend(self._free.popleft() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
