"""Adapters at scale: many registered adapters through few slots and a small host cache.

Adapters here are written directly in PEFT's file format (random A/B, mixed ranks) so that 200 of
them are cheap to make; PEFT parity of the format itself is covered in test_peft_parity.py.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import make_tiny_model
from safetensors.torch import save_file

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.errors import UnknownAdapterError

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
HIDDEN, KV, INTER, LAYERS = 64, 32, 128, 2


def write_adapter(path, seed: int, rank: int, scale: float = 0.5) -> str:
    """A PEFT-format LoRA on q_proj, v_proj and down_proj of the tiny llama."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.v_proj": (HIDDEN, KV), "mlp.down_proj": (INTER, HIDDEN)}
    for layer in range(LAYERS):
        for mod, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("scale") / "base"
    make_tiny_model(d, "llama")
    return d


def _llm(base, **kw):
    args = dict(enable_lora=True, max_loras=4, max_cpu_loras=16, max_lora_rank=8, max_num_seqs=32)
    args.update(kw)
    return LLM(str(base), **args)


def _check_no_leaks(llm):
    eng = llm.engine
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert not eng.scheduler.running and not eng.scheduler.waiting
    mgr = eng.lora_manager
    assert sum(mgr._refs.values()) == 0
    assert mgr.num_resident <= mgr.max_loras
    assert all(i is None or i in mgr._registered for i in mgr._slot_ids)


def test_200_adapters_400_requests_random_order(base, tmp_path):
    ranks = [1, 2, 4, 8]
    reqs = [LoRARequest(f"a{i}", i + 1, write_adapter(tmp_path / f"a{i}", i, ranks[i % 4])) for i in range(200)]
    llm = _llm(base)
    for r in reqs:
        llm.add_lora(r)
    assert len(llm.list_loras()) == 200
    prompt_of = {r.lora_int_id: {"prompt_token_ids": [3 + r.lora_int_id % 50, 7, 9, 11 + r.lora_int_id % 7]} for r in reqs}
    alone = {}
    for r in reqs:
        alone[r.lora_int_id] = llm.generate([prompt_of[r.lora_int_id]], SP, lora_request=r)[0]
    mgr = llm.engine.lora_manager
    before = dict(mgr.stats)
    order = reqs + reqs
    random.Random(0).shuffle(order)
    outs = llm.generate([prompt_of[r.lora_int_id] for r in order], SP, lora_request=order)
    assert len(outs) == 400
    distinct = {tuple(alone[r.lora_int_id].outputs[0].token_ids) for r in reqs}
    assert len(distinct) > 50, "adapters should produce different outputs"
    for r, o in zip(order, outs):
        ref = alone[r.lora_int_id].outputs[0]
        assert o.outputs[0].token_ids == ref.token_ids
        got = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        want = [lp[t].logprob for lp, t in zip(ref.logprobs, ref.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    stats = mgr.stats
    assert stats["slot_evictions"] > before.get("slot_evictions", 0)
    assert stats["disk_loads"] > before.get("disk_loads", 0)  # evicted from the 16-entry host cache, reloaded
    assert stats["host_evictions"] > 0
    assert mgr.num_host_cached <= 16
    _check_no_leaks(llm)


def test_remove_while_in_flight_finishes_then_unknown(base, tmp_path):
    llm = _llm(base)
    eng = llm.engine
    path = write_adapter(tmp_path / "x", 1, 4)
    req = LoRARequest("x", 1, path)
    prompt = [5, 6, 7]
    want = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), lora_request=req)[0]
    eng.add_request("r1", None, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), prompt, req)
    eng.step()
    eng.step()
    assert llm.remove_lora(1)
    assert 1 not in llm.list_loras()
    done = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done = o
    assert done.outputs[0].token_ids == want.outputs[0].token_ids  # finished on the weights it started with
    assert done.outputs[0].finish_reason == "length"
    with pytest.raises(UnknownAdapterError, match="unknown adapter"):
        llm.generate([{"prompt_token_ids": prompt}], SP, lora_request=LoRARequest("x", 1))
    _check_no_leaks(llm)
    assert llm.engine.lora_manager.slot_of(1) is None


def test_readding_an_id_still_in_use_is_refused(base, tmp_path):
    llm = _llm(base)
    eng = llm.engine
    req = LoRARequest("x", 1, write_adapter(tmp_path / "x", 1, 4))
    eng.add_request("r1", None, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), [5, 6, 7], req)
    eng.step()
    llm.remove_lora(1)
    with pytest.raises(Exception, match="new lora_int_id"):
        llm.add_lora(LoRARequest("x", 1, write_adapter(tmp_path / "x2", 2, 4)))
    while eng.has_unfinished_requests():
        eng.step()
    _check_no_leaks(llm)


def test_reload_same_name_new_weights_is_used(base, tmp_path):
    llm = _llm(base)
    prompt = [{"prompt_token_ids": [9, 8, 7, 6]}]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    old = LoRARequest("style", 1, write_adapter(tmp_path / "v1", 1, 4))
    out_old = llm.generate(prompt, sp, lora_request=old)[0]
    llm.remove_lora(1)
    # same name, same dir, new weights on disk
    write_adapter(tmp_path / "v1", 2, 4, scale=0.8)
    new = LoRARequest("style", 2, str(tmp_path / "v1"))
    out_new = llm.generate(prompt, sp, lora_request=new)[0]
    fresh = _llm(base).generate(prompt, sp, lora_request=new)[0]
    assert out_new.outputs[0].token_ids == fresh.outputs[0].token_ids
    lp = lambda o: [d[t].logprob for d, t in zip(o.prompt_logprobs[1:], prompt[0]["prompt_token_ids"][1:])]  # noqa: E731
    assert max(abs(a - b) for a, b in zip(lp(out_new), lp(fresh))) < 1e-6
    assert max(abs(a - b) for a, b in zip(lp(out_new), lp(out_old))) > 1e-3  # the old weights are gone
    _check_no_leaks(llm)


def test_malformed_adapter_at_add_time(base, tmp_path):
    llm = _llm(base)
    bad = tmp_path / "bad"
    write_adapter(bad, 1, 4)
    (bad / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    with pytest.raises(Exception, match="invalid JSON"):
        llm.add_lora(LoRARequest("bad", 1, str(bad)))
    assert llm.list_loras() == []
    assert llm.generate([{"prompt_token_ids": [5, 6]}], SP)[0].outputs[0].finish_reason == "length"


def test_cold_adapter_is_not_starved_by_hot_ones(base, tmp_path):
    """With every slot held by busy adapters, a request on a third adapter is admitted within a bounded wait."""
    llm = _llm(base, max_loras=2, max_cpu_loras=4)
    eng = llm.engine
    hot = [LoRARequest(f"h{i}", i + 1, write_adapter(tmp_path / f"h{i}", i, 2)) for i in range(2)]
    cold = LoRARequest("cold", 9, write_adapter(tmp_path / "cold", 9, 2))
    for r in hot + [cold]:
        llm.add_lora(r)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    n = 0
    for step in range(200):
        for r in hot:  # a steady stream of hot traffic keeps both slots busy
            eng.add_request(f"hot{n}", None, sp, [5, 6, 7], r)
            n += 1
        if step == 2:
            eng.add_request("cold", None, sp, [5, 6, 7], cold)
        finished = [o for o in eng.step() if o.finished and o.request_id == "cold"]
        if finished:
            break
    assert finished, "the cold adapter's request never finished"
    assert step < 2 + eng.scheduler.max_adapter_wait_steps + 20
    assert eng.scheduler.num_drains >= 1
    for rid in list(eng.requests):
        eng.abort_request(rid)
    _check_no_leaks(llm)


def test_pinned_adapter_stays_resident(base, tmp_path):
    llm = _llm(base, max_loras=2, max_cpu_loras=2)
    reqs = [LoRARequest(f"p{i}", i + 1, write_adapter(tmp_path / f"p{i}", i, 2)) for i in range(5)]
    for r in reqs:
        llm.add_lora(r)
    llm.generate([{"prompt_token_ids": [5, 6]}], SP, lora_request=reqs[0])
    assert llm.pin_lora(1)
    for r in reqs[1:]:
        llm.generate([{"prompt_token_ids": [5, 6]}], SP, lora_request=r)
    mgr = llm.engine.lora_manager
    assert mgr.slot_of(1) is not None and 1 in mgr._host
    with pytest.raises(Exception, match="pin"):
        llm.pin_lora(2)  # one slot must stay free for the others
    _check_no_leaks(llm)


def test_a_slot_write_a_module_refuses_leaves_the_slot_empty(base, tmp_path, monkeypatch):
    """A module that refuses an adapter while its slot is written (e.g. delta_in_k's range check, on the GPU) raises
    to the caller; the slot is left empty (every module's rows zero), not half written nor still listed under the
    adapter it evicted, and the next adapter takes it and serves as a fresh engine does."""
    llm = _llm(base, max_loras=1)
    prompt = [{"prompt_token_ids": [9, 8, 7, 6]}]
    a, b, c = (LoRARequest(n, i + 1, write_adapter(tmp_path / n, i + 1, 4)) for i, n in enumerate("abc"))
    llm.generate(prompt, SP, lora_request=a)
    mgr = llm.engine.lora_manager
    assert mgr._slot_ids == [1]
    path, down = next((p, m) for p, m in mgr.modules.items() if p.endswith("layers.1.mlp.down_proj"))

    def refusing(index, lora_a, lora_b):
        raise ValueError("refused by the test")

    monkeypatch.setattr(down, "set_lora", refusing)
    llm.add_lora(b)
    with pytest.raises(ValueError, match="refused by the test"):
        mgr.activate(2, set())
    assert mgr._slot_ids == [None] and mgr.slot_of(1) is None and mgr.slot_of(2) is None
    assert all(a_.abs().sum() == 0 for m in mgr.modules.values() for a_ in getattr(m, "lora_a_stacked", ())), (
        "every module's slot is zero, the ones written before the refusal too"
    )
    monkeypatch.undo()
    got = llm.generate(prompt, SP, lora_request=c)[0]
    want = _llm(base, max_loras=1).generate(prompt, SP, lora_request=c)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert mgr._slot_ids == [3]
    _check_no_leaks(llm)
