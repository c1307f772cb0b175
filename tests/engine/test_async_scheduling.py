"""Async scheduling: launching each decode step before the last one is read back changes no output.

Every case runs one workload on two engines, async scheduling forced on and off, and asserts the
same token ids, texts, finish and stop reasons and logprob ranks, logprob values to float tolerance
(and, where the steps line up, the same outputs from every ``step()`` call), plus that the pipeline
engaged or stayed off where it must.
On the CPU everything is synchronous anyway: these check the bookkeeping (which sequences run ahead,
which tokens are discarded, min_tokens, seeds, KV slots, aborts). The overlap itself, and that the
launch ahead never waits for the device, are checked on the GPU (tests/gpu/test_gpu_async_scheduling.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from helpers import VOCAB, make_peft_adapter, make_tiny_model

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.cli import build_parser
from loraserve.config import EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from loraserve.engine.engine import LLMEngine
from loraserve.server.cli_serve import build_engine

N = 8
PROMPTS = [
    torch.randint(2, VOCAB, (int(n),), generator=torch.Generator().manual_seed(300 + i)).tolist()
    for i, n in enumerate(torch.randint(3, 14, (N,), generator=torch.Generator().manual_seed(7)))
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("async_base")
    make_tiny_model(path, "llama", initializer_range=0.1)
    return path


@pytest.fixture(scope="module")
def trajectories(model_dir) -> list[list[int]]:
    """Each prompt's greedy continuation (EOS ignored): where the stop criteria below are taken from."""
    llm = make(model_dir, False)
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def seeded_trajectories(model_dir) -> list[list[int]]:
    """The first of two seeded completions of each prompt (EOS ignored), sampled as ``stop_params``."""
    llm = make(model_dir, False)
    sps = [SamplingParams(**seeded_kw(i), max_tokens=24, ignore_eos=True) for i in range(N)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), sps)]


@pytest.fixture(scope="module")
def eos(trajectories) -> int:
    """An EOS id the greedy continuations do reach, mid-way: the most frequent token past position 2."""
    return Counter(t for tr in trajectories for t in tr[2:]).most_common(1)[0][0]


@pytest.fixture(scope="module")
def eos_dir(tmp_path_factory, eos):
    """The same weights (same seed), with ``eos`` as the model's EOS token."""
    path = tmp_path_factory.mktemp("async_eos")
    make_tiny_model(path, "llama", initializer_range=0.1, eos_token_id=eos)
    return path


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("async_adapters")
    return [
        LoRARequest("all", 1, str(make_peft_adapter(model_dir, root / "all", seed=1, r=8, target_modules="all-linear"))),
        LoRARequest("qv", 2, str(make_peft_adapter(model_dir, root / "qv", seed=2, r=4, target_modules=["q_proj", "v_proj"]))),
    ]  # fmt: skip


def prompts(idx=range(N)) -> list[dict]:
    return [{"prompt_token_ids": PROMPTS[i]} for i in idx]


def make(path, async_scheduling: bool, **kw) -> LLM:
    kw = {"max_model_len": 128, "max_num_seqs": 2 * N, **kw}
    return LLM(str(path), device="cpu", dtype="float32", async_scheduling=async_scheduling, **kw)


def both(path, **kw) -> tuple[LLM, LLM]:
    sync, ahead = make(path, False, **kw), make(path, True, **kw)
    assert not sync.engine.async_scheduling and ahead.engine.async_scheduling
    return sync, ahead


def summary(out) -> dict:
    """Everything a caller sees of a RequestOutput."""
    return {
        "finished": out.finished,
        "prompt_logprobs": out.prompt_logprobs,
        "outputs": [
            (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs
        ],
    }


def assert_same(ref: list, got: list) -> None:
    """The same outputs: token ids, texts, finish and stop reasons, logprob ranks exactly; logprob
    values to float tolerance. A step launched ahead still carries the rows of sequences that
    stopped meanwhile (their tokens are dropped), so it batches more rows than the synchronous
    engine's step, and a CPU GEMM may round differently by batch size (seen on CI: 5e-7)."""
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert_close(summary(a), summary(b), what=f"request {i}")


def assert_same_calls(ref: list[list[dict]], got: list[list[dict]]) -> None:
    """``drive`` results: the same requests out of every step() call, each as ``assert_same``."""
    assert [[o["id"] for o in call] for call in got] == [[o["id"] for o in call] for call in ref]
    for call_ref, call_got in zip(ref, got):
        for a, b in zip(call_ref, call_got):
            assert_close(a, b, what=a["id"])


def assert_close(ref: dict, got: dict, atol: float = 1e-5, what: str = "") -> None:
    """Two summaries: equal, logprob values within ``atol`` (for steps that batched different rows:
    the batch-invariance tolerance, tests/engine/test_batch_invariance.py)."""

    def split(d: dict) -> tuple[dict, list[float]]:
        values: list[float] = []

        def strip(rows):
            if rows is None:
                return None
            values.extend(lp.logprob for row in rows if row for lp in row.values())
            return [row and {t: (lp.rank, lp.decoded_token) for t, lp in row.items()} for row in rows]

        shape = {**d, "prompt_logprobs": strip(d["prompt_logprobs"])}
        shape["outputs"] = [c[:5] + (strip(c[5]),) for c in d["outputs"]]
        return shape, values

    (a, va), (b, vb) = split(ref), split(got)
    assert b == a, what
    assert max((abs(x - y) for x, y in zip(va, vb)), default=0.0) <= atol, what


def ran_ahead(llm: LLM) -> int:
    return llm.engine.num_launched_ahead


# ---- outputs equal the synchronous engine's -----------------------------------------------------
CONFIGS = {
    "roomy": {},
    "chunked_prefill": {"max_num_batched_tokens": 8},
    "preemption": {"block_size": 4, "num_kv_blocks": 16},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_with_logprobs_equals_sync(model_dir, config):
    sync, ahead = both(model_dir, **CONFIGS[config])
    sps = [
        SamplingParams(
            temperature=0, max_tokens=6 + 2 * i, ignore_eos=True, logprobs=i % 3, prompt_logprobs=1
        )
        for i in range(N)
    ]
    assert_same(sync.generate(prompts(), sps), ahead.generate(prompts(), sps))
    assert ran_ahead(ahead) > 0 and ran_ahead(sync) == 0
    assert ahead.engine.num_discarded_tokens == 0  # nothing stops by surprise: max_tokens is known ahead
    pre = [llm.engine.scheduler.num_preemptions for llm in (sync, ahead)]
    assert pre[0] == pre[1] and (pre[0] > 0) == (config == "preemption"), pre
    assert ahead.engine.blocks.num_free_blocks == ahead.engine.blocks.num_blocks


def seeded_kw(i: int) -> dict:
    return {"temperature": 1.0, "top_k": 40, "seed": 100 + i, "n": 2}


def stop_params(i: int, trajectory: list[int], kind: str) -> SamplingParams:
    """Per request one way to stop besides EOS: none, a stop token, a stop string (kept or not),
    min_tokens; with a max_tokens that some requests reach first."""
    kw = {"max_tokens": 10 + (i * 5) % 14, "logprobs": 2}
    kw.update(seeded_kw(i) if kind == "seeded" else {"temperature": 0})
    way = i % 4
    if way == 1:
        kw["stop_token_ids"] = [trajectory[4]]
    elif way == 2:
        kw["stop"] = [f"t{trajectory[5]}"]
        kw["include_stop_str_in_output"] = i % 8 == 2
    elif way == 3:
        kw["min_tokens"] = 6
    return SamplingParams(**kw)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_stops_equal_sync(eos_dir, trajectories, seeded_trajectories, kind):
    """EOS, stop tokens, stop strings, min_tokens, max_tokens, n=2: a sequence that stops while the
    next step runs ahead has that token discarded, and nothing else changes."""
    trs = seeded_trajectories if kind == "seeded" else trajectories
    sps = [stop_params(i, trs[i], kind) for i in range(N)]
    sync, ahead = both(eos_dir)
    ref, got = sync.generate(prompts(), sps), ahead.generate(prompts(), sps)
    assert_same(ref, got)
    assert ran_ahead(ahead) > 0
    assert ahead.engine.num_discarded_tokens > 0, "no sequence stopped while the next step ran ahead"
    comps = [c for o in ref for c in o.outputs]
    reasons = {
        "eos": any(c.finish_reason == "stop" and c.stop_reason is None for c in comps),
        "stop token": any(isinstance(c.stop_reason, int) for c in comps),
        "stop string": any(isinstance(c.stop_reason, str) for c in comps),
        "length": any(c.finish_reason == "length" for c in comps),
    }
    assert all(reasons.values()), reasons  # the workload exercises every way to stop
    if kind == "seeded":  # a completion stopped while its sibling went on: the request was output after
        assert any(
            len(o.outputs) == 2 and min(o.outputs, key=lambda c: len(c.token_ids)).finish_reason == "stop"
            and len({len(c.token_ids) for c in o.outputs}) == 2
            for o in ref
        )  # fmt: skip


def test_min_tokens_counts_the_token_still_on_the_device(eos_dir, trajectories, eos):
    """min_tokens = the index where the greedy continuation first reaches EOS: the step sampling that
    index runs ahead, with one output token not appended yet; it must allow EOS there (the count is
    reached), so the request stops exactly at min_tokens + 1 tokens, as in the synchronous engine."""
    cases = [(i, tr.index(eos)) for i, tr in enumerate(trajectories) if eos in tr and tr.index(eos) >= 2]
    assert cases, "no continuation reaches the EOS token past its first two tokens"
    idx = [i for i, _ in cases]
    sps = [SamplingParams(temperature=0, max_tokens=24, min_tokens=p) for _, p in cases]
    sync, ahead = both(eos_dir)
    ref, got = sync.generate(prompts(idx), sps), ahead.generate(prompts(idx), sps)
    assert_same(ref, got)
    for (_, p), o in zip(cases, ref):
        assert o.outputs[0].token_ids[-1] == eos and len(o.outputs[0].token_ids) == p + 1
    assert ran_ahead(ahead) > 0


def test_mixed_lora_batch_equals_sync(model_dir, adapters):
    loras = [None, adapters[0], adapters[1]] * 3
    sps = [SamplingParams(temperature=0, max_tokens=5 + i, ignore_eos=True, logprobs=1) for i in range(N)]
    sync, ahead = both(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8)
    ref = sync.generate(prompts(), sps, lora_request=loras[:N])
    assert_same(ref, ahead.generate(prompts(), sps, lora_request=loras[:N]))
    assert ran_ahead(ahead) > 0
    base = sync.generate(prompts(), sps)
    assert [o.outputs[0].token_ids for o in base] != [o.outputs[0].token_ids for o in ref]  # adapters matter


def drive(llm: LLM, script: dict[int, list[tuple]], max_calls: int = 200) -> list[list[dict]]:
    """Call step() until everything finished and the script ran: before call k, the script's actions
    for k (("add", rid, prompt index, params) or ("abort", rid)). The outputs of every call."""
    eng = llm.engine
    calls = []
    for k in range(max_calls):
        for action in script.get(k, []):
            if action[0] == "add":
                eng.add_request(action[1], None, action[3], PROMPTS[action[2]])
            else:
                eng.abort_request(action[1])
        if not eng.has_unfinished_requests() and k > max(script):
            return calls
        calls.append(sorted((summary(o) | {"id": o.request_id} for o in eng.step()), key=lambda s: s["id"]))
    raise AssertionError("the requests did not finish")


def test_aborts_mid_generation_give_the_same_outputs_call_by_call(eos_dir):
    """Aborting between steps (a request whose next step already runs ahead, and later every request,
    then a new one) changes nothing: every step() call returns what the synchronous engine returns."""
    sp = SamplingParams(temperature=0, max_tokens=16, logprobs=1)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=5, n=2)
    script = {
        0: [("add", f"r{i}", i, sp if i % 2 else seeded) for i in range(5)],
        4: [("abort", "r1")],
        6: [("abort", "r2"), ("abort", "r3")],
        9: [("abort", f"r{i}") for i in range(5)],
        11: [("add", "late", 5, sp)],
    }
    sync, ahead = both(eos_dir)
    ref = drive(sync, script)
    assert_same_calls(ref, drive(ahead, script))
    assert ahead.engine.num_discarded_tokens > 0, "no aborted sequence was in a step running ahead"
    assert ran_ahead(ahead) > 0
    for eng in (sync.engine, ahead.engine):
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.requests


def test_requests_arriving_mid_generation(eos_dir, trajectories):
    """A request that arrives while a step runs ahead waits one step (the pipeline breaks, then comes
    back): its output, and everyone else's, equals the synchronous engine's."""
    sps = [stop_params(i, trajectories[i], "greedy") for i in range(N)]
    script = {0: [("add", "r0", 0, sps[0]), ("add", "r1", 1, sps[1])], 3: [("add", "r2", 2, sps[2])]}
    script |= {5: [("add", "r3", 3, sps[3]), ("add", "r4", 4, sps[4])], 9: [("add", "r5", 5, sps[5])]}
    sync, ahead = both(eos_dir)
    log = spy_launch_ahead(ahead)
    finals = [
        {o["id"]: o for call in drive(llm, script) for o in call if o["finished"]} for llm in (sync, ahead)
    ]
    assert finals[0].keys() == finals[1].keys() and len(finals[0]) == 6
    for rid in finals[0]:  # the late requests batched with other steps: logprobs to float tolerance
        assert_close(finals[0][rid], finals[1][rid])
    assert any(d["launched"] for d in log), "the pipeline never engaged"
    assert not any(d["launched"] for d in log if d["waiting"]), "a step ran ahead of a waiting request"
    assert any(d["waiting"] and d["decode_only"] for d in log), "no request arrived while the pipeline ran"


def test_a_step_left_running_ahead_is_finished_by_the_next_call(eos_dir, trajectories, eos):
    """A request that stops at EOS while its next step runs ahead leaves that step in flight after
    generate() returns; the next generate() finishes it first (dropping its token), then schedules."""
    i = next(i for i, tr in enumerate(trajectories) if eos in tr[2:])
    sp = SamplingParams(temperature=0, max_tokens=24)
    sync, ahead = both(eos_dir)
    assert_same(*[llm.generate(prompts([i]), sp) for llm in (sync, ahead)])
    assert ahead.engine._inflight is not None, "the scenario should leave a step running ahead"
    assert all(s.is_finished for s in ahead.engine._inflight.batch.seqs)
    sps = [stop_params(j, trajectories[j], "greedy") for j in range(N)]
    assert_same(*[llm.generate(prompts(), sps) for llm in (sync, ahead)])
    assert ahead.engine.num_discarded_tokens >= 1
    assert ahead.engine.blocks.num_free_blocks == ahead.engine.blocks.num_blocks


# ---- where the pipeline stays off ----------------------------------------------------------------
def spy_launch_ahead(llm: LLM) -> list[dict]:
    """Record every decision to launch a step ahead: did requests wait, was the current step a plain
    decode, could the KV cache hold a slot for each sequence, was a step launched."""
    eng = llm.engine
    real = eng._launch_ahead
    log: list[dict] = []

    def launch_ahead(current, clock):
        live = [s for s in current.batch.seqs if not s.is_finished]
        d = {
            "waiting": bool(eng.scheduler.waiting),
            "decode_only": current.decode_only,
            "kv_fits": eng.blocks.can_append_slots(live),
        }
        launched = real(current, clock)
        log.append(d | {"launched": launched is not None})
        return launched

    eng._launch_ahead = launch_ahead
    return log


def test_no_step_runs_ahead_while_requests_wait(model_dir):
    """max_num_seqs=1: while one request decodes the others wait, so every step is scheduled; the
    last one, alone, runs ahead."""
    sps = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 3
    sync, ahead = both(model_dir, max_num_seqs=1)
    log = spy_launch_ahead(ahead)
    assert_same(sync.generate(prompts(range(3)), sps), ahead.generate(prompts(range(3)), sps))
    assert any(d["waiting"] and d["decode_only"] for d in log)
    assert not any(d["launched"] for d in log if d["waiting"])
    assert sum(d["launched"] for d in log) == ran_ahead(ahead) > 0


def test_prefill_steps_and_a_short_kv_cache_break_the_pipeline(model_dir):
    """No step is launched ahead of one with a prefill, nor when its KV slots would need a preemption:
    then the next call schedules (and preempts) as the synchronous engine does."""
    sps = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * N
    sync, ahead = both(model_dir, block_size=4, num_kv_blocks=16)
    log = spy_launch_ahead(ahead)
    assert_same(sync.generate(prompts(), sps), ahead.generate(prompts(), sps))
    assert any(not d["decode_only"] for d in log) and any(not d["kv_fits"] for d in log)
    assert not any(d["launched"] for d in log if not d["decode_only"] or not d["kv_fits"])
    assert ahead.engine.scheduler.num_preemptions == sync.engine.scheduler.num_preemptions > 0
    assert ran_ahead(ahead) > 0


def resolve(async_scheduling, device: str, tp: bool) -> bool:
    """LLMEngine._use_async_scheduling on a stand-in engine (no model, no GPU, no worker processes)."""
    cfg = EngineConfig(
        model=ModelConfig(device="cpu"),
        scheduler=SchedulerConfig(async_scheduling=async_scheduling),
        parallel=ParallelConfig(tensor_parallel_size=2 if tp else 1),
    )
    stub = SimpleNamespace(config=cfg, device=torch.device(device), workers=object() if tp else None)
    return LLMEngine._use_async_scheduling(stub)


def test_default_is_on_for_cuda_only_and_never_under_tensor_parallelism(caplog):
    assert SchedulerConfig().async_scheduling is None
    assert resolve(None, "cuda", tp=False) is True
    assert resolve(None, "cpu", tp=False) is False
    assert resolve(False, "cuda", tp=False) is False
    assert resolve(True, "cpu", tp=False) is True
    assert resolve(None, "cuda", tp=True) is False
    with caplog.at_level(logging.WARNING, logger="loraserve.engine.engine"):
        assert resolve(True, "cuda", tp=True) is False
    assert "tensor parallelism" in caplog.text


def test_the_switch_reaches_the_engine(model_dir):
    assert LLM(str(model_dir), device="cpu").engine.async_scheduling is False  # the CPU default
    assert make(model_dir, True).engine.async_scheduling is True
    p = build_parser()
    for cmd in (["generate", "hi"], ["chat"], ["serve"]):
        assert p.parse_args(cmd).async_scheduling is None
        assert p.parse_args([*cmd, "--async-scheduling"]).async_scheduling is True
        assert p.parse_args([*cmd, "--no-async-scheduling"]).async_scheduling is False
    args = p.parse_args(["serve", str(model_dir), "--device", "cpu", "--async-scheduling"])
    eng = build_engine(args, [])
    assert eng.config.scheduler.async_scheduling is True and eng.async_scheduling is True
