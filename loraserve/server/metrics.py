"""Server metrics in Prometheus' text format (no client library: a few counters and histograms).

Counters and histograms are updated on the event-loop thread only. Engine gauges (KV blocks, LoRA
slots, queue lengths) are read on the engine thread when /metrics is scraped (``engine_stats``).
"""

from __future__ import annotations

import bisect
from collections import Counter

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


def _labels(**kw: str) -> str:
    if not kw:
        return ""
    esc = {k: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in kw.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, name: str) -> list[str]:
        lines, cum = [], 0
        for le, c in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            cum += c
            lines.append(f'{name}_bucket{{le="{le}"}} {cum}')
        lines += [f"{name}_sum {self.sum}", f"{name}_count {self.count}"]
        return lines


class ServerMetrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()  # (endpoint, HTTP status)
        self.finished: Counter[str] = Counter()  # finish_reason (abort includes client disconnects)
        self.adapter_requests: Counter[str] = Counter()  # requested model name
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def render(self, engine: dict) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {value}" for labels, value in samples)

        p = "loraserve_"
        metric(
            p + "requests_total",
            "counter",
            "HTTP requests by endpoint and status code.",
            [(_labels(endpoint=e, status=s), v) for (e, s), v in sorted(self.requests.items())],
        )
        metric(
            p + "request_finished_total",
            "counter",
            "Generation requests finished, by finish reason.",
            [(_labels(finish_reason=r), v) for r, v in sorted(self.finished.items())],
        )
        metric(
            p + "adapter_requests_total",
            "counter",
            "Generation requests accepted, by requested model/adapter.",
            [(_labels(model=m), v) for m, v in sorted(self.adapter_requests.items())],
        )
        metric(p + "prompt_tokens_total", "counter", "Prompt tokens accepted.", [("", self.prompt_tokens)])
        metric(p + "generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
        for name, h, help_ in (
            ("time_to_first_token_seconds", self.ttft, "Request arrival to its first token."),
            ("inter_token_latency_seconds", self.itl, "Time between output tokens of one sequence."),
        ):
            out.append(f"# HELP {p}{name} {help_}")
            out.append(f"# TYPE {p}{name} histogram")
            out.extend(h.render(p + name))
        gauges = [
            ("num_requests_running", "Sequences running.", engine["running"]),
            ("num_requests_waiting", "Sequences waiting.", engine["waiting"]),
            ("kv_cache_usage_ratio", "Fraction of KV blocks in use.", engine["kv_usage"]),
            ("kv_cache_free_blocks", "Free KV blocks.", engine["free_blocks"]),
            ("kv_cache_blocks", "KV blocks in all.", engine["num_blocks"]),
            (
                "lora_slots_used",
                "LoRA device slots holding an adapter (num_resident).",
                engine["lora_resident"],
            ),
            ("lora_slots", "LoRA device slots (max_loras).", engine["max_loras"]),
            ("lora_host_cache_used", "Adapters in the host cache.", engine["lora_host_cached"]),
            ("lora_host_cache_capacity", "Host cache capacity (max_cpu_loras).", engine["max_cpu_loras"]),
            ("lora_adapters_registered", "Adapters registered.", engine["lora_registered"]),
            ("lora_adapters_in_use", "Adapters with in-flight requests.", engine["lora_in_use"]),
        ]
        for name, help_, v in gauges:
            metric(p + name, "gauge", help_, [("", v)])
        metric(p + "num_preemptions_total", "counter", "Sequences preempted.", [("", engine["preemptions"])])
        metric(
            p + "lora_events_total",
            "counter",
            "LoRA manager events (loads, evictions).",
            [(_labels(event=k), v) for k, v in sorted(engine["lora_events"].items())],
        )
        return "\n".join(out) + "\n"


def engine_stats(engine) -> dict:
    """Engine gauges; call on the engine thread."""
    lm = engine.lora_manager
    stats = {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "kv_usage": engine.blocks.usage,
        "free_blocks": engine.blocks.num_free_blocks,
        "num_blocks": engine.blocks.num_blocks,
        "preemptions": engine.scheduler.num_preemptions,
        "lora_resident": 0,
        "max_loras": 0,
        "lora_host_cached": 0,
        "max_cpu_loras": 0,
        "lora_registered": 0,
        "lora_in_use": 0,
        "lora_events": {},
    }
    if lm is not None:
        ids = lm.list_adapters()
        stats.update(
            lora_resident=lm.num_resident,
            max_loras=lm.max_loras,
            lora_host_cached=lm.num_host_cached,
            max_cpu_loras=lm.config.max_cpu_loras,
            lora_registered=len(ids),
            lora_in_use=sum(1 for i in ids if lm.in_use(i)),
            lora_events=dict(lm.stats),
        )
    return stats


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (for tests and the load test)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
