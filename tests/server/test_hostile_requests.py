"""Hostile and careless request bodies (issue 43) get a 4xx naming the field, before the engine sees
them; afterwards the server is healthy and a greedy request gets the same answer as before."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import API_KEY, ServerThread, make_engine

PROMPT = "t5 t9 t17 t33 t65"
AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
JSON = {"Content-Type": "application/json"}
GREEDY = {"model": "a0", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
HTTP = httpx.Client(timeout=30)  # one connection pool: a client per call costs ~25 ms


def answer(url: str, headers=AUTH) -> str:
    """The greedy answer of adapter a0 (of the base model on a server without an API key)."""
    body = GREEDY if "Authorization" in headers else {**GREEDY, "model": None}
    r = HTTP.post(url + "/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference(server) -> str:
    return answer(server.url)


def post(url: str, path: str, raw: str | bytes, headers=AUTH) -> httpx.Response:
    """``raw`` is sent as is: JSON's NaN, Infinity and lone-surrogate escapes need no encoder's consent."""
    return HTTP.post(url + path, content=raw, headers=headers)


def check_refused(r: httpx.Response, status: int, field: str | None, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"].endswith("Error")
    if field is not None:
        assert err["param"] == field, err
        assert field in err["message"], err["message"]
    for w in words:
        assert w in err["message"], err["message"]


def check_still_serving(url: str, reference: str, headers=AUTH) -> None:
    assert HTTP.get(url + "/health").status_code == 200
    assert answer(url, headers) == reference


def fields(body: dict) -> str:
    """The body's JSON text without its braces, so a case can splice raw JSON after it."""
    return json.dumps(body)[1:-1]


BASE = fields({"model": "a0", "prompt": PROMPT, "max_tokens": 4})

# (raw JSON fields after BASE, status, field named, words in the message)
COMPLETIONS = [
    # the bodies of issue 43 that killed the engine
    ('"temperature": NaN', 400, "temperature", "finite"),
    ('"temperature": Infinity, "min_tokens": 2', 400, "temperature", "finite"),
    ('"temperature": 1e39, "min_tokens": 2', 400, "temperature", "finite"),
    ('"stop_token_ids": [1000000000], "min_tokens": 2', 400, "stop_token_ids", "vocabulary"),
    ('"stop_token_ids": [-100000], "min_tokens": 2', 400, "stop_token_ids", "vocabulary"),
    ('"seed": 18446744073709551616', 400, "seed", "64-bit"),
    ('"seed": 18446744073709551615, "n": 2', 400, "seed", "seed + n - 1"),
    # and their relatives
    ('"temperature": -Infinity', 400, "temperature", "finite"),
    ('"top_p": NaN', 400, "top_p", "finite"),
    ('"min_p": 1.5', 400, "min_p", "[0, 1]"),
    ('"top_k": -2', 400, "top_k", "top_k"),
    ('"top_k": 2.5', 400, "top_k", "integer"),
    ('"max_tokens": 100000000000000000000000', 400, "max_tokens", "maximum context length"),
    ('"min_tokens": -1', 400, "min_tokens", "min_tokens"),
    ('"seed": -9223372036854775809', 400, "seed", "64-bit"),
    ('"n": 100000000000000000000000000', 400, "n", "--max-n"),
    ('"logprobs": -1', 400, "logprobs", "logprobs"),
    ('"presence_penalty": NaN', 400, "presence_penalty", "finite"),
    ('"frequency_penalty": 3', 400, "frequency_penalty", "frequency_penalty"),
    ('"logit_bias": {"5": Infinity}', 400, "logit_bias", "finite"),
    ('"stop_token_ids": [256]', 400, "stop_token_ids", "vocabulary"),  # the tiny vocab is 256
    ('"stop": ["ok", ""]', 400, "stop", "non-empty"),
    # strings must be valid Unicode: a lone surrogate is a 400, not a 500 from the tokenizer
    ('"stop": ["\\ud800"]', 400, "stop", "surrogate"),
    ('"user": "\\udfff"', 400, "user", "surrogate"),
]
PROMPTS = [
    ('{"model": "a0", "prompt": "\\ud800"}', 400, "prompt", "surrogate"),
    ('{"model": "a0", "prompt": ["t5", "t6 \\udc00"]}', 400, "prompt", "surrogate"),
    ('{"model": "a0", "prompt": [5, 6, 1000000000]}', 400, "prompt", "vocabulary"),
    ('{"model": "a0", "prompt": [[5, 6], [-1]]}', 400, "prompt", "prompt[1]", "vocabulary"),
    ('{"model": "a0", "prompt": [5, true]}', 400, "prompt", "token ids"),
    ('{"model": "a0", "prompt": [5.0]}', 400, "prompt", "list of float"),
    ('{"model": "a0", "prompt": [[]]}', 400, "prompt", "empty"),
    ('{"model": "a0", "prompt": "t5", "prompt": null}', 400, "prompt", "prompt"),
    ('{"model": "a0", "prompt": "t5", "max_tokens": ' + "9" * 5000 + "}", 400, None, "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, 400, None, "not valid JSON"),
    ('{"model": "a0", "prompt": "t5"', 400, None, "not valid JSON"),
    ("[]", 400, None, "valid dictionary"),
    (b'{"prompt": "t5 \xff"}', 400, None, "not UTF-8"),
    (b'{"model": "a0", "prompt": "t5 \xed\xa0\x80"}', 400, None, "not UTF-8"),  # an encoded surrogate
    ('{"model": "a0", "prompt": "t5 \ud800"}'.encode("utf-16-le", "surrogatepass"), 400, None, "not UTF-8"),
]


@pytest.mark.parametrize("raw,status,field,word", COMPLETIONS, ids=[c[0][:40] for c in COMPLETIONS])
def test_bad_completion_fields(server, reference, raw, status, field, word):
    for stream in ("false", "true"):
        body = "{" + BASE + f', "stream": {stream}, ' + raw + "}"
        check_refused(post(server.url, "/v1/completions", body), status, field, word)
    check_still_serving(server.url, reference)


@pytest.mark.parametrize("case", PROMPTS, ids=[str(c[0][:40]) for c in PROMPTS])
def test_bad_completion_bodies(server, reference, case):
    raw, status, field, *words = case
    check_refused(post(server.url, "/v1/completions", raw), status, field, *words)
    check_still_serving(server.url, reference)


def test_a_json_body_only(server, reference):
    headers = {**AUTH, "Content-Type": "text/plain"}  # what a cross-site form can send
    r = post(server.url, "/v1/completions", json.dumps(GREEDY), headers)
    check_refused(r, 415, None, "application/json")
    check_still_serving(server.url, reference)


CHAT_BASE = fields({"model": "a0", "max_tokens": 4})
CHATS = [
    ('"messages": [{"role": "user", "content": "t5"}], "temperature": NaN', "temperature", "finite"),
    ('"messages": [{"role": "user", "content": "t5"}], "seed": 18446744073709551616', "seed", "64-bit"),
    (
        '"messages": [{"role": "user", "content": "t5"}], "stop_token_ids": [1000000000], "min_tokens": 2',
        "stop_token_ids",
        "vocabulary",
    ),
    ('"messages": [{"role": "user", "content": "t5 \\ud800"}]', "messages", "messages.0.content"),
    (
        '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]',
        "messages",
        "surrogate",
    ),
    ('"messages": [{"role": "user", "content": "t5", "name": "\\ud800"}]', "messages", "messages.0.name"),
    ('"messages": [{"role": "\\ud800", "content": "t5"}]', "messages", "surrogate"),
    (
        '"messages": [{"role": "user", "content": "t5"}], "logprobs": true, "top_logprobs": -1',
        "top_logprobs",
        "top_logprobs",
    ),
]


@pytest.mark.parametrize("raw,field,word", CHATS, ids=[c[1] + "-" + c[2] for c in CHATS])
def test_bad_chat_bodies(server, reference, raw, field, word):
    body = "{" + CHAT_BASE + ", " + raw + "}"
    check_refused(post(server.url, "/v1/chat/completions", body), 400, field, word)
    check_still_serving(server.url, reference)


ADAPTERS = [
    ({"lora_name": "x", "lora_path": "a2\x00/../a2"}, "lora_path", "NUL"),
    ({"lora_name": "x", "lora_path": "~unknownuser-loraserve/a2"}, "lora_path", "does not exist"),
    ({"lora_name": "x\n", "lora_path": "a2"}, "lora_name", "not a valid name"),  # `$` let this through
    ({"lora_name": "x\ny", "lora_path": "a2"}, "lora_name", "not a valid name"),
    ({"lora_name": "é", "lora_path": "a2"}, "lora_name", "not a valid name"),
    ({"lora_name": "/x", "lora_path": "a2"}, "lora_name", "not a valid name"),
    ({"lora_name": "x" * 129, "lora_path": "a2"}, "lora_name", "not a valid name"),
]


@pytest.mark.parametrize("body,field,word", ADAPTERS, ids=[c[2] + "-" + c[1] for c in ADAPTERS])
def test_bad_adapter_loads(server, reference, body, field, word):
    r = post(server.url, "/v1/load_lora_adapter", json.dumps(body))
    check_refused(r, 400, field, word)
    names = {m["id"] for m in HTTP.get(server.url + "/v1/models", headers=AUTH).json()["data"]}
    assert body["lora_name"] not in names
    check_still_serving(server.url, reference)


def test_a_surrogate_in_an_adapter_path(server, reference):
    r = post(server.url, "/v1/load_lora_adapter", '{"lora_name": "x", "lora_path": "a2\\ud800"}')
    check_refused(r, 400, "lora_path", "surrogate")
    check_still_serving(server.url, reference)


def test_a_10mb_prompt_is_refused_before_parsing(server, reference):
    body = json.dumps({"model": "a0", "prompt": "t5 " * 3_400_000}).encode()  # 10.2 MB > 8 MiB
    t0 = time.perf_counter()
    check_refused(post(server.url, "/v1/completions", body), 413, None, "--max-request-bytes")
    assert time.perf_counter() - t0 < 5  # answered from the headers, not after tokenizing
    check_still_serving(server.url, reference)


def test_a_huge_prompt_does_not_block_the_event_loop(server, reference):
    """A 4 MB prompt (~1.3M tokens: too long, but that takes tokenizing to find out) is parsed and
    tokenized off the loop: meanwhile /health keeps answering at once."""
    body = json.dumps({"model": "a0", "prompt": "t5 " * 1_300_000}).encode()
    result: dict = {}

    def send() -> None:
        result["r"] = httpx.post(server.url + "/v1/completions", content=body, headers=AUTH, timeout=60)

    sender = threading.Thread(target=send)
    sender.start()
    latencies = []
    with httpx.Client(base_url=server.url) as c:
        while sender.is_alive():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.02)
    sender.join()
    check_refused(result["r"], 400, "prompt", "maximum context length")
    # NOTE: generous bounds for a loaded 2-core machine: tokenizing takes seconds; a blocked loop
    # would hold a /health call for that long
    assert len(latencies) >= 5, f"the big request finished too fast to tell: {latencies}"
    assert max(latencies) < 1.0, latencies
    check_still_serving(server.url, reference)


@pytest.fixture(scope="module")
def capped(files):
    """Small caps, to show each one."""
    from loraserve.server.app import ServerConfig, build_app

    config = ServerConfig(
        max_request_bytes=4096, max_prompts_per_request=3, max_stop_strings=2, max_stop_string_length=8
    )
    with ServerThread(build_app(make_engine(files.base, enable_lora=False).engine, config)) as s:
        s.reference = answer(s.url, JSON)
        yield s


CAPPED = [
    ({"prompt": "t5 " * 2000}, 413, None, "4096 bytes"),
    ({"prompt": ["t5"] * 4}, 400, "prompt", "--max-prompts-per-request"),
    ({"prompt": [[5]] * 4}, 400, "prompt", "--max-prompts-per-request"),
    ({"stop": ["a", "b", "c"]}, 400, "stop", "--max-stop-strings"),
    ({"stop": "t5 t6 t7 t8"}, 400, "stop", "--max-stop-string-length"),
]


@pytest.mark.parametrize("change,status,field,word", CAPPED, ids=[c[3] for c in CAPPED])
def test_the_caps(capped, change, status, field, word):
    body = {**GREEDY, "model": None, **change}
    check_refused(post(capped.url, "/v1/completions", json.dumps(body), JSON), status, field, word)
    ok = {**GREEDY, "model": None, "prompt": ["t5"] * 3, "stop": ["t5 t6 t7", "x"]}  # at the caps
    assert post(capped.url, "/v1/completions", json.dumps(ok), JSON).status_code == 200
    check_still_serving(capped.url, capped.reference, JSON)


def test_a_body_without_length_is_counted(capped):
    """Chunked transfer: no Content-Length to check, so the bytes are counted as they arrive."""

    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"t5 " * 200

    r = httpx.post(capped.url + "/v1/completions", content=chunks(), headers=JSON, timeout=30)
    check_refused(r, 413, None, "--max-request-bytes")
    check_still_serving(capped.url, capped.reference, JSON)


def test_caps_are_checked_at_startup():
    from loraserve.config import ConfigError
    from loraserve.server.app import ServerConfig

    for kw, flag in [
        (dict(max_request_bytes=10), "--max-request-bytes"),
        (dict(max_prompts_per_request=0), "--max-prompts-per-request"),
        (dict(max_stop_strings=10**6), "--max-stop-strings"),
        (dict(max_stop_string_length=0), "--max-stop-string-length"),
        (dict(max_n=True), "--max-n"),
    ]:
        with pytest.raises(ConfigError, match=flag):
            ServerConfig(**kw)


def test_serve_flags_set_the_caps():
    from loraserve.cli import build_parser
    from loraserve.config import ConfigError
    from loraserve.server.app import ServerConfig
    from loraserve.server.cli_serve import make_app

    args = build_parser().parse_args(["serve"])
    assert (args.max_request_bytes, args.max_prompts_per_request) == (8 * 2**20, 128)
    defaults = ServerConfig()
    assert (args.max_stop_strings, args.max_stop_string_length) == (
        defaults.max_stop_strings,
        defaults.max_stop_string_length,
    )
    args = build_parser().parse_args(["serve", "/nonexistent-model", "--max-stop-string-length", "0"])
    with pytest.raises(ConfigError, match="--max-stop-string-length"):
        make_app(args)  # refused before the model loads
