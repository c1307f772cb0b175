"""Fuzz the completions and chat schemas (hypothesis): random and extreme JSON values in every field
never get a 5xx (nor an error event of one in a stream), the engine stays healthy after each, and a
greedy request at the end gets the same answer as at the start. Bounded: a fixed number of examples,
derandomized (the same bodies every run), a few seconds each."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from conftest import API_KEY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
GREEDY = {"model": "a0", "prompt": "t5 t9 t17 t33 t65", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
HTTP = httpx.Client(timeout=60)

EXTREMES = [
    None, True, False, 0, 1, -1, 2, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1,
    10**30, 0.0, -0.0, 0.5, 1.5, -1e-9, 1e-5, 1e4, 1e39, -1e39, 1e308, 5e-324, math.nan, math.inf,
    -math.inf, "", "t5", "t5 t1", "\ud800", "a\udfffb", "\x00", "x" * 300, [], [None], [1e39], [-1],
    [2**64], [0, 255, 256], ["t5", ""], ["\ud800"], [[5], []], [[5, 6], [7]], {}, {"a": math.nan},
    {"5": 1e39}, {"type": "text", "text": "\ud800"},
]  # fmt: skip


def text(max_size: int):
    """Random text, words of the tiny vocabulary ("t5 t9"), half of it ending in a lone surrogate."""
    words = st.lists(st.integers(0, 300), max_size=max_size // 3).map(
        lambda ids: " ".join(f"t{i}" for i in ids)
    )
    tail = st.sampled_from(["", "\udc00"])
    return st.tuples(st.one_of(st.text(max_size=max_size), words), tail).map("".join)


VALUE = st.one_of(
    st.sampled_from(EXTREMES),
    st.integers(min_value=-3, max_value=12),
    st.floats(allow_nan=True, allow_infinity=True),
    text(12),
    st.lists(st.integers(min_value=-2, max_value=300), max_size=4),
    st.lists(text(4), max_size=3),
    st.dictionaries(text(4), st.sampled_from(EXTREMES[:30]), max_size=2),
)
SAMPLING = [
    "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p", "min_tokens", "ignore_eos",
    "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens", "no_such_field",
]  # fmt: skip
# NOTE: the prompt and messages, where most of the hostile text goes, are listed 4 times: 4x as likely changed
COMPLETION = [*SAMPLING, "prompt", "logprobs", "echo", "best_of", "suffix", *["prompt"] * 3]
CHAT = [
    *SAMPLING, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt",
    "tools", "tool_choice", "response_format", "parallel_tool_calls", *["messages"] * 3,
]  # fmt: skip
IDS = st.lists(st.integers(min_value=0, max_value=255), min_size=1, max_size=6)
EDGE = {  # values at and inside the edges of each field's range: these reach the engine
    "model": st.sampled_from(["a0", "a1", "tiny-llama", None, "nope", "\ud800", "", 5]),
    "prompt": st.one_of(text(20), IDS, st.lists(text(8), max_size=3), st.lists(IDS, max_size=3)),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "\ud800", "", 5])},
            optional={"content": st.one_of(text(12), VALUE), "name": VALUE},
        ),
        max_size=3,
    ),
    "temperature": st.one_of(st.sampled_from([0, 1e-6, 1e-5, 2, 1e4]), st.floats(0, 1e4)),
    "top_p": st.one_of(st.sampled_from([5e-324, 1e-9, 1.0]), st.floats(0, 1, exclude_min=True)),
    "top_k": st.sampled_from([-1, 0, 1, 2, 255, 256, 10**9, 2**62]),
    "min_p": st.one_of(st.sampled_from([0, 1e-9, 1.0]), st.floats(0, 1)),
    "seed": st.one_of(st.sampled_from([-(2**63), -1, 2**63, 2**64 - 9]), st.integers(-(2**63), 2**64 - 9)),
    "n": st.integers(1, 8),
    "max_tokens": st.integers(1, 3),
    "max_completion_tokens": st.integers(1, 3),
    "min_tokens": st.integers(0, 3),
    "stop": st.one_of(text(6), st.lists(text(6), max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=4),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 20)),
    "top_logprobs": st.integers(0, 20),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": text(8),
    "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0),
    "logit_bias": st.just({}),
    "best_of": st.just(1),
    "suffix": st.just(""),
    "tools": st.just([]),
    "tool_choice": st.sampled_from(["none", None]),
    "response_format": st.just({"type": "text"}),
    **{
        k: st.booleans()
        for k in ("stream", "echo", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
    },
}


def bodies(names: list[str], base: dict):
    """``base`` with 1-6 of ``names`` set to edge or random values (1 body in 10 is not an object)."""

    def one_in(n: int, rare, common):
        return st.integers(1, n).flatmap(lambda i: rare if i == 1 else common)

    def value(k: str):
        return one_in(4, VALUE, EDGE[k]) if k in EDGE else VALUE  # 3 of 4 from the edges

    changes = st.lists(st.sampled_from(names), min_size=1, max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: value(k) for k in keys})
    )
    objects = changes.map(lambda c: {**base, **c})
    return one_in(10, VALUE.filter(lambda v: not isinstance(v, dict)), objects)


def check(server, path: str, body) -> None:
    raw = json.dumps(body, allow_nan=True)  # NaN / Infinity / lone-surrogate escapes, as a client may send
    with HTTP.stream("POST", server.url + path, content=raw, headers=AUTH) as r:
        text = r.read().decode()
    assert r.status_code < 500, (body, r.status_code, text)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                assert json.loads(line[6:])["error"]["code"] < 500, (body, line)
    assert HTTP.get(server.url + "/health").status_code == 200, body


def answer(server) -> str:
    r = HTTP.post(server.url + "/v1/completions", json=GREEDY, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference(server) -> str:
    return answer(server)


FUZZ = settings(
    max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)


def test_fuzz_completions(server, reference):
    @FUZZ
    @given(body=bodies(COMPLETION, {"model": "a0", "prompt": "t5 t9", "max_tokens": 2}))
    def fuzz(body):
        check(server, "/v1/completions", body)

    fuzz()
    assert answer(server) == reference


def test_fuzz_chat(server, reference):
    @FUZZ
    @given(
        body=bodies(CHAT, {"model": "a0", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 2})
    )
    def fuzz(body):
        check(server, "/v1/chat/completions", body)

    fuzz()
    assert answer(server) == reference
