"""Paged KV block manager: a free list of fixed-size blocks; sequences own block tables.

Paired verbs: ``can_allocate / allocate / free``, and ``can_append_slots / append_slots`` for a
decode step scheduled ahead (async scheduling). Every block returns to the free list when its
sequence finishes, is aborted or is preempted.

A freed block keeps its KV (clearing it would cost a pass over the block per free, for nothing): its
next owner never reads it. Attention reads, per sequence, only positions below the context length
through its own block table, and each of those was written by that sequence (an earlier step, or this
step's cache write, which runs before attention): the stale rest of a block is masked on the load.
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
        return self._needed_to_hold(seq, seq.num_computed_tokens + num_new_tokens)

    def _needed_to_hold(self, seq: Sequence, num_tokens: int) -> int:
        return max(self.blocks_for(num_tokens) - len(seq.block_table), 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self._needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold its cached tokens plus num_new_tokens."""
        n = self._needed(seq, num_new_tokens)
        assert n <= len(self._free), "allocate() without can_allocate()"
        seq.block_table.extend(self._free.popleft() for _ in range(n))

    def can_append_slots(self, seqs: list[Sequence]) -> bool:
        """Whether every one of ``seqs`` can get a slot for position ``seq.num_tokens``, all at once."""
        return sum(self._needed_to_hold(s, s.num_tokens + 1) for s in seqs) <= len(self._free)

    def append_slots(self, seqs: list[Sequence]) -> None:
        """Grow each seq's block table to hold position ``seq.num_tokens``: the token its running step
        samples, which a step scheduled ahead feeds back before it is appended (all of them or none)."""
        assert self.can_append_slots(seqs), "append_slots() without can_append_slots()"
        for s in seqs:
            s.block_table.extend(
                self._free.popleft() for _ in range(self._needed_to_hold(s, s.num_tokens + 1))
            )

    def free(self, seq: Sequence) -> None:
        """Return seq's blocks to the free list, their KV untouched (see the module docstring)."""
        self._free.extend(seq.block_table)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
