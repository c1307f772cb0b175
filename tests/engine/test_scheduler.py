"""Scheduler with small fakes: a real BlockManager and Sequences, no model.

A fake step applies the scheduled tokens (num_computed_tokens += n) and appends one output token
to every sequence that caught up, as the engine's postprocess does.
"""

from __future__ import annotations

import random

import pytest

from loraserve import LoRARequest, SamplingParams
from loraserve.config import SchedulerConfig
from loraserve.engine.kv_cache import BlockManager
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.sequence import Sequence, SequenceStatus

_ids = iter(range(10**6))


def seq(prompt_len: int, max_tokens: int = 4, lora: int = 0) -> Sequence:
    sid = next(_ids)
    lr = LoRARequest(f"a{lora}", lora) if lora else None
    return Sequence(sid, str(sid), 0, [7] * prompt_len, SamplingParams(max_tokens=max_tokens), lr)


def make(num_blocks=64, block_size=4, max_num_seqs=8, max_tokens=64, **kw) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens)
    return Scheduler(cfg, BlockManager(num_blocks, block_size), **kw)


def step(s: Scheduler):
    """schedule + a fake postprocess; returns [(seq, n)] and finishes seqs that reached max_tokens."""
    batch = s.schedule()
    for q, n in zip(batch.seqs, batch.num_new_tokens):
        assert n > 0
        q.num_computed_tokens += n
        assert q.num_computed_tokens <= q.num_tokens
        assert len(q.block_table) * s.blocks.block_size >= q.num_computed_tokens
    for q in batch.seqs:
        if q.num_computed_tokens == q.num_tokens:
            q.output_token_ids.append(9)
            if len(q.output_token_ids) >= q.params.max_tokens:
                s.finish(q, "length")
    return list(zip(batch.seqs, batch.num_new_tokens))


def run_to_end(s: Scheduler, max_steps=2000, check=None):
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        step(s)
        if check:
            check(s)
    raise AssertionError("scheduler made no progress")


def test_fifo_admission_and_prefill_then_decode():
    s = make()
    a, b = seq(5), seq(3)
    s.add(a)
    s.add(b)
    assert [(q, n) for q, n in step(s)] == [(a, 5), (b, 3)]
    assert a.status == b.status == SequenceStatus.RUNNING
    c = seq(6)
    s.add(c)
    # running sequences decode one token each, the new one prefills in the same step
    assert step(s) == [(a, 1), (b, 1), (c, 6)]


def test_token_budget_chunks_long_prefills():
    s = make(max_tokens=8)
    a, b = seq(20), seq(3)
    s.add(a)
    s.add(b)
    assert step(s) == [(a, 8)]
    assert step(s) == [(a, 8)]
    assert step(s) == [(a, 4), (b, 3)]  # a's last chunk, then b fits in what is left
    assert a.output_token_ids == [9] and b.output_token_ids == [9]
    assert step(s) == [(a, 1), (b, 1)]


def test_budget_never_exceeded_and_all_finish():
    rng = random.Random(0)
    s = make(num_blocks=40, max_tokens=10, max_num_seqs=3)
    seqs = [seq(rng.randint(1, 30), rng.randint(1, 8)) for _ in range(12)]
    for q in seqs:
        s.add(q)

    def check(sch):
        assert len(sch.running) <= 3
        owned = [b for q in sch.running for b in q.block_table]
        assert len(owned) == len(set(owned))
        assert len(owned) + sch.blocks.num_free_blocks == sch.blocks.num_blocks

    for _ in range(500):
        if not s.has_unfinished():
            break
        scheduled = step(s)
        assert sum(n for _, n in scheduled) <= 10
        check(s)
    assert all(q.is_finished and len(q.output_token_ids) == q.params.max_tokens for q in seqs)
    assert s.blocks.num_free_blocks == s.blocks.num_blocks


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    qs = [seq(2) for _ in range(4)]
    for q in qs:
        s.add(q)
    assert [q for q, _ in step(s)] == qs[:2]
    assert list(s.waiting) == qs[2:]
    s.finish(qs[0], "abort")
    assert [q for q, _ in step(s)] == [qs[1], qs[2]]


def test_preemption_evicts_the_newest_and_recomputes():
    s = make(num_blocks=4, block_size=4)  # 16 token slots
    old, new = seq(7, max_tokens=20), seq(7, max_tokens=20)
    s.add(old)
    s.add(new)
    step(s)  # both prefilled: 2 blocks each, 0 free
    assert s.blocks.num_free_blocks == 0
    step(s)  # token 8 of each still fits its 2 blocks
    assert s.num_preemptions == 0
    scheduled = step(s)  # old needs a third block: new is preempted
    assert s.num_preemptions == 1
    assert [q for q, _ in scheduled] == [old]
    assert new.status == SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert s.waiting[0] is new and new.output_token_ids == [9, 9]  # keeps its tokens, recomputes KV
    s.finish(old, "abort")
    assert step(s) == [(new, 9)]  # prompt + both output tokens recomputed at once


def test_schedule_ahead_is_the_decode_step_schedule_would_make():
    """After a decode step, schedule_ahead gives the same sequences one token each (at position
    num_tokens, whose block it allocates) only when schedule() would make that step next."""
    s = make(num_blocks=5, block_size=4, max_tokens=64)
    a, b = seq(4, max_tokens=20), seq(2, max_tokens=20)
    s.add(a)
    s.add(b)
    step(s)  # prefill: a holds 1 block (4 tokens), b 1 block; one output token each
    current = s.schedule()  # the decode step now on the device: position 5 for a, 3 for b
    assert current.num_new_tokens == [1, 1] and not current.ahead
    ahead = s.schedule_ahead(current, [a, b])  # positions 5 (a, in its 2nd block) and 3 (b)
    assert ahead.seqs == [a, b] and ahead.num_new_tokens == [1, 1] and ahead.ahead
    assert len(a.block_table) == 2 and len(b.block_table) == 1
    assert s.schedule_ahead(current, [b]).seqs == [b]  # a left out (current ends it): b alone
    c = seq(3)
    s.add(c)
    assert s.schedule_ahead(current, [a, b]).empty  # someone waits: schedule() would admit it
    s.waiting.clear()
    s.running.append(c)  # a running sequence that current did not run
    assert s.schedule_ahead(current, [a, b]).empty
    s.running.remove(c)
    assert s.schedule_ahead(current, []).empty


def test_schedule_ahead_takes_all_slots_or_none_and_respects_the_budget():
    s = make(num_blocks=3, block_size=4, max_tokens=64)
    a, b = seq(3, max_tokens=20), seq(3, max_tokens=20)
    s.add(a)
    s.add(b)
    step(s)  # prefill 3 tokens + one output each: 4 tokens, 1 block each, 1 free
    current = s.schedule()  # computes position 3: no new block
    assert s.blocks.num_free_blocks == 1
    assert s.schedule_ahead(current, [a, b]).empty  # position 4 needs a block each: 2 > 1 free
    assert s.blocks.num_free_blocks == 1 and len(a.block_table) == len(b.block_table) == 1
    assert s.schedule_ahead(current, [a]).seqs == [a] and s.blocks.num_free_blocks == 0
    s.config.max_num_batched_tokens = 1
    assert s.schedule_ahead(current, [a]).seqs == [a]
    assert s.schedule_ahead(current, [a, b]).empty  # two tokens over a budget of one


def test_a_lone_sequence_is_never_preempted_while_it_fits():
    s = make(num_blocks=3, block_size=4)
    q = seq(2, max_tokens=10)  # at most 11 tokens of KV: 3 blocks
    s.add(q)
    run_to_end(s)
    assert s.num_preemptions == 0 and len(q.output_token_ids) == 10


class FakeSlots:
    """The LoRA manager's slot interface: max_loras device slots, some adapters still loading."""

    def __init__(self, max_loras: int, loading: set[int] | None = None, pinned: set[int] | None = None):
        self.max_loras = max_loras
        self.loading = loading or set()
        self.pinned = pinned or set()
        self.resident: list[int] = []  # LRU order
        self.calls: list[tuple[int, frozenset]] = []

    def pinned_resident(self) -> set[int]:
        return self.pinned & set(self.resident)

    def activate(self, lora_int_id: int, protected: set[int]) -> bool:
        self.calls.append((lora_int_id, frozenset(protected)))
        if lora_int_id in self.loading:
            return False
        if lora_int_id in self.resident:
            return True
        if len(self.resident) >= self.max_loras:
            evictable = [a for a in self.resident if a not in protected and a not in self.pinned]
            if not evictable:
                return False
            self.resident.remove(evictable[0])
        self.resident.append(lora_int_id)
        return True


def test_max_loras_limits_distinct_adapters_and_lets_resident_ones_pass():
    slots = FakeSlots(max_loras=2)
    s = make(adapters=slots)
    a1, b1, c1, a2, base = seq(2, lora=1), seq(2, lora=2), seq(2, lora=3), seq(2, lora=1), seq(2)
    for q in (a1, b1, c1, a2, base):
        s.add(q)
    admitted = [q for q, _ in step(s)]
    assert admitted == [a1, b1, a2, base]  # c1 waits for a slot; a2 rides on adapter 1; base always
    assert s.active_adapters() == {1, 2}
    assert list(s.waiting) == [c1]
    assert all(lid != 3 or {1, 2} <= prot for lid, prot in slots.calls)  # never evict a running adapter
    s.finish(b1, "abort")
    assert [q for q, _ in step(s)] == [a1, a2, base, c1]
    assert s.active_adapters() == {1, 3}
    assert len(s.active_adapters()) <= slots.max_loras


def test_pinned_adapters_hold_their_slots():
    slots = FakeSlots(max_loras=2, pinned={9})
    slots.resident = [9]
    s = make(adapters=slots)
    a, b = seq(2, lora=1), seq(2, lora=2)
    s.add(a)
    s.add(b)
    assert [q for q, _ in step(s)] == [a]  # 9 (pinned, idle) + 1 fill both slots
    assert 9 in slots.resident and list(s.waiting) == [b]


def test_adapter_still_loading_waits_others_go():
    slots = FakeSlots(max_loras=4, loading={1})
    s = make(adapters=slots)
    a, b, c = seq(2, lora=1), seq(2), seq(2, lora=2)
    for q in (a, b, c):
        s.add(q)
    assert [q for q, _ in step(s)] == [b, c]
    assert list(s.waiting) == [a]
    slots.loading.clear()
    assert a in [q for q, _ in step(s)]


def test_cold_adapter_is_not_starved_by_a_hot_one():
    """max_loras=1, a stream of requests on adapter 1: the request on adapter 2 gets in within a bound."""
    slots = FakeSlots(max_loras=1)
    s = make(adapters=slots, max_adapter_wait_steps=3, max_num_seqs=4)
    s.add(seq(2, max_tokens=3, lora=1))
    step(s)
    cold = seq(2, max_tokens=2, lora=2)
    s.add(cold)
    waited = 0
    while cold.status == SequenceStatus.WAITING:
        assert waited < 40, "the request on adapter 2 never got a slot"
        s.add(seq(2, max_tokens=3, lora=1))  # keeps adapter 1 busy forever
        step(s)
        assert len(s.active_adapters()) <= 1
        waited += 1
    assert waited > 3 and s.num_drains >= 1  # it did wait its bounded turn, then a slot was drained


def test_finish_frees_blocks_from_running_and_waiting():
    s = make(num_blocks=8)
    a, b = seq(9), seq(3)
    s.add(a)
    step(s)
    s.add(b)
    assert s.blocks.num_free_blocks == 8 - 3
    s.finish(a, "abort")
    assert a.block_table == [] and a not in s.running and s.blocks.num_free_blocks == 8
    s.finish(b, "abort")
    assert not s.has_unfinished()
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_with_preemption_always_completes(seed):
    rng = random.Random(seed)
    s = make(
        num_blocks=12, block_size=4, max_tokens=rng.choice([4, 9, 64]), max_num_seqs=rng.choice([2, 5, 8])
    )
    seqs = []
    for _ in range(15):
        p, m = rng.randint(1, 24), rng.randint(1, 16)
        if (p + m - 1 + 3) // 4 <= 12:  # each must fit the whole cache alone (the engine checks this)
            seqs.append(seq(p, m))
    for q in seqs:
        s.add(q)
    run_to_end(s)
    assert all(len(q.output_token_ids) == q.params.max_tokens for q in seqs)
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
