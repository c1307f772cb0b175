"""Continuous batching: prefill and decode mixed in one step, chunked prefill, recompute preemption.

Each step takes running sequences first (one decode token each, or the next prefill chunk), then
admits waiting ones while three budgets allow: ``max_num_batched_tokens``, ``max_num_seqs`` and KV
blocks, plus one for LoRA: at most ``max_loras`` distinct adapters among the running sequences.
When blocks run out, the most recently admitted sequence is preempted (its blocks freed, its tokens
recomputed later).

Adapters: a waiting request whose adapter is not resident asks ``adapters.activate`` (the LoRA
manager), which loads it off the step loop; until then the request waits and others go on. When all
slots are held by running adapters, the oldest blocked request waits at most ``max_adapter_wait_steps``
steps: then the scheduler drains one slot (it stops admitting the running adapter with the fewest
sequences until they finish), so a cold adapter is never starved by hot ones.

Async scheduling (engine.py) asks ``schedule_ahead`` for the decode step after the one running on
the device, before that step's tokens are known; it answers only when that is the step
``schedule()`` would make next anyway, else the engine finishes the running step and schedules anew.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from loraserve.config import SchedulerConfig
from loraserve.engine.kv_cache import BlockManager
from loraserve.engine.sequence import Sequence, SequenceStatus


class AdapterSlots(Protocol):
    max_loras: int

    def pinned_resident(self) -> set[int]: ...

    def activate(self, lora_int_id: int, protected: set[int]) -> bool:
        """True when the adapter is resident in a slot (evicting none of ``protected``); False = wait."""
        ...


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # scheduled ahead (async scheduling): each sequence's one new token is the one the step before
    # samples, not appended yet: it sits at position seq.num_tokens and its id is on the device only
    ahead: bool = False

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
        adapters: AdapterSlots | None = None,
        max_adapter_wait_steps: int = 8,
    ):
        self.config = config
        self.blocks = blocks
        self.adapters = adapters
        self.max_adapter_wait_steps = max_adapter_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_drains = 0
        self._draining: int | None = None  # adapter not admitted while a starved request waits for its slot
        self._starved: Sequence | None = None
        self._starved_steps = 0

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
        blocked_by_slots: Sequence | None = None
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            lid = seq.lora_int_id
            if lid and not self._adapter_admissible(lid, adapters):
                if blocked_by_slots is None and lid not in adapters:
                    blocked_by_slots = seq
                skipped.append(seq)  # others on resident adapters go on
                continue
            if lid and lid == self._draining:
                skipped.append(seq)
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
        self._guard_starvation(blocked_by_slots, adapters)
        return batch

    def schedule_ahead(self, current: ScheduledBatch, seqs: list[Sequence]) -> ScheduledBatch:
        """The decode step after ``current`` (on the device, its tokens not appended yet) for ``seqs``,
        those of current's sequences that go on: one token each, at position ``seq.num_tokens``.

        Empty, allocating nothing, unless it is the step ``schedule()`` would make next (short of the
        sequences that ``current`` turns out to stop): nobody waits, ``current`` ran every running
        sequence, the token budget holds them all, and the KV cache has a slot for each without
        preemption (all or none). Sequences current does stop keep their slot until they finish.
        """
        if not seqs or self.waiting or len(seqs) > self.config.max_num_batched_tokens:
            return ScheduledBatch()
        ran = set(current.seqs)
        assert all(s in ran and s.status == SequenceStatus.RUNNING for s in seqs), (
            "schedule_ahead() of a seq not running in current"
        )
        if any(s not in ran for s in self.running) or not self.blocks.can_append_slots(seqs):
            return ScheduledBatch()
        self.blocks.append_slots(seqs)
        self._guard_starvation(None, set())  # what schedule() does when nobody waits
        return ScheduledBatch(list(seqs), [1] * len(seqs), ahead=True)

    def _adapter_admissible(self, lid: int, running_adapters: set[int]) -> bool:
        if self.adapters is None or lid in running_adapters:
            return True
        held = running_adapters | self.adapters.pinned_resident()
        if len(held) >= self.adapters.max_loras and lid not in held:
            return False
        return self.adapters.activate(lid, running_adapters)

    def _guard_starvation(self, blocked: Sequence | None, running_adapters: set[int]) -> None:
        """Bounded wait for a request whose adapter finds every slot held: drain one slot for it."""
        if blocked is None or blocked.status != SequenceStatus.WAITING:
            self._starved, self._starved_steps, self._draining = None, 0, None
            return
        if blocked is not self._starved:
            self._starved, self._starved_steps, self._draining = blocked, 0, None
        self._starved_steps += 1
        if self._draining is None and self._starved_steps > self.max_adapter_wait_steps and running_adapters:
            pinned = self.adapters.pinned_resident() if self.adapters else set()
            counts = {a: 0 for a in running_adapters - pinned}
            for s in self.running:
                if s.lora_int_id in counts:
                    counts[s.lora_int_id] += 1
            if counts:
                self._draining = min(counts, key=counts.get)
                self.num_drains += 1
