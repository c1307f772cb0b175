"""Bounded load test of the HTTP server: N concurrent streaming clients for D seconds.

Clients pick a model (the base or an adapter) and an endpoint (completions or chat) at random,
stream with usage, and now and then hang up after a chunk or two. At the end it checks that every
completed response was valid, that no request was lost (each one completed, was dropped by its
client on purpose, or is reported as an error), and that nothing leaked: once idle, /metrics must
show no running or waiting sequence, every KV block free and no adapter in use.

    # against a running server
    python benchmarks/load_test.py --url http://127.0.0.1:8000 [--api-key KEY]
    # self-contained: a tiny random llama + 8 tiny adapters, served by `loraserve serve` in a subprocess
    python benchmarks/load_test.py --tiny --clients 64 --duration 60

Prints requests/s, tokens/s, p50/p99 time to first token and inter-token latency (client side).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Report:
    duration: float = 0.0
    started: int = 0
    completed: int = 0
    disconnected: int = 0
    errors: list[str] = field(default_factory=list)
    lost: int = 0
    chunks: int = 0  # streamed chunks with text
    generated: float = 0.0  # tokens the server generated meanwhile (its /metrics), aborted ones included
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    by_model: dict[str, int] = field(default_factory=dict)
    final_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.lost and not self.leaks and self.completed > 0

    def summary(self) -> str:
        def pct(xs, q):
            return (
                statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1000
                if len(xs) > 1
                else float("nan")
            )

        lines = [
            f"duration {self.duration:.1f} s, {len(self.by_model)} models, requests started {self.started}: "
            f"completed {self.completed}, disconnected on purpose {self.disconnected}, errors {len(self.errors)}, "
            f"lost {self.lost}",
            f"throughput: {self.completed / self.duration:.1f} completed requests/s, "
            f"{self.generated / self.duration:.0f} generated tokens/s",
            f"TTFT p50 {pct(self.ttft, 50):.1f} ms, p99 {pct(self.ttft, 99):.1f} ms; "
            f"inter-token p50 {pct(self.itl, 50):.1f} ms, p99 {pct(self.itl, 99):.1f} ms "
            f"(client side: gaps between text chunks; a chunk carries more than one token only when its reader lags)",
            "leaks: " + ("none" if not self.leaks else "; ".join(self.leaks)),
        ]
        lines += [f"error: {e}" for e in self.errors[:10]]
        lines.append("RESULT: " + ("PASS" if self.ok else "FAIL"))
        return "\n".join(lines)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


class _Invalid(Exception):
    pass


async def _one(
    client: httpx.AsyncClient, rng: random.Random, models: list[str], rep: Report, args, vocab: int
) -> None:
    model = rng.choice(models)
    words = " ".join(f"t{rng.randrange(2, vocab)}" for _ in range(rng.randint(4, 32)))
    max_tokens = rng.randint(4, args.max_tokens)
    chat = rng.random() < 0.5
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.0, 0.8]),
        "seed": rng.randrange(1 << 20),
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": rng.random() < 0.5,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = words
    hang_up_after = rng.randint(1, 3) if rng.random() < args.disconnect_prob else None
    url = "/v1/chat/completions" if chat else "/v1/completions"
    rep.started += 1
    rep.by_model[model] = rep.by_model.get(model, 0) + 1
    t0 = time.monotonic()
    last, text, usage, finish, done, chunks = None, "", None, None, False, 0
    try:
        async with client.stream("POST", url, json=body, timeout=args.request_timeout) as r:
            if r.status_code != 200:
                raise _Invalid(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    raise _Invalid(f"not an SSE data line: {line[:80]!r}")
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _Invalid(f"error event: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk["choices"]:
                    piece = ch["delta"].get("content") if chat else ch.get("text")
                    if piece:
                        now = time.monotonic()
                        if last is None:
                            rep.ttft.append(now - t0)
                        else:
                            rep.itl.append(now - last)
                        last = now
                        text += piece
                        rep.chunks += 1
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
                chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    rep.disconnected += 1
                    return  # leaving the block closes the connection mid-stream
        if not done:
            raise _Invalid("the stream ended without [DONE]")
        if usage is None:
            raise _Invalid("no usage in the last chunk")
        n = usage["completion_tokens"]
        if finish not in ("stop", "length"):
            raise _Invalid(f"finish_reason {finish!r}")
        if (
            not 0 < n <= max_tokens
            or (finish == "length" and n != max_tokens)
            or (body["ignore_eos"] and n != max_tokens)
        ):
            raise _Invalid(
                f"{n} completion tokens for max_tokens={max_tokens}, finish {finish}, ignore_eos {body['ignore_eos']}"
            )
        if usage["total_tokens"] != usage["prompt_tokens"] + n or usage["prompt_tokens"] <= 0:
            raise _Invalid(f"inconsistent usage {usage}")
        if n > 0 and finish == "length" and not text:
            raise _Invalid("no text streamed")
        rep.completed += 1
    except _Invalid as e:
        rep.errors.append(f"{model} {url}: {e}")
    except httpx.TimeoutException:
        rep.lost += 1
        rep.errors.append(f"{model} {url}: timed out after {args.request_timeout} s")
    except Exception as e:
        rep.errors.append(f"{model} {url}: {type(e).__name__}: {e}")


async def _worker(client, rng, models, rep, args, vocab, deadline) -> None:
    while time.monotonic() < deadline:
        await _one(client, rng, models, rep, args, vocab)


async def run_load(
    url: str,
    api_key: str | None = None,
    clients: int = 64,
    duration: float = 60.0,
    max_tokens: int = 32,
    disconnect_prob: float = 0.1,
    seed: int = 0,
    request_timeout: float = 120.0,
    vocab: int = 256,
    settle_timeout: float = 15.0,
) -> Report:
    args = argparse.Namespace(
        max_tokens=max_tokens, disconnect_prob=disconnect_prob, request_timeout=request_timeout
    )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    rep = Report()
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=request_timeout
    ) as client:
        models = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        generated0 = parse_metrics((await client.get("/metrics")).text)["loraserve_generation_tokens_total"]
        rng = random.Random(seed)
        t0 = time.monotonic()
        deadline = t0 + duration
        await asyncio.gather(
            *(
                _worker(client, random.Random(rng.random()), models, rep, args, vocab, deadline)
                for _ in range(clients)
            )
        )
        rep.duration = time.monotonic() - t0
        generated1 = parse_metrics((await client.get("/metrics")).text)["loraserve_generation_tokens_total"]
        rep.generated = generated1 - generated0
        # leaks: once idle, nothing may be running and every block must be free
        settle = time.monotonic() + settle_timeout
        while True:
            m = parse_metrics((await client.get("/metrics")).text)
            leaks = []
            if m["loraserve_num_requests_running"] or m["loraserve_num_requests_waiting"]:
                leaks.append(
                    f"{m['loraserve_num_requests_running']:.0f} running, "
                    f"{m['loraserve_num_requests_waiting']:.0f} waiting"
                )
            if m["loraserve_kv_cache_free_blocks"] != m["loraserve_kv_cache_blocks"]:
                leaks.append(
                    f"KV blocks free {m['loraserve_kv_cache_free_blocks']:.0f} of "
                    f"{m['loraserve_kv_cache_blocks']:.0f}"
                )
            if m["loraserve_lora_adapters_in_use"]:
                leaks.append(f"{m['loraserve_lora_adapters_in_use']:.0f} adapters still in use")
            if m["loraserve_lora_slots_used"] > m["loraserve_lora_slots"]:
                leaks.append("more LoRA slots used than exist")
            if not leaks or time.monotonic() > settle:
                break
            await asyncio.sleep(0.2)
        rep.leaks = leaks
        rep.final_metrics = m
    return rep


# ---- --tiny: a self-contained server -------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_setup(d: Path, num_adapters: int) -> tuple[Path, list[tuple[str, Path]]]:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import make_peft_adapter, make_tiny_model  # needs the test extras (peft)

    base = d / "tiny-llama"
    make_tiny_model(base, "llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = []
    for i in range(num_adapters):
        path = make_peft_adapter(
            base, d / f"lora{i}", seed=i + 1, r=(4, 8, 16)[i % 3], lora_alpha=16, target_modules=targets
        )
        adapters.append((f"lora{i}", path))
    return base, adapters


def serve_tiny(d: Path, num_adapters: int, max_loras: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    base, adapters = make_tiny_setup(d, num_adapters)
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "loraserve",
        "serve",
        str(base),
        "--port",
        str(port),
        "--device",
        "cpu",
        "--max-loras",
        str(max_loras),
        "--uvicorn-log-level",
        "warning",
        "--lora-modules",
        *[f"{n}={p}" for n, p in adapters],
        *extra,
    ]
    print("server:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.terminate()
    raise SystemExit("the server did not come up in 120 s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (else --tiny starts one)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tiny", action="store_true", help="serve a tiny random model + --adapters tiny adapters")
    p.add_argument("--adapters", type=int, default=8, help="adapters for --tiny")
    p.add_argument(
        "--max-loras", type=int, default=4, help="device slots for --tiny (fewer than adapters: evictions)"
    )
    p.add_argument(
        "--server-arg", action="append", default=[], help="extra `loraserve serve` flag for --tiny"
    )
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="seconds")
    p.add_argument("--max-tokens", type=int, default=32, help="each request asks for 4..this many tokens")
    p.add_argument("--disconnect-prob", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if (args.url is None) == (not args.tiny):
        p.error("pass either --url URL or --tiny")
    proc = None
    with tempfile.TemporaryDirectory() as tmp:
        url = args.url
        if args.tiny:
            proc, url = serve_tiny(Path(tmp), args.adapters, args.max_loras, args.server_arg)
        try:
            rep = asyncio.run(
                run_load(
                    url,
                    args.api_key,
                    args.clients,
                    args.duration,
                    args.max_tokens,
                    args.disconnect_prob,
                    args.seed,
                )
            )
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
    print(rep.summary())
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
