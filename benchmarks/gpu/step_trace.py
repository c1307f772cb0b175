"""Where a decode step's time goes: the kernel timeline of one CUDA-graph replay, base vs 8 adapters.

Builds the engine as ``bench_e2e.py`` does (random weights, 8 rank-16 adapters mixed round-robin, batch
32 x prompt 128, CUDA graphs), captures the decode graphs of the batch's bucket with and without LoRA,
replays each once under the torch profiler (CUDA activity: the graph's kernels one by one) and prints:

- the step's span and its layers' period (the time between a layer's first kernels in consecutive
  layers, median over the middle layers), base and with LoRA;
- one middle layer's kernels in order: start after the layer's first kernel, duration, and the gap
  after the kernel before it (negative: they overlapped, as PDL dependents do);
- per kernel name, µs per layer (sum of durations / layers), base and with LoRA;
- each kernel's advance of the step's end (its end minus the latest end of the kernels before it, 0 when it
  ends earlier; median over the middle layers, by position in the layer), base beside LoRA: the layer's
  critical path, which sums to about its period, kernel by kernel;
- each graph's replay time (triton do_bench, median: the GPU time of a step) and their ratio.

    python benchmarks/gpu/step_trace.py --shapes qwen2.5-0.5b,llama-3.1-8b --out /tmp/traces
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode_linear import graph_kernels  # noqa: E402
from bench_e2e import N_ADAPTERS, timed_generate  # noqa: E402
from dummy import hf_config, make_adapter, make_model_dir  # noqa: E402

from loraserve import LLM, LoRARequest  # noqa: E402

# the first kernel of each decoder layer: its input norm (fused with the residual add after layer 0; with
# the norm shrink on, the default, the norm and qkv's shrink). NOTE: two norms a layer; a model with q/k norms
# (Qwen3) runs more rms_norm kernels and would need other anchors (the two shapes here have none)
LAYER_ANCHORS = ("rms_norm", "norm_shrink")


def layer_starts(ks: list[tuple[str, float, float]]) -> list[int]:
    """Indices of each layer's first kernel: every other norm (a layer has two)."""
    norms = [i for i, (name, _, _) in enumerate(ks) if any(a in name for a in LAYER_ANCHORS)]
    return norms[::2]


def summarize(label: str, ks: list[tuple[str, float, float]], layers: int) -> dict:
    starts = layer_starts(ks)
    span = ks[-1][2] - ks[0][1]
    mid = starts[len(starts) // 4 : 3 * len(starts) // 4 + 1]
    period = statistics.median(ks[b][1] - ks[a][1] for a, b in zip(mid, mid[1:]))
    print(f"\n## {label}: {len(ks)} kernels, step span {span:.1f} µs, layer period {period:.2f} µs "
          f"({len(starts)} norms pairs found, {layers} layers)")  # fmt: skip
    i0, i1 = starts[layers // 2], starts[layers // 2 + 1]
    t0 = ks[i0][1]
    print("| kernel | start µs | dur µs | gap after previous end µs |")
    print("|---|---:|---:|---:|")
    prev_end = ks[i0 - 1][2]
    for name, a, b in ks[i0:i1]:
        print(f"| {name[:60]} | {a - t0:.1f} | {b - a:.1f} | {a - prev_end:.1f} |")
        prev_end = max(prev_end, b)
    per_name: dict[str, float] = defaultdict(float)
    for name, a, b in ks:
        per_name[name[:60]] += (b - a) / layers
    return dict(span=span, period=period, per_name=dict(per_name), advances=advances(ks, mid))


def advances(ks: list[tuple[str, float, float]], starts: list[int]) -> list[tuple[str, float]]:
    """Per position in a layer: (the kernel's name, the median over the layers from ``starts`` of how far
    its end moved the latest end so far). A kernel that ends before an earlier one advanced nothing."""
    frontier = [0.0] * len(ks)  # the latest end of ks[:i]
    for i in range(1, len(ks)):
        frontier[i] = max(frontier[i - 1], ks[i - 1][2])
    per_pos: dict[int, list[float]] = defaultdict(list)
    names: dict[int, str] = {}
    for a, b in zip(starts, starts[1:]):
        for j, i in enumerate(range(a, b)):
            per_pos[j].append(max(0.0, ks[i][2] - frontier[i]))
            names.setdefault(j, ks[i][0][:40])
    n = min(len(v) for v in per_pos.values()) if per_pos else 0  # positions every layer has
    return [(names[j], statistics.median(v)) for j, v in sorted(per_pos.items()) if len(v) == n]


def trace_shape(shape: str, root: Path, out: Path, batch: int, lora_dtype: str, new_tokens: int = 8) -> None:
    cfg = hf_config(shape)
    mdir = make_model_dir(root / shape, shape)
    adapters = [make_adapter(root / f"{shape}-a{i}", cfg, rank=16, seed=i) for i in range(N_ADAPTERS)]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, cfg.vocab_size, (batch, 128), generator=g).tolist()
    llm = LLM(
        str(mdir), dtype="bfloat16", load_format="dummy", enable_lora=True, max_loras=N_ADAPTERS,
        max_lora_rank=16, max_num_seqs=batch, max_num_batched_tokens=4096, max_model_len=512,
        num_kv_blocks=batch * (512 // 16) + 8, lora_dtype=lora_dtype,
    )  # fmt: skip
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    mixed = [reqs[i % N_ADAPTERS] for i in range(batch)]
    for loras in ([None] * batch, mixed):
        # captures the bucket's graphs; the replays below attend over the context of the last step (128 + new_tokens)
        timed_generate(llm, prompts, loras, new_tokens)
    graphs = llm.engine.runner.graphs.graphs
    layers = cfg.num_hidden_layers
    res = {}
    for (bucket, use_lora, *_variant), (graph, _) in sorted(graphs.items()):
        if bucket != batch:
            continue
        assert use_lora not in res, f"two LoRA graph variants of bucket {batch}: {list(graphs)}"
        label = f"{shape} {'8 adapters' if use_lora else 'base'} (bucket {bucket}, LoRA {lora_dtype})"
        ks = graph_kernels(graph, str(out / f"{shape}_{'lora' if use_lora else 'base'}.json"))
        res[use_lora] = summarize(label, ks, layers)
        res[use_lora]["replay_ms"] = do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    if len(res) == 2:
        b, m = res[False], res[True]
        print(f"\n{shape}: graph replay (do_bench median) {b['replay_ms']:.3f} -> {m['replay_ms']:.3f} ms "
              f"({m['replay_ms'] / b['replay_ms']:.3f}x); profiled span {b['span']:.1f} -> {m['span']:.1f} µs; "
              f"layer period {b['period']:.2f} -> {m['period']:.2f} µs")  # fmt: skip
        print("| kernel | base µs/layer | 8 adapters µs/layer |")
        print("|---|---:|---:|")
        for name in sorted(set(b["per_name"]) | set(m["per_name"]), key=lambda n: -m["per_name"].get(n, 0)):
            print(f"| {name} | {b['per_name'].get(name, 0):.2f} | {m['per_name'].get(name, 0):.2f} |")
        print("\nCritical path of a middle layer: each kernel's advance of the latest end, µs (median over the layers)")
        print("| # | base kernel | base µs | 8-adapter kernel | 8 adapters µs | difference |")
        print("|---:|---|---:|---|---:|---:|")
        ba, ma = b["advances"], m["advances"]
        for j in range(max(len(ba), len(ma))):
            bn, bv = ba[j] if j < len(ba) else ("", 0.0)
            mn, mv = ma[j] if j < len(ma) else ("", 0.0)
            print(f"| {j} | {bn} | {bv:.2f} | {mn} | {mv:.2f} | {mv - bv:+.2f} |")
        print(f"| sum | | {sum(v for _, v in ba):.2f} | | {sum(v for _, v in ma):.2f} | "
              f"{sum(v for _, v in ma) - sum(v for _, v in ba):+.2f} |")  # fmt: skip
    del llm
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b,llama-3.1-8b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lora-dtype", default="auto")
    ap.add_argument("--out", default="/tmp/step_traces")
    ap.add_argument("--new-tokens", type=int, default=8, help="tokens generated before the replays (bench_e2e: 128)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            trace_shape(shape, Path(tmp), out, args.batch, args.lora_dtype, args.new_tokens)


if __name__ == "__main__":
    main()
