"""The engine at TP=2 (one spawned gloo worker) against TP=1, in both LoRA modes.

Tiny tied Llama with biases on every linear (so the row-parallel bias is added once), 4 query heads
and 1 kv head (replicated on both ranks), vocab 255 (padded to 256 across the two shards). A mixed batch: base, an all-linear adapter, and an adapter on
embed_tokens + lm_head + every linear (odd rank 5, so the fully sharded mode splits it unevenly).
"""

from __future__ import annotations

import pytest
from helpers import make_peft_adapter, make_tiny_model, max_logprob_diff, peft_model

from loraserve import LLM, LoRARequest, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIXED = [  # (prompt token ids, adapter name or None)
    ([5, 6, 7, 8, 9, 10, 11], None),
    ([40, 41, 42, 43], "lin"),
    ([100, 3, 17, 250, 9, 9, 60, 61], "emb"),
    ([7, 7, 8, 200, 201], "lin"),
    ([12, 13], "emb"),
    ([254, 0, 1, 2], None),
    ([5, 6, 7, 8, 9, 10, 11], "emb"),
    ([5, 6, 7, 8, 9, 10, 11], "lin"),
]
MIXED_SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=5)
EVICT_PROMPT, EVICT_ORDER = {"prompt_token_ids": [30, 31, 32, 33]}, ["qv", "lin", "qv", "emb", "lin"]
GREEDY_PROMPTS = ["t5 t9 t33 t2", "t100 t101", "t7 t8 t9 t10 t11 t12"]
GREEDY_SP = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_engine")
    model = root / "model"
    make_tiny_model(
        model,
        "llama",
        tied=True,
        num_key_value_heads=1,
        vocab_size=255,
        initializer_range=0.2,
        attention_bias=True,
        mlp_bias=True,
    )
    adapters = {
        "lin": make_peft_adapter(
            model, root / "lin", seed=1, r=8, lora_alpha=16, target_modules="all-linear"
        ),
        "emb": make_peft_adapter(
            model, root / "emb", seed=2, r=5, lora_alpha=10, target_modules=ALL + ["embed_tokens", "lm_head"]
        ),
        "qv": make_peft_adapter(
            model, root / "qv", seed=3, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]
        ),
    }
    return model, adapters


def _run(model, adapters, tp: int, fully_sharded: bool = False) -> dict:
    llm = LLM(
        str(model),
        device="cpu",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_model_len=128,
        num_kv_blocks=96,
        tensor_parallel_size=tp,
        fully_sharded_loras=fully_sharded,
        async_scheduling=True,  # honoured at TP=1 (so TP=2 is also compared with it), off at TP=2
    )
    try:
        reqs = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
        mixed = llm.generate(
            [{"prompt_token_ids": p} for p, _ in MIXED], MIXED_SP, [reqs[a] if a else None for _, a in MIXED]
        )
        greedy = llm.generate(GREEDY_PROMPTS, GREEDY_SP)
        # one adapter at a time, 3 adapters for 2 slots: rank 0 evicts and rewrites slots, the worker follows
        evicting = [llm.generate(EVICT_PROMPT, MIXED_SP, reqs[a])[0] for a in EVICT_ORDER]
        healthy = llm.engine.is_healthy()
        classes = {type(m).__name__ for m in llm.engine.lora_manager.modules.values()}
        ran_ahead = llm.engine.num_launched_ahead if llm.engine.async_scheduling else None
    finally:
        llm.shutdown()
    return {
        "mixed": mixed, "greedy": greedy, "evicting": evicting, "healthy": healthy, "classes": classes,
        "ran_ahead": ran_ahead,
    }  # fmt: skip


@pytest.fixture(scope="module")
def tp1(tiny):
    return _run(*tiny, tp=1)


@pytest.fixture(scope="module", params=["default", "fully_sharded"])
def tp2(request, tiny):
    return request.param, _run(*tiny, tp=2, fully_sharded=request.param == "fully_sharded")


def _logprob_rows(out) -> list[dict[int, float]]:
    rows = [{t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs[1:]]
    return rows + [{t: lp.logprob for t, lp in d.items()} for d in out.outputs[0].logprobs]


def test_mixed_batch_logprobs_equal_tp1(tp1, tp2):
    mode, res = tp2
    assert res["healthy"]
    sharded = {c for c in res["classes"] if "Sharded" in c}
    if mode == "fully_sharded":  # qkv, o, gate_up, down
        assert sharded == {
            "MergedQKVParallelLinearWithShardedLoRA",
            "RowParallelLinearWithShardedLoRA",
            "MergedColumnParallelLinearWithShardedLoRA",
        }
    else:
        assert not sharded
    for (prompt, adapter), ref, got in zip(MIXED, tp1["mixed"], res["mixed"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids, (mode, adapter)
        ref_rows, got_rows = _logprob_rows(ref), _logprob_rows(got)
        assert len(got_rows) == len(prompt) - 1 + MIXED_SP.max_tokens
        for i, (r, g) in enumerate(zip(ref_rows, got_rows)):
            assert r.keys() == g.keys(), (mode, adapter, i)
            worst = max(abs(r[t] - g[t]) for t in r)
            assert worst <= ATOL, f"{mode} adapter={adapter} row {i}: |dlogprob| {worst:.2e} > {ATOL}"


def test_async_scheduling_runs_at_tp1_only(tp1, tp2):
    """Asked for at both sizes: TP=1 launches steps ahead, TP=2 runs them one by one (its workers
    would need each step's token ids from rank 0's device)."""
    assert tp1["ran_ahead"] > 0
    assert tp2[1]["ran_ahead"] is None


def test_adapters_change_the_output(tp1):
    """The comparisons are only worth something if the adapters matter: one prompt, base vs each adapter."""
    same = {a: _logprob_rows(o) for (p, a), o in zip(MIXED, tp1["mixed"]) if p == MIXED[0][0]}
    assert set(same) == {None, "lin", "emb"}
    base = same[None][0]  # logprobs after the first prompt token: the same context, only the adapter differs
    for a in ("lin", "emb"):
        row = same[a][0]
        assert row.keys() != base.keys() or max(abs(base[t] - row[t]) for t in base) > 1e-2, a


def test_slot_evictions_are_mirrored(tp1, tp2):
    mode, res = tp2
    for a, ref, got in zip(EVICT_ORDER, tp1["evicting"], res["evicting"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids, (mode, a)
        worst = max(abs(r[t] - g[t]) for r, g in zip(_logprob_rows(ref), _logprob_rows(got)) for t in r)
        assert worst <= ATOL, f"{mode} adapter={a}: {worst:.2e}"


def test_mixed_batch_matches_peft(tiny, tp2):
    mode, res = tp2
    model, adapters = tiny
    peft = peft_model(model, {n: adapters[n] for n in ("lin", "emb")})
    for (prompt, adapter), out in zip(MIXED, res["mixed"]):
        diff = max_logprob_diff(peft, out, prompt, [adapter or "__base__"])
        assert diff < 1e-4, f"{mode} adapter={adapter}: {diff:.2e} from PEFT"


def test_generate_greedy_tokens_equal_tp1(tp1, tp2):
    mode, res = tp2
    for ref, got in zip(tp1["greedy"], res["greedy"]):
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids, mode
        assert got.outputs[0].text == ref.outputs[0].text
    assert len({t for o in tp1["greedy"] for t in o.outputs[0].token_ids}) > 3, (
        "a degenerate model proves little"
    )
