"""bench_scale.py's matrix: defaults, presets, command line, and the row specs of one batch size."""

from __future__ import annotations

import argparse

import torch
from dummy import SHAPES
from scale_workload import ADAPTER_SHAPES

BLOCK_KEYS = ("lengths", "modes", "adapters", "dists", "starts")
DEFAULTS = dict(
    shape=None, adapter_shapes="all-linear-16", batches="32,256", max_loras="8,512", lengths="fixed,varied",
    modes="offline,poisson", adapters="1,8,64,256,2000", dists="uniform,zipf1.0,zipf1.5,distinct",
    starts="warm,cold", rates="0.8", poisson_mult=2, prompt_len=128, new_tokens=128, prompt_range="64-512",
    output_range="32-256", max_files=256, preregister=0, probe="first", probe_reps=3, over_slots="skip",
    hf=False, hf_adapters="8,64", hf_batch=64, hf_new_tokens=16, hf_reserve_s=150.0, budget_s=540.0,
    reserve_gb=4.0, max_batched_tokens=4096, threads=0,
)  # fmt: skip
PRESETS = {
    "smoke": dict(
        shape="tiny", batches="6", max_loras="3", prompt_len=8, new_tokens=4, prompt_range="4-16",
        output_range="2-6", rates="0.8", poisson_mult=2, max_files=16, probe_reps=1, hf=True, hf_adapters="2,4",
        hf_batch=4, hf_new_tokens=3, hf_reserve_s=10.0, budget_s=120.0, threads=1,
        blocks=[
            dict(lengths="fixed", modes="offline", adapters="1,3", dists="uniform,zipf1.0,zipf1.5,distinct",
                 starts="warm,cold"),
            dict(lengths="varied", modes="poisson", adapters="3,6", dists="uniform", starts="warm,cold"),
        ],
    ),
    "gpu-core": dict(
        shape="llama-3.1-8b", adapter_shapes="all-linear-16", batches="32,256", max_loras="8,512",
        max_files=256,
        blocks=[
            dict(lengths="fixed", modes="offline", adapters="8,64,256", dists="distinct", starts="warm"),
            dict(lengths="fixed", modes="offline", adapters="8,64", dists="distinct", starts="cold"),
        ],
    ),
    "slora": dict(
        shape="llama-3.1-8b", adapter_shapes="slora-8", batches="256", max_loras="256", preregister=2000,
        max_files=512, rates="0.8", poisson_mult=2,
        blocks=[
            dict(lengths="varied", modes="offline,poisson", adapters="8,2000", dists="uniform", starts="warm,cold"),
        ],
    ),
    "hf": dict(
        shape="llama-3.1-8b", adapter_shapes="all-linear-16", batches="64", max_loras="64", max_files=64,
        probe="none", hf=True, hf_adapters="8,64", hf_batch=64, hf_new_tokens=16,
        blocks=[dict(lengths="fixed", modes="offline", adapters="8,64", dists="distinct", starts="warm")],
    ),
}  # fmt: skip


def csv(s, kind=str) -> list:
    return [kind(x) for x in str(s).split(",") if x != ""]


def span(s: str) -> tuple[int, int]:
    lo, hi = s.split("-")
    return int(lo), int(hi)


def parse_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Flags over the preset over DEFAULTS; a block flag (--adapters, --dists, ...) replaces it in every block."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument(
        "--shape", help=f"one of {sorted(SHAPES)} or tiny (default: llama-3.1-8b on a GPU, tiny on the CPU)"
    )
    ap.add_argument("--adapter-shape", dest="adapter_shapes", help=f"comma list of {sorted(ADAPTER_SHAPES)}")
    ap.add_argument("--batches", help="comma list, e.g. 32,256")
    ap.add_argument("--max-loras", help="comma list; each is one engine (halved until it fits)")
    ap.add_argument("--adapters", help="comma list of distinct adapter counts, e.g. 1,8,64,256,2000")
    ap.add_argument("--dists", help="comma list of uniform, zipf1.0, zipf1.5, distinct")
    ap.add_argument("--starts", help="comma list of warm, cold")
    ap.add_argument("--modes", help="comma list of offline, poisson")
    ap.add_argument("--lengths", help="comma list of fixed, varied")
    ap.add_argument(
        "--rate", dest="rates", help="poisson rate(s) as fractions of the base's offline request rate"
    )
    ap.add_argument("--poisson-mult", type=int, help="poisson rows serve this many x batch requests")
    ap.add_argument("--prompt-len", type=int)
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--prompt-range", help="varied prompts, e.g. 64-512")
    ap.add_argument("--output-range", help="varied outputs, e.g. 32-256")
    ap.add_argument("--max-files", type=int, help="distinct adapter files written; more ids reuse them")
    ap.add_argument("--preregister", type=int, help="adapters registered (add_lora) when each engine starts")
    ap.add_argument(
        "--probe", choices=["first", "all", "none"], help="cold-start TTFT probe on which configs"
    )
    ap.add_argument("--probe-reps", type=int)
    ap.add_argument("--over-slots", choices=["skip", "run"])
    ap.add_argument("--hf", action="store_true", default=None, help="also HF + PEFT mixed-batch generate")
    ap.add_argument("--hf-adapters", help="comma list, e.g. 8,64")
    ap.add_argument("--hf-batch", type=int)
    ap.add_argument("--hf-new-tokens", type=int)
    ap.add_argument("--hf-reserve-s", type=float, help="seconds of the budget kept for --hf")
    ap.add_argument("--budget-s", type=float, help="rows that would end past this many seconds are skipped")
    ap.add_argument(
        "--reserve-gb", type=float, help="device memory an engine must leave free after its warm-up"
    )
    ap.add_argument("--max-batched-tokens", type=int)
    ap.add_argument("--threads", type=int, help="CPU only: torch threads (0 = torch's default)")
    ap.add_argument(
        "--llm-arg", action="append", default=[], metavar="KEY=JSON", help="extra LLM(...) argument"
    )
    ap.add_argument("--dtype", default=None, help="default bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where adapter files go (default: a temp dir, removed)")
    ap.add_argument("--json", default=None, help="write every raw number here (rewritten after each row)")
    args = ap.parse_args(argv)
    preset = PRESETS.get(args.preset, {})
    blocks = [dict(b) for b in preset.get("blocks", [{k: DEFAULTS[k] for k in BLOCK_KEYS}])]
    for b in blocks:
        b.update({k: getattr(args, k) for k in BLOCK_KEYS if getattr(args, k) is not None})
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, preset.get(k, v))
    if args.shape is None:
        args.shape = "llama-3.1-8b" if torch.cuda.is_available() else "tiny"
    if args.shape == "tiny":
        args.shape = "tiny-llama"
    args.blocks = blocks
    return args


def plan_rows(args, batch: int) -> list[dict]:
    """The row specs of one batch size, in run order: per lengths group, offline before poisson, warm before cold."""
    specs, seen = [], set()
    for b in args.blocks:
        for lk in csv(b["lengths"]):
            for mode in csv(b["modes"]):
                for rate in csv(args.rates, float) if mode == "poisson" else [None]:
                    for n in csv(b["adapters"], int):
                        for dist in csv(b["dists"]):
                            for start in csv(b["starts"]):
                                key = (lk, mode, rate, n, dist, start)
                                if key not in seen:
                                    seen.add(key)
                                    specs.append(dict(batch=batch, lengths=lk, mode=mode, rate=rate, adapters=n,
                                                      dist=dist, start=start))  # fmt: skip
    order = {"offline": 0, "poisson": 1, "warm": 0, "cold": 1}
    return sorted(specs, key=lambda s: (s["lengths"], order[s["mode"]], s["rate"] or 0, order[s["start"]]))
