"""Paged KV blocks: every block comes back (finish, abort, preemption), tables never overlap, and
requests that cannot be served are refused up front with a RequestError that says why."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB, make_tiny_model

from loraserve import LLM, SamplingParams
from loraserve.engine.engine import RequestError
from loraserve.engine.kv_cache import BlockManager
from loraserve.engine.sequence import Sequence

MAX_LEN = 64


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model(path, "llama")
    return path


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("max_num_seqs", 8)
    return LLM(model=str(model_dir), dtype="float32", max_model_len=MAX_LEN, **kw)


def sp(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def all_seqs(engine):
    return [s for r in engine.requests.values() for s in r.seqs]


def check_block_invariants(engine) -> None:
    """Owned blocks are disjoint, cover the cached tokens, and with the free list make up the cache."""
    bm = engine.blocks
    owned = [b for s in all_seqs(engine) for b in s.block_table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    free = list(bm._free)
    assert len(free) == len(set(free)) and not set(free) & set(owned)
    assert len(free) + len(owned) == bm.num_blocks
    for s in all_seqs(engine):
        assert len(s.block_table) >= bm.blocks_for(s.num_computed_tokens)
        if s.is_finished:
            assert s.block_table == []


def step_all(engine, max_steps: int = 500, check=True) -> list:
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        outs.extend(engine.step())
        if check:
            check_block_invariants(engine)
    raise AssertionError("the engine did not finish its requests")


# ---- BlockManager on its own ---------------------------------------------------------------------
def test_block_manager_allocate_free_pairs():
    bm = BlockManager(num_blocks=5, block_size=4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    a = Sequence(0, "a", 0, list(range(2, 9)), sp())  # 7 tokens
    b = Sequence(1, "b", 0, list(range(2, 12)), sp())  # 10 tokens
    assert bm.can_allocate(a, 7)
    bm.allocate(a, 7)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 3
    a.num_computed_tokens = 7
    bm.allocate(a, 1)  # 8 tokens still fit in 2 blocks
    assert len(a.block_table) == 2
    assert not bm.can_allocate(b, 10 + 4 * 2)  # 18 tokens = 5 blocks > 3 free
    bm.allocate(b, 10)
    assert bm.num_free_blocks == 0 and not set(a.block_table) & set(b.block_table)
    a.num_computed_tokens = 8
    assert not bm.can_allocate(a, 1)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 2
    assert bm.can_allocate(b, 0)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks == 5
    assert sorted(bm._free) == list(range(5))


def test_append_slots_holds_position_num_tokens_for_all_or_none():
    """A step scheduled ahead writes position seq.num_tokens (the token being sampled, not appended):
    each sequence gets the block for it, all of them or none."""
    bm = BlockManager(num_blocks=4, block_size=4)
    a = Sequence(0, "a", 0, list(range(2, 6)), sp())  # 4 tokens: position 4 opens a second block
    b = Sequence(1, "b", 0, list(range(2, 5)), sp())  # 3 tokens: position 3 is in its first block
    for q in (a, b):
        bm.allocate(q, q.num_tokens)
        q.num_computed_tokens = q.num_tokens - 1  # the running step computes the last token
    assert bm.num_free_blocks == 2
    assert bm.can_append_slots([a, b])
    bm.append_slots([a, b])
    assert len(a.block_table) == 2 and len(b.block_table) == 1 and bm.num_free_blocks == 1
    c = Sequence(2, "c", 0, list(range(2, 6)), sp())
    bm.allocate(c, 4)  # the last free block
    c.num_computed_tokens = 3
    a.output_token_ids += [7, 7, 7, 7]  # a needs a third block, c a second: two, with none free
    assert not bm.can_append_slots([a, c]) and not bm.can_append_slots([a])
    before = (list(a.block_table), list(c.block_table))
    with pytest.raises(AssertionError):
        bm.append_slots([a, c])
    assert (a.block_table, c.block_table) == before and bm.num_free_blocks == 0  # nothing taken
    assert bm.can_append_slots([b])  # b's position 3 is in its block already


# ---- through the engine --------------------------------------------------------------------------
def test_all_blocks_back_after_generate(model_dir):
    llm = make_llm(model_dir, block_size=4)
    eng = llm.engine
    prompts = [{"prompt_token_ids": prompt(n, n)} for n in (3, 17, 9, 30, 1)]
    outs = llm.generate(prompts, [sp(m) for m in (5, 12, 1, 20, 7)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 12, 1, 20, 7]
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert not eng.requests and not eng.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_block_invariants_hold_every_step_with_preemption(model_dir, async_scheduling):
    llm = make_llm(
        model_dir,
        block_size=4,
        num_kv_blocks=12,
        max_num_batched_tokens=16,
        async_scheduling=async_scheduling,
    )
    eng = llm.engine
    for i, (n, m) in enumerate([(10, 20), (25, 10), (4, 30), (18, 12), (7, 9), (12, 15)]):
        eng.add_request(f"r{i}", None, sp(m), prompt(n, i))
    outs = step_all(eng)
    assert eng.scheduler.num_preemptions > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    finished = {o.request_id for o in outs if o.finished}
    assert finished == {f"r{i}" for i in range(6)}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_all_blocks_back_after_aborts_mid_run(model_dir, async_scheduling):
    llm = make_llm(
        model_dir, block_size=4, num_kv_blocks=20, max_num_seqs=4, max_num_batched_tokens=12,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    eng = llm.engine
    ids = [f"r{i}" for i in range(7)]
    for i, rid in enumerate(ids):
        eng.add_request(rid, None, sp(12), prompt(5 + 3 * i, i))
    for _ in range(4):
        eng.step()
        check_block_invariants(eng)
    by_id = {r: eng.requests[r].seqs[0] for r in ids}
    running = [r for r in ids if by_id[r] in eng.scheduler.running]
    waiting = [r for r in ids if by_id[r] in eng.scheduler.waiting]
    decoding = [r for r in running if by_id[r].output_token_ids]
    prefilling = [r for r in running if not by_id[r].output_token_ids]
    assert decoding and waiting, "the scenario should catch requests in several states"
    victims = [decoding[0], waiting[-1]] + prefilling[:1]
    for r in victims:
        held = len(by_id[r].block_table)
        free_before = eng.blocks.num_free_blocks
        eng.abort_request(r)
        assert eng.blocks.num_free_blocks == free_before + held
        assert by_id[r].finish_reason == "abort" and by_id[r].block_table == []
        check_block_invariants(eng)
    eng.abort_request(victims[0])  # aborting twice, or an unknown id, is a no-op
    eng.abort_request("no-such-request")
    outs = step_all(eng)
    assert not {o.request_id for o in outs} & set(victims), "an aborted request produced output"
    assert {o.request_id for o in outs if o.finished} == set(ids) - set(victims)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_everything_mid_run(model_dir, async_scheduling):
    llm = make_llm(model_dir, block_size=4, num_kv_blocks=16, async_scheduling=async_scheduling)
    eng = llm.engine
    for i in range(5):
        eng.add_request(str(i), None, sp(30), prompt(6 + i, i))
    for _ in range(3):
        eng.step()
    assert eng.blocks.num_free_blocks < eng.blocks.num_blocks
    for i in range(5):
        eng.abort_request(str(i))
    assert not eng.has_unfinished_requests()
    assert eng.step() == []
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_reused_blocks_do_not_leak_old_kv(model_dir):
    """Blocks freed by one request and reused by the next hold stale KV; the output must not care."""
    p = prompt(20, 99)
    fresh = make_llm(model_dir, block_size=4, num_kv_blocks=8)
    (want,) = fresh.generate({"prompt_token_ids": p}, sp(10))
    used = make_llm(model_dir, block_size=4, num_kv_blocks=8)
    used.generate({"prompt_token_ids": prompt(28, 5)}, sp(3))  # fills all 8 blocks
    (got,) = used.generate({"prompt_token_ids": p}, sp(10))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


# ---- refusals ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_llm(model_dir):
    return make_llm(model_dir, block_size=4, num_kv_blocks=8)  # 32 tokens of cache


def assert_clean(llm) -> None:
    eng = llm.engine
    assert not eng.requests and not eng.has_unfinished_requests()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("n", [MAX_LEN, MAX_LEN + 1, 3 * MAX_LEN])
def test_prompt_longer_than_max_model_len_is_refused(model_dir, n):
    llm = make_llm(model_dir)
    with pytest.raises(RequestError) as e:
        llm.generate({"prompt_token_ids": prompt(n, n)}, sp(1))
    msg = str(e.value)
    assert str(n) in msg and str(MAX_LEN) in msg and "max_model_len" in msg
    assert_clean(llm)
    (ok,) = llm.generate({"prompt_token_ids": prompt(MAX_LEN - 1, 1)}, sp(4))  # the longest that fits
    assert len(ok.outputs[0].token_ids) == 1 and ok.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [-1, VOCAB, VOCAB + 1000])
def test_token_ids_outside_vocab_are_refused(small_llm, bad):
    ids = [5, 6, bad, 7]
    with pytest.raises(RequestError) as e:
        small_llm.engine.add_request("x", None, sp(), ids)
    msg = str(e.value)
    assert str(bad) in msg and str(VOCAB) in msg and "vocab" in msg
    assert_clean(small_llm)


def test_bad_request_in_a_batch_leaves_nothing_behind(small_llm):
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(RequestError):
        small_llm.generate([good, good, {"prompt_token_ids": [5, VOCAB]}], sp())
    assert_clean(small_llm)
    (o,) = small_llm.generate(good, sp(3))
    assert len(o.outputs[0].token_ids) == 3


def test_empty_prompt_is_refused(small_llm):
    with pytest.raises(RequestError, match="empty"):
        small_llm.generate({"prompt_token_ids": []}, sp())
    assert_clean(small_llm)


def test_duplicate_request_id_is_refused(small_llm):
    eng = small_llm.engine
    eng.add_request("dup", None, sp(2), [5, 6])
    with pytest.raises(RequestError, match="dup"):
        eng.add_request("dup", None, sp(2), [7, 8])
    step_all(eng)
    assert_clean(small_llm)


def test_request_that_outgrows_the_whole_cache_is_refused_not_hung(small_llm):
    """32 cache slots: prompt 10 + 30 new tokens can never fit, even alone. Without the up-front
    check the scheduler preempts the request to make room for itself, forever."""
    with pytest.raises(RequestError) as e:
        small_llm.engine.add_request("big", None, sp(30), prompt(10, 3))
    assert "KV blocks" in str(e.value) and "8" in str(e.value)
    assert_clean(small_llm)
    # the largest that fits: 10 + 23 tokens, the last one never needs KV -> 32 slots exactly
    small_llm.engine.add_request("fits", None, sp(23), prompt(10, 3))
    outs = step_all(small_llm.engine, check=True)
    assert [len(o.outputs[0].token_ids) for o in outs if o.finished] == [23]
    assert_clean(small_llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failing_step_leaves_nothing_behind(tmp_path, monkeypatch, async_scheduling):
    """If a forward raises inside generate(), its requests fail and their blocks are freed (with
    async scheduling the third forward is a step launched ahead, before the second was read back)."""
    from helpers import make_tiny_model

    from loraserve import LLM, SamplingParams

    make_tiny_model(tmp_path / "m", "llama")
    llm = LLM(str(tmp_path / "m"), async_scheduling=async_scheduling)
    eng = llm.engine
    calls = {"n": 0}
    real = eng.runner.execute

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(step)

    monkeypatch.setattr(eng.runner, "execute", flaky)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, sp)
    assert all(o.outputs[0].finish_reason == "error" and "boom" in o.error for o in outs)
    assert not eng.has_unfinished_requests() and not eng.requests
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], sp)  # and the engine serves on
    assert len(out[0].outputs[0].token_ids) == 8
