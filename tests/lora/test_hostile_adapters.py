"""Hostile and broken adapters (issue 43): refused before they are served, naming the adapter, the tensor or
key and the problem; nothing stays registered; the engine's greedy answers are what they were. And an
adapter id stays one set of weights: files rewritten or swapped for links after a host-cache eviction fail
that adapter's requests instead of being served."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_model
from safetensors.torch import load_file, save_file

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.errors import (
    LoRAError,
    LoRAFormatError,
    LoRALoadCancelledError,
    LoRAPathError,
    LoRAUnsupportedFeatureError,
    LoRAValueError,
)
from loraserve.lora.files import MAX_CONFIG_BYTES, confine
from loraserve.lora.peft import load_adapter

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
GOOD = 1
_ids = itertools.count(1000)  # a fresh adapter id per parametrized case


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    base = root / "base"
    make_tiny_model(base, "llama")
    kw = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    good = make_peft_adapter(base, root / "good", seed=1, **kw)
    make_peft_adapter(base, root / "other", seed=2, **kw)
    make_peft_adapter(base, root / "third", seed=3, **kw)
    # max_cpu_loras=1: registering or using another adapter evicts the last one from the host cache
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16)
    llm.add_lora(LoRARequest("good", GOOD, str(good)))
    return root, llm


def _greedy(llm, lora=None):
    out = llm.generate([PROMPT], SP, lora_request=lora)[0]
    assert out.error is None, out.error
    return out.outputs[0].token_ids


def _variant(root, name, config_update=None, scale=None, poke=None, src="good"):
    """A copy of adapter ``src``: config keys replaced, every tensor times ``scale``, or ``poke(sd)`` applied."""
    d = root / name
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(root / src, d)
    if config_update is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(config_update)
        (d / "adapter_config.json").write_text(json.dumps(cfg))  # NaN / Infinity are written as JSON allows
    if scale is not None or poke is not None:
        sd = load_file(str(d / "adapter_model.safetensors"))
        if scale is not None:
            sd = {k: v * scale for k, v in sd.items()}
        if poke is not None:
            poke(sd)
        save_file(sd, str(d / "adapter_model.safetensors"))
    return d


def _nothing_registered(llm, lid: int) -> None:
    lm = llm.engine.lora_manager
    assert lid not in llm.list_loras()
    assert lid not in lm._host and lid not in lm._slot_ids and lid not in lm._sources
    assert lid not in lm._loading and lid not in lm._removed and lid not in lm._refs


def _assert_refused(setup, req, exc_type, *needles):
    """The load of ``req`` raises ``exc_type`` naming the adapter dir and ``needles``; nothing is registered;
    the base model's and the good adapter's greedy answers are unchanged and every KV block is free."""
    root, llm = setup
    good = LoRARequest("good", GOOD, str(root / "good"))
    before = _greedy(llm), _greedy(llm, good)
    with pytest.raises(exc_type) as info:
        llm.generate([PROMPT], SP, lora_request=req)
    msg = str(info.value)
    assert isinstance(info.value, LoRAError)
    for n in (os.path.basename(req.lora_path), *needles):
        assert n in msg, f"{n!r} not in {msg!r}"
    _nothing_registered(llm, req.lora_int_id)
    assert (_greedy(llm), _greedy(llm, good)) == before
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    return msg


def _first(sd, part):
    return next(k for k in sorted(sd) if part in k)


# ---- values ---------------------------------------------------------------------------------------


def test_nan_weight_is_refused_naming_the_tensor(setup):
    def poke(sd):
        sd[_first(sd, "layers.1.self_attn.v_proj.lora_A")][3, 7] = float("nan")

    d = _variant(setup[0], "nan_w", poke=poke)
    _assert_refused(
        setup, LoRARequest("nan", 100, str(d)), LoRAValueError, "layers.1.self_attn.v_proj.lora_A", "1 NaN"
    )


def test_inf_weight_is_refused_naming_the_tensor(setup):
    def poke(sd):
        sd[_first(sd, "layers.0.self_attn.q_proj.lora_B")][0, 0] = float("-inf")

    d = _variant(setup[0], "inf_w", poke=poke)
    _assert_refused(
        setup, LoRARequest("inf", 101, str(d)), LoRAValueError, "layers.0.self_attn.q_proj.lora_B", "1 inf"
    )


def test_weights_times_1e30_are_refused_by_the_overflow_bound(setup):
    d = _variant(setup[0], "x1e30", scale=1e30)  # every value stays finite in fp32; their products do not
    msg = _assert_refused(
        setup, LoRARequest("x1e30", 102, str(d)), LoRAValueError, "module", "torch.float32", "overflow"
    )
    assert "layers.0.self_attn.q_proj" in msg


def test_one_b_times_1e30_is_refused_before_a_norm_overflows(setup):
    """Only one lora_B scaled: the delta (~1e32) fits fp32, but the next norm's sum of squares would not."""

    def scale_first_b(sd):
        key = next(k for k in sorted(sd) if "lora_B" in k)
        sd[key] = sd[key] * 1e30

    d = _variant(setup[0], "one_b_x1e30", poke=scale_first_b)
    msg = _assert_refused(
        setup, LoRARequest("one_b_x1e30", 103, str(d)), LoRAValueError, "module", "sum of squares"
    )
    assert "layers.0" in msg


@pytest.mark.parametrize(
    "update, needles",
    [
        ({"lora_alpha": float("nan")}, ("lora_alpha", "nan")),
        ({"lora_alpha": float("inf")}, ("lora_alpha", "inf")),
        ({"lora_alpha": 10**400}, ("lora_alpha", "finite")),
        ({"alpha_pattern": {"q_proj": float("-inf")}}, ("alpha_pattern", "q_proj")),
        ({"rank_pattern": {"v_proj": 0}}, ("rank_pattern", "v_proj", "positive integer")),
        ({"r": 0}, ("r must be a positive integer",)),
        ({"modules_to_save": [float("nan")]}, ("modules_to_save[0]", "nan")),
    ],
    ids=[
        "alpha_nan",
        "alpha_inf",
        "alpha_huge_int",
        "alpha_pattern_inf",
        "rank_pattern_0",
        "r_0",
        "nested_nan",
    ],
)
def test_config_values_must_be_finite(setup, update, needles):
    d = _variant(setup[0], "cfg_" + "_".join(update), config_update=update)
    _assert_refused(
        setup, LoRARequest("cfg", next(_ids), str(d)), LoRAValueError, "adapter_config.json", *needles
    )


# ---- sizes and patterns ---------------------------------------------------------------------------


def test_huge_config_is_refused_by_its_size_without_reading_it(setup):
    d = _variant(setup[0], "huge_cfg")
    with open(d / "adapter_config.json", "r+b") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB that a full read would take seconds and 2 GiB of memory for
    t0 = time.perf_counter()
    with pytest.raises(LoRAFormatError, match=f"{2 << 30} bytes, more than the {MAX_CONFIG_BYTES}"):
        load_adapter(d, "huge", 16)
    assert time.perf_counter() - t0 < 5  # a full read would take far longer (and 2 GiB of memory)
    _assert_refused(
        setup, LoRARequest("huge", 130, str(d)), LoRAFormatError, "adapter_config.json", f"{2 << 30} bytes"
    )


def test_config_that_is_a_fifo_is_refused_without_blocking(setup):
    d = _variant(setup[0], "fifo_cfg")
    (d / "adapter_config.json").unlink()
    os.mkfifo(d / "adapter_config.json")  # opening it for reading would wait for a writer for ever
    _assert_refused(
        setup, LoRARequest("fifo", 131, str(d)), LoRAPathError, "adapter_config.json", "not a regular file"
    )


HOSTILE_KEY = r"(.+)+\.nomatch"  # Python's re: ~2^len(name) steps per module name (minutes for 31 characters)


def test_backtracking_pattern_keys_are_matched_in_linear_time_with_peft_semantics(setup):
    root, llm = setup
    # the hostile keys come first, so every module is matched against them before a plain key decides
    hostile = {HOSTILE_KEY: 4, r"(q|q)+_proj|(.*)*(.*)*zz": 32, r"(\w+\.?)+!": 2}
    d = _variant(
        root, "hostile_keys", config_update={"alpha_pattern": hostile, "rank_pattern": {HOSTILE_KEY: 4}}
    )
    plain = _variant(root, "plain_keys", config_update={"alpha_pattern": {"q_proj": 32}})
    t0 = time.perf_counter()
    adapter = load_adapter(d, "hostile", 16)
    assert time.perf_counter() - t0 < 5
    q = [m for n, m in adapter.modules.items() if n.endswith("q_proj")]
    v = [m for n, m in adapter.modules.items() if n.endswith("v_proj")]
    assert q and v and all(m.rank == 8 for m in q + v)  # the rank_pattern key matches nothing: r stays 8
    assert all(m.scaling == 32 / 8 for m in q) and all(m.scaling == 16 / 8 for m in v)
    want = _greedy(llm, LoRARequest("plain", 141, str(plain)))
    assert _greedy(llm, LoRARequest("hostile", 140, str(d))) == want


@pytest.mark.parametrize(
    "update, exc_type, needles",
    [
        (
            {"rank_pattern": {"(?=.*q)q_proj": 8}},
            LoRAUnsupportedFeatureError,
            ("(?=.*q)q_proj", "lookaround"),
        ),
        ({"rank_pattern": {"q" * 5000: 8}}, LoRAFormatError, ("rank_pattern", "longer than 512")),
        (
            {"alpha_pattern": {f"k{i}": 8 for i in range(5000)}},
            LoRAFormatError,
            ("alpha_pattern has 5000 keys",),
        ),
        ({"alpha_pattern": {"(x{100}){100}": 8}}, LoRAUnsupportedFeatureError, ("automaton states",)),
        ({"target_modules": "(a+)+" * 20000}, LoRAFormatError, ("target_modules", "100000 characters")),
    ],
    ids=["lookahead", "long_key", "many_keys", "huge_repeat", "long_target_regex"],
)
def test_patterns_beyond_the_limits_are_refused(setup, update, exc_type, needles):
    d = _variant(setup[0], "pat_" + "_".join(update), config_update=update)
    _assert_refused(setup, LoRARequest("pat", next(_ids), str(d)), exc_type, "adapter_config.json", *needles)


# ---- one id, one set of weights -------------------------------------------------------------------


def _evict(llm, root, lid: int) -> None:
    """Use adapter 'other' so that ``lid`` leaves the host cache and its device slot."""
    _greedy(llm, LoRARequest("other", 90, str(root / "other")))
    lm = llm.engine.lora_manager
    assert lid not in lm._host and lm.slot_of(lid) is None


def _failed(llm, req, *needles) -> None:
    out = llm.generate([PROMPT], SP, lora_request=req)[0]
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    for n in needles:
        assert n in out.error, f"{n!r} not in {out.error!r}"
    lm = llm.engine.lora_manager
    assert req.lora_int_id not in lm._host and lm.slot_of(req.lora_int_id) is None  # never served


def test_registration_records_real_paths_and_sha256(setup):
    root, llm = setup
    (src,) = llm.engine.lora_manager.registered_files(GOOD)
    assert src.real_dir == str((root / "good").resolve())
    assert [Path(p).name for p, _ in src.files] == ["adapter_config.json", "adapter_model.safetensors"]
    for p, digest in src.files:
        assert hashlib.sha256(Path(p).read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("which", ["adapter_model.safetensors", "adapter_config.json"])
def test_file_rewritten_after_eviction_fails_its_requests_not_served(setup, which):
    root, llm = setup
    d = _variant(root, f"victim_{which}")
    lid = 200 + len(which)
    req = LoRARequest("victim", lid, str(d))
    want = _greedy(llm, req)
    base = _greedy(llm)
    _evict(llm, root, lid)
    original = (d / which).read_bytes()
    if which == "adapter_config.json":
        (d / which).write_text((d / which).read_text().replace('"lora_alpha": 16', '"lora_alpha": 64'))
    else:
        shutil.copy(root / "third" / which, d / which)  # same shapes, other weights
    assert (d / which).read_bytes() != original
    _failed(llm, req, "victim", which, "changed on disk", "sha256")
    assert _greedy(llm) == base
    (d / which).write_bytes(original)  # the registered weights again: served again, the same answer
    assert _greedy(llm, req) == want


def test_a_failed_reload_fails_its_requests_while_other_traffic_runs(setup):
    """The reload's error reaches its requests at the next step, not once the engine is idle."""
    root, llm = setup
    d = _variant(root, "victim_busy")
    req = LoRARequest("victim_busy", 250, str(d))
    _greedy(llm, req)
    _evict(llm, root, 250)
    shutil.copy(root / "third" / "adapter_model.safetensors", d / "adapter_model.safetensors")
    eng = llm.engine
    eng.add_request(
        "busy-base", None, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), [5, 6, 7]
    )
    eng.add_request("busy-victim", None, SP, PROMPT["prompt_token_ids"], req)
    for _ in range(200):
        outs = {o.request_id: o for o in eng.step()}
        if "busy-victim" in outs and outs["busy-victim"].finished:
            break
    assert "changed on disk" in outs["busy-victim"].error
    assert "busy-base" in eng.requests, "the victim failed only once the other traffic ended"
    while eng.has_unfinished_requests():
        eng.step()


def test_file_swapped_for_a_link_outside_the_root_after_eviction_is_refused(setup, tmp_path):
    root, llm = setup
    lora_root = root / "lora_root"
    d = _variant(root, "lora_root/confined")
    outside = tmp_path / "outside.safetensors"
    shutil.copy(d / "adapter_model.safetensors", outside)  # the same bytes: only the path check can catch it
    req = LoRARequest("confined", 300, str(confine(d, lora_root)), lora_root=str(lora_root))
    want = _greedy(llm, req)
    _evict(llm, root, 300)
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.safetensors").symlink_to(outside)
    _failed(llm, req, "adapter_model.safetensors links outside --lora-root")
    # without a root, the real paths recorded at registration catch the same swap
    d2 = _variant(root, "unconfined")
    req2 = LoRARequest("unconfined", 301, str(d2))
    assert _greedy(llm, req2) == want  # the same weights as "confined"
    _evict(llm, root, 301)
    shutil.copy(d2 / "adapter_model.safetensors", tmp_path / "outside2.safetensors")
    (d2 / "adapter_model.safetensors").unlink()
    (d2 / "adapter_model.safetensors").symlink_to(tmp_path / "outside2.safetensors")
    _failed(llm, req2, "now resolves to", "registered from")


def test_confine_refuses_escapes(setup, tmp_path):
    root, _ = setup
    lora_root = tmp_path / "r"
    inside = lora_root / "a"
    shutil.copytree(root / "good", inside)
    assert confine("a", lora_root) == inside.resolve()
    for given, needle in (
        ("..", "resolves outside"),
        (str(root / "good"), "resolves outside"),
        ("a\0b", "NUL byte"),
        ("~no_such_user_43/x", "lora_path"),
        ("missing", "does not exist"),
    ):
        with pytest.raises(LoRAPathError, match=needle):
            confine(given, lora_root)
    (inside / "README.md").unlink()
    (inside / "README.md").symlink_to(root / "good" / "README.md")
    with pytest.raises(LoRAPathError, match="README.md links outside"):
        confine("a", lora_root)


# ---- cancellation ---------------------------------------------------------------------------------


def test_a_set_cancel_event_stops_a_load(setup):
    root, _ = setup
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoRALoadCancelledError, match="cancelled"):
        load_adapter(root / "good", "good", 16, torch.float32, cancel=cancel)


def test_close_cancels_loads_and_leaves_no_thread_to_wait_for(setup):
    root, _ = setup
    llm = LLM(str(root / "base"), enable_lora=True, max_loras=1, max_lora_rank=16)
    lm = llm.engine.lora_manager
    assert lm._loader.submit(lambda: 7).result(timeout=5) == 7  # starts the loader thread
    loaders = [t for t in threading.enumerate() if t.name == "lora-loader"]
    assert loaders and all(t.daemon for t in loaders)  # an interpreter exit never joins it
    lm.close()
    with pytest.raises(LoRALoadCancelledError):
        lm.prepare(LoRARequest("late", 1, str(root / "good")))
    fut = lm._loader.submit(lambda: 1)  # a background reload asked for after close() fails at once
    assert isinstance(fut.exception(timeout=1), LoRALoadCancelledError)
    _nothing_registered(llm, 1)
