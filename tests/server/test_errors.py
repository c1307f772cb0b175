"""Errors use OpenAI's body and status; the server keeps serving the same answers after each one."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import API_KEY, MAX_MODEL_LEN, ServerThread, make_engine

PROMPT = "t5 t9 t17 t33 t65"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def answer(client, model="a0"):
    return (
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )


@pytest.fixture(scope="module")
def reference(client):
    return {m: answer(client, m) for m in ("tiny-llama", "a0")}


def check_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (
        err["code"] == status
        and err["type"]
        == {
            400: "BadRequestError",
            401: "AuthenticationError",
            403: "PermissionDeniedError",
            404: "NotFoundError",
        }[status]
    )
    for w in words:
        assert w in err["message"], err["message"]


BAD_COMPLETIONS = [
    ({"model": "nope"}, 404, "nope"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"n": 9}, 400, "n must be in [1, 8]"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, 400, "maximum context length"),
    ({"prompt": " ".join(["t5"] * MAX_MODEL_LEN), "max_tokens": 1}, 400, "maximum context length"),
    ({"prompt": [5, 6, 99999]}, 400, "outside the vocabulary"),
    ({"prompt": [[5, 6], [-1]]}, 400, "outside the vocabulary"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": {"x": 1}}, 400, "prompt"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"best_of": 3}, 400, "best_of"),
    ({"no_such_field": 1}, 400, "no_such_field"),
    ({"stop": [""]}, 400, "stop"),
]


@pytest.mark.parametrize("change,status,word", BAD_COMPLETIONS)
def test_bad_completion_requests(server, client, reference, change, status, word):
    body = {"model": "a0", "prompt": PROMPT, "max_tokens": 8, **change}
    for stream in (False, True):
        check_error(
            httpx.post(server.url + "/v1/completions", json={**body, "stream": stream}, headers=AUTH),
            status,
            word,
        )
    assert answer(client) == reference["a0"]


BAD_CHATS = [
    ({"model": "nope"}, 404, "nope"),
    ({"messages": []}, 400, "messages"),
    ({"top_logprobs": 2}, 400, "logprobs=true"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "image_url",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"max_completion_tokens": MAX_MODEL_LEN}, 400, "maximum context length"),
]


@pytest.mark.parametrize("change,status,word", BAD_CHATS)
def test_bad_chat_requests(server, client, reference, change, status, word):
    body = {"model": "a0", "messages": [{"role": "user", "content": "t5"}], "max_tokens": 4, **change}
    check_error(httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH), status, word)
    assert answer(client) == reference["a0"]


def test_openai_client_sees_typed_errors(client, reference):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="a0", prompt=PROMPT, temperature=-1)
    assert answer(client, "tiny-llama") == reference["tiny-llama"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_guards_every_v1_route(server, client, reference, headers):
    for method, path, body in [
        ("POST", "/v1/completions", {"model": "a0", "prompt": PROMPT}),
        ("POST", "/v1/chat/completions", {"model": "a0", "messages": [{"role": "user", "content": "t5"}]}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "a2"}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "a0"}),
        ("GET", "/v1/nonexistent", None),
    ]:
        check_error(httpx.request(method, server.url + path, json=body, headers=headers), 401, "API key")
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # outside /v1: open
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert "a0" in {m.id for m in client.models.list().data}  # the unload above was refused
    assert answer(client) == reference["a0"]


def load(server, name, path):
    return httpx.post(
        server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, headers=AUTH
    )


def test_lora_path_must_resolve_under_root(server, client, files, reference):
    check_error(load(server, "x", files.outside), 400, "outside --lora-root")
    check_error(load(server, "x", files.root / "link-out"), 400, "outside --lora-root")  # a symlinked dir
    check_error(load(server, "x", "../outside"), 400, "outside --lora-root")  # relative, escaping
    check_error(load(server, "x", files.root / "sneaky"), 400, "links outside")  # a symlinked file inside
    check_error(load(server, "x", files.root / "missing"), 400, "does not exist")
    names = {m.id for m in client.models.list().data}
    assert "x" not in names
    assert answer(client) == reference["a0"]


def test_adapter_limits_and_names(server, client, reference):
    check_error(load(server, "big", "too-big"), 400, "max_lora_rank")  # the manager's rank limit
    check_error(load(server, "tiny-llama", "a2"), 400, "base model")
    check_error(load(server, "bad name", "a2"), 400, "lora_name")
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=AUTH)
    check_error(r, 404, "nope")
    assert {"big", "bad name"}.isdisjoint({m.id for m in client.models.list().data})
    assert answer(client) == reference["a0"]


def test_a_failed_reload_keeps_the_old_adapter(server, client, files, reference):
    r = load(server, "a3", files.root / "a2")
    assert r.status_code == 200, r.text
    before = answer(client, "a3")
    check_error(load(server, "a3", "too-big"), 400, "max_lora_rank")
    assert answer(client, "a3") == before
    assert (
        httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "a3"}, headers=AUTH).status_code
        == 200
    )


@pytest.fixture(scope="module")
def locked_server(files):
    """Defaults: no API key, runtime adapter updates off."""
    from loraserve.server.app import ServerConfig, build_app

    app = build_app(make_engine(files.base).engine, ServerConfig(lora_modules=[("a0", str(files.a0))]))
    with ServerThread(app) as s:
        yield s


def test_runtime_updating_is_off_by_default(locked_server, files, client, reference):
    for path, body in [
        ("/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(files.root / "a2")}),
        ("/v1/unload_lora_adapter", {"lora_name": "a0"}),
    ]:
        check_error(httpx.post(locked_server.url + path, json=body), 403, "--allow-runtime-lora-updating")
    r = httpx.get(locked_server.url + "/v1/models")  # no key needed here
    assert {m["id"] for m in r.json()["data"]} == {"tiny-llama", "a0"}
    r = httpx.post(
        locked_server.url + "/v1/completions",
        json={"model": "a0", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    assert r.json()["choices"][0]["text"] == reference["a0"]  # same engine, same answer


def test_runtime_updating_needs_a_root():
    from loraserve.config import ConfigError
    from loraserve.server.app import ServerConfig

    with pytest.raises(ConfigError, match="--lora-root"):
        ServerConfig(allow_runtime_lora_updating=True)


def test_an_engine_crash_fails_requests_and_health(files):
    """A bug in the engine loop must not hang clients: in-flight and new requests get errors, /health 503."""
    from loraserve.server.app import ServerConfig, build_app

    engine = make_engine(files.base, enable_lora=False).engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("injected failure")
        return real_step()

    engine.step = failing_step
    with ServerThread(build_app(engine, ServerConfig())) as s:
        body = {"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=10) as r:
            events = [line for line in r.iter_lines() if line]
        assert '"ServiceUnavailableError"' in events[-2] and events[-1] == "data: [DONE]"
        check = httpx.post(s.url + "/v1/completions", json=body, timeout=10)
        assert check.status_code == 503 and check.json()["error"]["code"] == 503
        assert httpx.get(s.url + "/health").status_code == 503
