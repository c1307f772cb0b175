"""Bounded load test of the HTTP server: N concurrent streaming clients for D seconds.

Clients pick a model (the base or an adapter) and an endpoint (completions or chat) at random,
stream with usage, and now and then hang up after a chunk or two. At the end it checks that every
completed response was valid, that no request was lost (each one completed, was dropped by its
client on purpose, or is reported as an error), and that nothing leaked: once idle, /metrics must
show no running or waiting sequence, every KV block free and no adapter in use.

A share of the clients (--hostile-fraction, 5%) are hostile instead: each of their requests is
invalid or extreme (hostile_bodies.py: NaN / 1e39 temperatures, 2**64 seeds, token ids outside the
vocabulary, lone surrogates, huge stop lists, malformed JSON, oversized bodies, bad adapter loads,
streaming or not) and must get a 4xx with an OpenAI error body. The run FAILS (exit status 1) if a
normal request was lost or went wrong, a hostile one got anything but such a 4xx (a 5xx, an error
event in a 200 stream, a 200, a dropped connection), /health is not 200 at the end, or anything leaked.

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
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile_bodies  # noqa: E402

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
    clients: int = 0
    hostile_clients: int = 0
    hostile_sent: int = 0
    hostile_streamed: int = 0  # of those, bodies asking for a stream
    hostile_outcomes: Counter = field(default_factory=Counter)
    hostile_faults: list[dict] = field(default_factory=list)  # each: kind, stream, outcome, response, body
    hostile_by_kind: Counter = field(default_factory=Counter)  # "kind -> outcome": count
    health: str = "not checked"
    server_exit: int | None = None  # --tiny: the server's exit status if it died during the run

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and not self.lost
            and not self.leaks
            and self.completed > 0
            and not self.hostile_faults
            and self.health == "200"
            and self.server_exit is None
        )

    def summary(self) -> str:
        def pct(xs, q):
            return (
                statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1000
                if len(xs) > 1
                else float("nan")
            )

        faults = Counter((f["kind"], f["outcome"]) for f in self.hostile_faults)
        lines = [
            f"clients {self.clients}: {self.clients - self.hostile_clients} normal, {self.hostile_clients} hostile",
            f"duration {self.duration:.1f} s, {len(self.by_model)} models, normal requests started {self.started}: "
            f"completed {self.completed}, disconnected on purpose {self.disconnected}, errors {len(self.errors)}, "
            f"lost {self.lost}",
            f"throughput: {self.completed / self.duration:.1f} completed requests/s, "
            f"{self.generated / self.duration:.0f} generated tokens/s",
            f"TTFT p50 {pct(self.ttft, 50):.1f} ms, p99 {pct(self.ttft, 99):.1f} ms; "
            f"inter-token p50 {pct(self.itl, 50):.1f} ms, p99 {pct(self.itl, 99):.1f} ms "
            f"(client side: gaps between text chunks; a chunk carries more than one token only when its reader lags)",
            f"hostile requests sent {self.hostile_sent} ({self.hostile_streamed} asking for a stream): "
            + ", ".join(f"{k} x{v}" for k, v in sorted(self.hostile_outcomes.items()))
            + f"; server faults {len(self.hostile_faults)}",
            "leaks: " + ("none" if not self.leaks else "; ".join(self.leaks)),
            f"/health at the end: {self.health}"
            + ("" if self.server_exit is None else f"; the server exited with {self.server_exit}"),
        ]
        lines += [f"error: {e}" for e in self.errors[:10]]
        for (kind, what), count in faults.most_common(20):
            f = next(f for f in self.hostile_faults if (f["kind"], f["outcome"]) == (kind, what))
            lines.append(
                f"fault x{count}: {kind} ({'stream' if f['stream'] else 'no stream'}) -> {what}: "
                f"{f['response'][:200]!r}; body {f['body'][:160]!r}"
            )
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


async def _hostile_one(client: httpx.AsyncClient, rng: random.Random, target, rep: Report, args) -> None:
    h = hostile_bodies.make(rng, target)
    rep.hostile_sent += 1
    rep.hostile_streamed += h.stream
    what, fault, received = await hostile_bodies.send(client, h, args.hostile_timeout)
    rep.hostile_outcomes[what] += 1
    rep.hostile_by_kind[f"{h.kind} -> {what}"] += 1
    if fault:
        rep.hostile_faults.append(
            {
                "kind": h.kind,
                "method": h.method,
                "path": h.path,
                "stream": h.stream,
                "chunked": h.chunked,
                "outcome": what,
                "at_s": round(time.monotonic() - args.t0, 2),
                "response": received[:2000].decode(errors="replace"),
                "body": h.content[:2000].decode(errors="replace"),
            }
        )
        name = json.loads(h.content).get("lora_name") if h.path == "/v1/load_lora_adapter" else None
        if what.endswith("(accepted)") and str(name).startswith("hostile-"):  # unload it: stay bounded
            await client.post("/v1/unload_lora_adapter", json={"lora_name": name})


async def _hostile_worker(client, rng, target, rep, args, deadline) -> None:
    while time.monotonic() < deadline and rep.hostile_sent < args.hostile_max_requests:
        await _hostile_one(client, rng, target, rep, args)
        await asyncio.sleep(rng.uniform(0, 2 * args.hostile_pause))


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
    hostile_fraction: float = 0.05,
    hostile_pause: float = 0.1,
    hostile_timeout: float = 30.0,
    hostile_max_requests: int = 20_000,
    big_bytes: int = 9 * 2**20,
    adapter_paths: tuple[str, list[str]] = ("x", []),
) -> Report:
    args = argparse.Namespace(
        max_tokens=max_tokens,
        disconnect_prob=disconnect_prob,
        request_timeout=request_timeout,
        hostile_pause=hostile_pause,
        hostile_timeout=hostile_timeout,
        hostile_max_requests=hostile_max_requests,
    )
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    n_hostile = max(1, round(clients * hostile_fraction)) if hostile_fraction > 0 else 0
    rep = Report(clients=clients, hostile_clients=n_hostile)
    async with (
        httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=request_timeout) as client,
        httpx.AsyncClient(base_url=url, headers=headers, timeout=hostile_timeout) as hostile_client,
    ):
        cards = (await client.get("/v1/models")).json()["data"]
        models = [m["id"] for m in cards]
        target = hostile_bodies.Target(
            models, vocab, cards[0].get("max_model_len") or 2048, big_bytes, *adapter_paths
        )
        generated0 = parse_metrics((await client.get("/metrics")).text)["loraserve_generation_tokens_total"]
        rng = random.Random(seed)
        t0 = args.t0 = time.monotonic()
        deadline = t0 + duration
        await asyncio.gather(
            *(
                _worker(client, random.Random(rng.random()), models, rep, args, vocab, deadline)
                for _ in range(clients - n_hostile)
            ),
            *(
                _hostile_worker(hostile_client, random.Random(rng.random()), target, rep, args, deadline)
                for _ in range(n_hostile)
            ),
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
        try:
            rep.health = str((await client.get("/health", timeout=10)).status_code)
        except httpx.HTTPError as e:
            rep.health = f"transport error {type(e).__name__}"
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


def serve_tiny(
    d: Path, num_adapters: int, max_loras: int, extra: list[str], log: Path
) -> tuple[subprocess.Popen, str, tuple[str, list[str]]]:
    """The server, its URL, and (a loadable adapter, adapters to refuse) under its --lora-root."""
    base, adapters = make_tiny_setup(d, num_adapters)
    adapter_paths = hostile_bodies.make_bad_adapters(d / "lora-root", adapters[0][1], base)
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
        "--allow-runtime-lora-updating",
        "--lora-root",
        str(d / "lora-root"),
        *extra,
    ]
    print("server:", " ".join(cmd), f"(log: {log})", file=sys.stderr)
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=f, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, adapter_paths
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
    p.add_argument("--hostile-fraction", type=float, default=0.05, help="share of clients that are hostile")
    p.add_argument(
        "--hostile-pause", type=float, default=0.1, help="mean seconds between a hostile client's requests"
    )
    p.add_argument(
        "--hostile-max-requests", type=int, default=20_000, help="hostile requests in all, at most"
    )
    p.add_argument(
        "--big-body-bytes", type=int, default=9 * 2**20, help="an oversized body (the server caps at 8 MiB)"
    )
    p.add_argument("--server-log", type=Path, default=None, help="--tiny: keep the server's output here")
    p.add_argument("--report-json", type=Path, default=None, help="write the report (every fault) here")
    args = p.parse_args(argv)
    if (args.url is None) == (not args.tiny):
        p.error("pass either --url URL or --tiny")
    if not 0 <= args.hostile_fraction < 1:
        p.error("--hostile-fraction must be in [0, 1)")
    proc, rep = None, None
    with tempfile.TemporaryDirectory() as tmp:
        url, adapter_paths = args.url, ("x", [])
        log = args.server_log or Path(tmp) / "server.log"
        if args.tiny:
            proc, url, adapter_paths = serve_tiny(
                Path(tmp), args.adapters, args.max_loras, args.server_arg, log
            )
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
                    hostile_fraction=args.hostile_fraction,
                    hostile_pause=args.hostile_pause,
                    hostile_max_requests=args.hostile_max_requests,
                    big_bytes=args.big_body_bytes,
                    adapter_paths=adapter_paths,
                )
            )
        finally:
            if proc is not None:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(30)
                elif rep is not None:
                    rep.server_exit = proc.returncode
        if proc is not None and not rep.ok:  # what the server logged about it
            noted = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            print(f"server log ({len(noted)} lines), the last 40:", *noted[-40:], sep="\n  ")
    print(rep.summary())
    if args.report_json:  # NOTE: asdict rebuilds a Counter from (key, count) pairs: pass it as a dict
        report = {**asdict(rep), "hostile_outcomes": dict(rep.hostile_outcomes)}
        report["hostile_by_kind"] = dict(sorted(rep.hostile_by_kind.items()))
        args.report_json.write_text(json.dumps(report, indent=1, default=str))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
