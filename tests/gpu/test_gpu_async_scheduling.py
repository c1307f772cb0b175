"""Async scheduling on the GPU, with CUDA graphs (the defaults on CUDA).

- The tokens, texts and finish reasons equal the synchronous engine's, for a mixed LoRA batch with
  EOS and stop-token stops, min_tokens, greedy and seeded sampling; logprobs to 1e-4 (steps with a
  discarded row can replay another batch bucket than the synchronous engine's).
- Launching a step ahead never waits for the device: with torch's sync debug mode set to "error"
  around ``LLMEngine._launch_ahead`` (schedule, prepare, the graph's input fill and replay, sampling,
  logprobs, the non-blocking copy back), any host<->device synchronization raises.

Runs only where CUDA is present (the device machine); CI has no GPU.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from collections import Counter  # noqa: E402

from helpers import VOCAB, make_peft_adapter, make_tiny_model  # noqa: E402

from loraserve import LLM, LoRARequest, SamplingParams  # noqa: E402

N = 12
PROMPTS = [
    torch.randint(2, VOCAB, (int(n),), generator=torch.Generator().manual_seed(500 + i)).tolist()
    for i, n in enumerate(torch.randint(3, 30, (N,), generator=torch.Generator().manual_seed(11)))
]
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A base model, the same weights with an EOS its greedy continuations reach, and 3 adapters."""
    root = tmp_path_factory.mktemp("gpu_async")
    make_tiny_model(root / "base", "llama", initializer_range=0.1, **SHAPE)
    loras = [
        LoRARequest(name, i + 1, str(make_peft_adapter(root / "base", root / name, seed=i + 1, **kw)))
        for i, (name, kw) in enumerate(
            {
                "all16": dict(r=16, lora_alpha=32, target_modules="all-linear"),
                "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                "mlp8": dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
            }.items()
        )
    ]
    llm = make(root / "base", False)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    trajectories = [o.outputs[0].token_ids for o in llm.generate(prompts(), greedy)]
    eos = Counter(t for tr in trajectories for t in tr[2:]).most_common(1)[0][0]
    make_tiny_model(root / "eos", "llama", initializer_range=0.1, eos_token_id=eos, **SHAPE)
    return root / "eos", loras, trajectories


def prompts() -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS]


def make(path, async_scheduling: bool) -> LLM:
    return LLM(
        str(path), device="cuda", dtype="float32", max_num_seqs=16, num_kv_blocks=256, max_model_len=128,
        enable_lora=True, max_loras=4, max_lora_rank=16, async_scheduling=async_scheduling,
    )  # fmt: skip


def params(i: int, trajectory: list[int], seeded: bool) -> SamplingParams:
    kw: dict = {"max_tokens": 10 + (i * 5) % 14, "logprobs": 1}
    kw.update({"temperature": 0.9, "top_p": 0.9, "seed": 40 + i} if seeded else {"temperature": 0})
    if i % 3 == 1:
        kw["stop_token_ids"] = [trajectory[4]]
    elif i % 3 == 2:
        kw["min_tokens"] = 5
    return SamplingParams(**kw)


def run(llm: LLM, models, seeded: bool):
    _, loras, trajectories = models
    sps = [params(i, trajectories[i], seeded) for i in range(N)]
    reqs = [([None] + loras)[i % 4] for i in range(N)]
    return llm.generate(prompts(), sps, lora_request=reqs)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_graphs_with_async_scheduling_equal_sync(models, seeded):
    sync, ahead = make(models[0], False), make(models[0], True)
    ref, got = run(sync, models, seeded), run(ahead, models, seeded)
    assert ahead.engine.runner.graphs.stats["replays"] > 0 and ahead.engine.num_launched_ahead > 0
    assert any(c.finish_reason == "stop" for o in ref for c in o.outputs), "nothing stopped early"
    for i, (a, b) in enumerate(zip(ref, got)):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason) == (
            ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason
        ), i  # fmt: skip
        lp = [abs(da[t].logprob - db[t].logprob) for da, db, t in zip(ca.logprobs, cb.logprobs, ca.token_ids)]
        assert max(lp) < 1e-4, (i, max(lp))


def test_the_sync_debug_mode_catches_a_sync():
    """Guard: the check below is only worth something if a pageable copy up does raise."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2, 3]).to("cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_launching_ahead_never_waits_for_the_device(models, seeded):
    """After a warm-up run (graphs captured, adapters in their slots, generators made), a second
    identical run launches steps ahead with every host sync an error."""
    llm = make(models[0], True)
    run(llm, models, seeded)  # warm-up
    eng = llm.engine
    real = eng._launch_ahead
    checked = {"launched": 0}

    def launch_ahead(current, clock):
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = real(current, clock)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked["launched"] += launched is not None
        return launched

    eng._launch_ahead = launch_ahead
    replays = eng.runner.graphs.stats["replays"]
    run(llm, models, seeded)
    assert checked["launched"] > 0 and eng.runner.graphs.stats["replays"] > replays
