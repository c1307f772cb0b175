"""Hostile requests for benchmarks/load_test.py: each one is invalid or extreme, and a server that holds
answers it with a 4xx and OpenAI's error body ``{"error": {"message", ...}}``: never a 5xx, never a
dropped connection, and never a 200 (each body breaks a rule the server states: a range, a type, a cap,
the vocabulary, valid UTF-8, a known model or a loadable adapter under ``--lora-root``).

``make(rng, target)`` draws one; ``send(client, h, timeout)`` sends it and names what came back
(``outcome``) and whether that is a server fault. Bodies are built as JSON text, so NaN, Infinity,
1e39, 2**64 and lone surrogates (``"\\ud800"``) reach the server as a client would send them. Every
body is bounded (a few MB at most).
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx

NAN, INF = float("nan"), float("inf")
U64 = 2**64
DROP = object()  # a patch value that removes the field


@dataclass
class Target:
    """What the hostile clients know about the server."""

    models: list[str]  # the base model first, then its adapters
    vocab: int
    max_model_len: int
    big_bytes: int  # an oversized body: more than the server's --max-request-bytes
    good_adapter_path: str  # a loadable adapter under --lora-root (for the bad-name loads)
    bad_adapter_paths: list[str]  # lora_path values under --lora-root that must be refused


@dataclass
class Hostile:
    kind: str
    method: str
    path: str
    content: bytes
    content_type: str | None = "application/json"
    stream: bool = False  # the body asks for a stream
    chunked: bool = False  # sent without Content-Length


class _Raw:
    """JSON text json.dumps cannot write (an integer of over 4,300 digits)."""

    def __init__(self, text: str):
        self.text = text


def dumps(obj) -> bytes:
    """JSON text with NaN / Infinity as bare words and lone surrogates as \\ud800 escapes."""
    raws: list[str] = []

    def walk(v):
        if isinstance(v, _Raw):
            raws.append(v.text)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    text = json.dumps(walk(obj))  # ensure_ascii: lone surrogates go out as escapes
    for i, r in enumerate(raws):
        text = text.replace(json.dumps(f"\x00RAW{i}\x00"), r)
    return text.encode()


def _sampling(t: Target, rng: random.Random) -> list[tuple[str, dict]]:
    """Both endpoints: sampling fields out of range, of the wrong type, or past a cap; bad models."""
    adapter = rng.choice(t.models[1:] or t.models)
    return [
        ("temperature NaN", {"temperature": NAN}),
        ("temperature NaN, min_tokens 2", {"temperature": NAN, "min_tokens": 2}),
        ("temperature Infinity, min_tokens 2", {"temperature": INF, "min_tokens": 2}),
        ("temperature -Infinity", {"temperature": -INF}),
        ("temperature 1e39, min_tokens 2", {"temperature": 1e39, "min_tokens": 2}),
        ("temperature -0.5", {"temperature": -0.5}),
        ("temperature a string", {"temperature": "hot"}),
        ("top_p NaN", {"top_p": NAN, "temperature": 0.8}),
        ("top_p 0", {"top_p": 0.0, "temperature": 0.8}),
        ("top_p 1.5", {"top_p": 1.5}),
        ("top_p -Infinity", {"top_p": -INF}),
        ("min_p NaN", {"min_p": NAN, "temperature": 0.8}),
        ("min_p 2", {"min_p": 2.0}),
        ("top_k -2", {"top_k": -2}),
        ("top_k 2**64", {"top_k": U64}),
        ("presence_penalty NaN", {"presence_penalty": NAN}),
        ("frequency_penalty 1e39", {"frequency_penalty": 1e39}),
        ("presence_penalty 1 (unsupported)", {"presence_penalty": 1.0}),
        ("logit_bias (unsupported)", {"logit_bias": {"5": 100}}),
        ("seed 2**64", {"seed": U64, "temperature": 0.8}),
        ("seed 2**64-1, n 2", {"seed": U64 - 1, "n": 2, "temperature": 0.8}),
        ("seed -2**63-1", {"seed": -(2**63) - 1, "temperature": 0.8}),
        ("seed of 5,000 digits", {"seed": _Raw("9" * 5000)}),
        ("seed a float", {"seed": 1.5}),
        ("n 0", {"n": 0}),
        ("n -1", {"n": -1}),
        ("n 1000", {"n": 1000}),
        ("n 2**64", {"n": U64}),
        ("max_tokens -1", {"max_tokens": -1}),
        ("max_tokens -2**63", {"max_tokens": -(2**63)}),
        ("max_tokens 10**12", {"max_tokens": 10**12}),
        ("max_tokens 2**64", {"max_tokens": U64}),
        ("max_tokens a word", {"max_tokens": "ten"}),
        ("max_tokens 1.5", {"max_tokens": 1.5}),
        ("min_tokens -1", {"min_tokens": -1}),
        ("min_tokens > max_tokens", {"min_tokens": 50, "max_tokens": 5}),
        ("stop_token_ids [1e9], min_tokens 2", {"stop_token_ids": [10**9], "min_tokens": 2}),
        ("stop_token_ids [-100000], min_tokens 2", {"stop_token_ids": [-100000], "min_tokens": 2}),
        ("stop_token_ids [2**64]", {"stop_token_ids": [U64]}),
        ("stop_token_ids of 100,000 ids", {"stop_token_ids": [5] * 100_000}),
        ("stop_token_ids strings", {"stop_token_ids": ["t5"]}),
        ("stop a lone surrogate", {"stop": ["t5", "\ud800"]}),
        ("stop of 100,000 strings", {"stop": ["t5 t6"] * 100_000}),
        ("stop string of 1 MB", {"stop": "t7 " * 350_000}),
        ("stop an empty string", {"stop": [""]}),
        ("stop a number", {"stop": 5}),
        ("stream a list", {"stream": [1]}),
        ("stream_options a string", {"stream_options": "yes", "stream": True}),
        ("ignore_eos a string", {"ignore_eos": "maybe"}),
        ("an unknown field", {"frobnicate": 1}),
        ("a lone surrogate in user", {"user": "\udc00"}),
        ("a lone surrogate as a key", {"\ud800": 1}),
        ("model unknown", {"model": "no-such-model"}),
        ("model with a trailing newline", {"model": adapter + "\n"}),
        ("model ../adapter", {"model": "../" + adapter}),
        ("model a lone surrogate", {"model": "\ud800"}),
        ("model a number", {"model": 7}),
        ("model of 10,000 characters", {"model": "m" * 10_000}),
    ]


def _completion(t: Target) -> list[tuple[str, dict]]:
    return [
        ("prompt ids [1e9], min_tokens 2", {"prompt": [10**9], "min_tokens": 2}),
        ("prompt ids negative", {"prompt": [5, -1, 6]}),
        ("prompt ids [2**64]", {"prompt": [U64]}),
        ("prompt batch with an id out of vocab", {"prompt": [[5, 6], [7, 10**9]], "min_tokens": 2}),
        ("prompt an empty list", {"prompt": []}),
        ("prompt [[]]", {"prompt": [[]]}),
        ("prompt an empty string", {"prompt": ""}),
        ("prompt ids and strings mixed", {"prompt": [5, "t6"]}),
        ("prompt floats", {"prompt": [1.5]}),
        ("prompt an object", {"prompt": {"a": 1}}),
        ("prompt null", {"prompt": None}),
        ("prompt missing", {"prompt": DROP}),
        ("prompt a lone surrogate", {"prompt": "t5 \ud800 t6"}),
        ("prompt longer than the context", {"prompt": "t5 " * (t.max_model_len + 40)}),
        ("prompt + max_tokens over the context", {"prompt": [5] * (t.max_model_len - 4), "max_tokens": 10}),
        ("prompt of 1,000 prompts", {"prompt": ["t5 t6"] * 1000}),
        ("logprobs -1", {"logprobs": -1}),
        ("logprobs 1000", {"logprobs": 1000}),
        ("echo a string", {"echo": "maybe"}),
        ("best_of 5 (unsupported)", {"best_of": 5}),
        ("suffix (unsupported)", {"suffix": "t9"}),
    ]


def _chat(t: Target) -> list[tuple[str, dict]]:
    user = {"role": "user", "content": "t5 t6"}
    return [
        ("messages a lone surrogate", {"messages": [{"role": "user", "content": "t5 \ud800"}]}),
        ("role a lone surrogate", {"messages": [{"role": "\udfff", "content": "t5"}]}),
        ("messages a string", {"messages": "t5 t6"}),
        ("messages empty", {"messages": []}),
        ("messages missing", {"messages": DROP}),
        ("a message without a role", {"messages": [{"content": "t5"}]}),
        ("content a number", {"messages": [{"role": "user", "content": 5}]}),
        (
            "content an image part",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        ),
        ("content a text part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
        ("conversation longer than the context", {"messages": [user] * (t.max_model_len // 2)}),
        ("20,000 messages", {"messages": [user] * 20_000}),
        ("max_completion_tokens -5", {"max_completion_tokens": -5}),
        ("top_logprobs 1000", {"logprobs": True, "top_logprobs": 1000}),
        ("top_logprobs without logprobs", {"top_logprobs": 5}),
        ("logprobs a string", {"logprobs": "x"}),
        ("tools (unsupported)", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
        ("response_format json (unsupported)", {"response_format": {"type": "json_object"}}),
    ]


RAW = [
    ("an empty body", b""),
    ("truncated JSON", b'{"prompt": "t5 t6", "max_tokens": '),
    ("a trailing comma", b'{"prompt": "t5", "max_tokens": 4,}'),
    ("a JSON list", b"[]"),
    ("JSON null", b"null"),
    ("a JSON number", b"42"),
    ("bare NaN", b"NaN"),
    ("bytes that are not UTF-8", b"\xff\xfe\xfd\x00"),
    (
        "invalid UTF-8 in a string",
        b'{"prompt": "t5 \xff t6", "messages": [{"role": "user", "content": "\xc3"}]}',
    ),
    (
        "an encoded surrogate (CESU-8)",
        b'{"prompt": "t5 \xed\xa0\x80", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
    ),
    ("JSON nested 100,000 deep", b"[" * 100_000 + b"]" * 100_000),
    ("a duplicate key", b'{"prompt": "t5", "prompt": 5, "messages": 5}'),
]


def _generation(t: Target, rng: random.Random) -> Hostile:
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    stream = rng.random() < 0.5
    if rng.random() < 0.08:
        kind, content = rng.choice(RAW)
        return Hostile(f"raw: {kind}", "POST", path, content, stream=False)
    if rng.random() < 0.03:
        ct = rng.choice(
            ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
        )
        body = {"model": t.models[0], "prompt": "t5", "messages": [{"role": "user", "content": "t5"}]}
        return Hostile(f"Content-Type {ct.split(';')[0]}", "POST", path, dumps(body), ct)
    body = {"model": rng.choice(t.models), "max_tokens": rng.randint(2, 8), "stream": stream}
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": "t5 t6 t7"}]
    else:
        body["prompt"] = "t5 t6 t7"
    cases = _sampling(t, rng) + (_chat(t) if chat else _completion(t))
    kind, patch = rng.choice(cases)
    for k, v in patch.items():
        if v is DROP:
            body.pop(k, None)
        else:
            body[k] = v
    return Hostile(kind, "POST", path, dumps(body), stream=body.get("stream") is True)


def _oversized(t: Target, rng: random.Random) -> Hostile:
    """A body over the server's cap (with Content-Length, or chunked), or a big prompt under it."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    how = rng.choice(["Content-Length", "chunked", "under the cap"])
    size = t.big_bytes if how != "under the cap" else rng.randint(1 << 20, 2 << 20)
    text = "t5 " * (size // 3)
    body = {
        "model": t.models[0],
        "max_tokens": 4,
        "prompt": text,
        "messages": [{"role": "user", "content": text}],
    }
    return Hostile(
        f"a {size / 2**20:.1f} MB body ({how})", "POST", path, dumps(body), chunked=how == "chunked"
    )


def _adapter_call(t: Target, rng: random.Random) -> Hostile:
    fresh = f"hostile-{rng.randrange(1 << 30)}"
    if rng.random() < 0.2:
        name = rng.choice([fresh, t.models[-1], "\ud800", ""])
        kind, body = rng.choice(
            [
                ("unload an unknown adapter", {"lora_name": "no-such-adapter"}),
                ("unload a bad name", {"lora_name": name + "\n"}),
                ("unload without a name", {}),
                ("unload a name of the wrong type", {"lora_name": 5}),
            ]
        )
        return Hostile(kind, "POST", "/v1/unload_lora_adapter", dumps(body))
    good_path = t.good_adapter_path
    bad_paths = [
        ("a NUL byte", "lora\x00x"),
        ("an unknown ~user", "~no_such_user_loraserve/x"),
        ("/etc", "/etc"),
        ("/", "/"),
        ("../ out of the root", "../../../../../../etc"),
        ("a missing dir", "does/not/exist"),
        ("a lone surrogate", "\ud800"),
        ("5,000 characters", "x" * 5000),
    ] + [(f"bad adapter dir {Path(p).name}", p) for p in t.bad_adapter_paths]
    bad_names = [
        ("a trailing newline", t.models[-1] + "\n"),
        ("empty", ""),
        ("a space", "my adapter"),
        ("starting with /", "/abs"),
        ("200 characters", "a" * 200),
        ("not ASCII", "naïve"),
        ("the base model's", t.models[0]),
        ("a lone surrogate", "\udc00"),
    ]
    r = rng.random()
    if r < 0.6:
        what, path = rng.choice(bad_paths)
        name = t.models[-1] if rng.random() < 0.1 else fresh  # an existing name must keep its adapter
        return Hostile(
            f"load: lora_path {what}",
            "POST",
            "/v1/load_lora_adapter",
            dumps({"lora_name": name, "lora_path": path}),
        )
    if r < 0.9:
        what, name = rng.choice(bad_names)
        return Hostile(
            f"load: lora_name {what}",
            "POST",
            "/v1/load_lora_adapter",
            dumps({"lora_name": name, "lora_path": good_path}),
        )
    body = rng.choice(
        [
            {},
            {"lora_name": 5, "lora_path": []},
            {"lora_name": fresh},
            {"lora_name": fresh, "lora_path": good_path, "x": 1},
        ]
    )
    return Hostile("load: missing or wrong-typed fields", "POST", "/v1/load_lora_adapter", dumps(body))


def _route(t: Target, rng: random.Random) -> Hostile:
    method, path = rng.choice(
        [
            ("GET", "/v1/completions"),
            ("PUT", "/v1/chat/completions"),
            ("DELETE", "/v1/models"),
            ("POST", "/health"),
            ("POST", "/v1/no-such-route"),
            ("GET", "/v1/completions/../../etc/passwd"),
        ]
    )
    return Hostile(
        f"route: {method} {path}", method, path, b"" if method == "GET" else dumps({"prompt": "t5"})
    )


def make(rng: random.Random, t: Target) -> Hostile:
    r = rng.random()
    if r < 0.80:
        return _generation(t, rng)
    if r < 0.82:
        return _oversized(t, rng)
    if r < 0.96:
        return _adapter_call(t, rng)
    return _route(t, rng)


async def _chunks(data: bytes, size: int = 1 << 16):
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def send(client: httpx.AsyncClient, h: Hostile, timeout: float) -> tuple[str, bool, bytes]:
    """Send ``h``; (what came back, whether it is a server fault, the response's first MB)."""
    headers = {"content-type": h.content_type} if h.content_type else {}
    content = _chunks(h.content) if h.chunked else h.content
    received = b""
    try:
        async with client.stream(h.method, h.path, content=content, headers=headers, timeout=timeout) as r:
            async for piece in r.aiter_bytes():
                received += piece[: max(0, (1 << 20) - len(received))]
    except httpx.HTTPError as e:
        return f"transport error {type(e).__name__}", True, str(e).encode()
    return (*outcome(h, r.status_code, received), received)


def outcome(h: Hostile, status: int, body: bytes) -> tuple[str, bool]:
    """(what came back, whether it is a server fault): anything but a 4xx with an error body is one."""
    if 400 <= status < 500:
        try:
            ok = isinstance(json.loads(body)["error"]["message"], str)
        except (ValueError, KeyError, TypeError):
            ok = False
        return (str(status), False) if ok else (f"{status} without an error body", True)
    if status >= 500:
        return str(status), True
    if 200 <= status < 300 and h.stream:
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("data: {") and '"error"' in line:
                try:
                    code = json.loads(line[6:])["error"].get("code")
                except (ValueError, KeyError, AttributeError):
                    code = "(unreadable)"
                return f"{status}, then an error event {code} in the stream", True
    return f"{status} (accepted)", True


class _Poison:
    """Unpickling this runs print(): a pickle-only adapter file a safe loader must refuse."""

    def __reduce__(self):
        return (print, ("load_test: an adapter's pickle ran code in the server",))


def make_bad_adapters(root: Path, good: Path, base: Path) -> tuple[str, list[str]]:
    """Under ``root``: a copy of ``good``, and adapter dirs a load must refuse; returns their paths."""
    import torch
    from safetensors.torch import load_file, save_file

    root.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(good / "adapter_model.safetensors"))
    config = json.loads((good / "adapter_config.json").read_text())

    def adapter(name: str, scale: float | None = None, **config_changes) -> Path:
        d = root / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
        w = {k: v.clone() for k, v in weights.items()}
        if scale is not None:
            first = next(k for k in w if "lora_B" in k)
            w[first] = w[first] * scale if scale == scale else torch.full_like(w[first], NAN)
        save_file(w, str(d / "adapter_model.safetensors"))
        return d

    adapter("nan-weights", scale=NAN)
    adapter("inf-weights", scale=INF)
    adapter("weights-x1e30", scale=1e30)
    adapter("alpha-nan", lora_alpha=NAN)
    adapter("rank-4096", r=4096)  # the config says one rank, the tensors another
    (root / "empty").mkdir()
    (root / "not-json").mkdir()
    (root / "not-json" / "adapter_config.json").write_text("{not json")
    (root / "config-3mb").mkdir()
    (root / "config-3mb" / "adapter_config.json").write_text(json.dumps({**config, "pad": "x" * (3 << 20)}))
    (root / "no-weights").mkdir()
    shutil.copy(good / "adapter_config.json", root / "no-weights")
    (root / "pickle-only").mkdir()
    shutil.copy(good / "adapter_config.json", root / "pickle-only")
    (root / "pickle-only" / "adapter_model.bin").write_bytes(pickle.dumps(_Poison()))
    (root / "a-file").write_text("not an adapter dir")
    (root / "link-out").symlink_to("/etc")
    (root / "link-to-base").symlink_to(base.resolve())  # outside the root
    bad = [str(p) for p in sorted(root.iterdir())]
    shutil.copytree(good, root / "good")
    return str(root / "good"), bad
