"""Continuous batching: prefill and decode mixed in one step, chunked prefill, recompute preemption.

Each step takes running sequences first (one decode token each, or the next prefill chunk), then
admits waiting ones while three budgets allow: ``max_num_batched_tokens``, ``max_num_seqs`` and KV
blocks, plus one for LoRA: at most ``max_loras`` distinct adapters among the running sequences.
When blocks run out, the most recently admitted sequence is preempted (its blocks freed, its tokens
recomputed later).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.config import SchedulerConfig
from loraserve.engine.kv_cache import BlockManager
from loraserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        max_loras: int | None = None,
        adapter_ready: Callable[[int], bool] | None = None,
    ):
        self.config = config
        self.blocks = blocks
        self.max_loras = max_loras
        # adapter_ready(lora_int_id): False while an adapter is still loading; such requests wait
        self.adapter_ready = adapter_ready or (lambda _id: True)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def active_adapters(self) -> set[int]:
        return {s.lora_int_id for s in self.running if s.lora_int_id}

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished and release its blocks (finished, stopped or aborted)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.blocks.allocate(seq, n)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        if len(batch.seqs) < len(self.running):  # some running seq got no budget: admit nobody new
            return batch
        adapters = self.active_adapters()
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            lid = seq.lora_int_id
            if lid and not self.adapter_ready(lid):
                skipped.append(seq)
                continue
            if lid and lid not in adapters and self.max_loras is not None and len(adapters) >= self.max_loras:
                skipped.append(seq)  # its adapter needs a slot; later requests on resident adapters go on
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.can_allocate(seq, n):
                skipped.append(seq)
                break
            self.blocks.allocate(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if lid:
                adapters.add(lid)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return batch
