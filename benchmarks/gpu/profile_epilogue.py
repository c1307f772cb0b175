"""Nsight Compute's view of the LoRA'd decode GEMM against the plain one (H200, Llama-8B shapes, 32 tokens).

Runs, between cudaProfilerStart and cudaProfilerStop, each op of a Llama-8B layer once without LoRA
and once with the expand epilogue on a ready shrink buffer (8 slots of rank 16, no PDL: Nsight Compute
serializes kernels anyway), so that a profile taken with ``--profile-from-start off`` holds exactly
those launches, in this order (``LAUNCHES``):

    ncu --clock-control none --profile-from-start off --set full --import-source yes \
        -k regex:_decode_linear_kernel -o OUT/epilogue python3 benchmarks/gpu/profile_epilogue.py
    python3 benchmarks/gpu/profile_epilogue.py --summarize OUT   # after ncu --import ... --csv (run_device.sh ncu)

Why: twelve sessions measured that a one-wave GEMM ends 1.5-2 µs later with any LoRA work attached to its
epilogue, whatever that work is (BENCHMARKS.md sessions 10-12); timing variants could not say which
instructions the time goes to, the warp-state samples per instruction can.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import defaultdict
from pathlib import Path

OPS = [("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate_up", 4096, (14336, 14336)), ("down", 14336, (4096,))]
LORA_DTYPES = ("bf16", "fp32")
LAUNCHES = [(name, variant) for dt in LORA_DTYPES for name, _, _ in OPS for variant in ("base", f"lora-{dt}")]


def run() -> None:
    import torch

    from loraserve.layers import triton_decode_linear as dl
    from loraserve.lora.ops.triton.lora_shrink import lora_shrink
    from loraserve.lora.ops.triton_ops import TritonLoRAOps

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_decode_linear import DEV, Case

    ops = TritonLoRAOps(DEV)
    calls = []
    for dt in LORA_DTYPES:
        lora_dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        for _name, K, slices in OPS:
            case = Case(K, slices, 32, 1, lora_dtype=lora_dtype)
            rank_dev = ops.ranks_tensor(case.ranks)
            R = case.As[0][0].shape[2]
            buf = lora_shrink(case.x, case.As[0], case.meta, rank_dev, R, reduce=ops.shrink_reduces, zero_fill=True)
            epi = dl.ExpandEpilogue(buf, case.Bs[0], case.mapping.token_slots)
            w = case.ws[0]
            calls.append((case, lambda x=case.x, w=w: dl.decode_linear(x, w)))
            calls.append((case, lambda x=case.x, w=w, epi=epi: dl.decode_linear(x, w, lora=epi)))
    profile_once([fn for _, fn in calls])
    print(f"profiled {len(calls)} launches: {LAUNCHES}")


def profile_once(calls) -> None:
    """Each call warmed (compiled) outside the profiled range, then run once inside it."""
    import torch

    for fn in calls:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def run_prefill_shrink() -> None:
    """The prefill shrink of qkv at 4096 tokens (32 sequences of 128, 8 adapters round-robin), bf16 then fp32
    A, each launched once inside the profiled range (``-k regex:_lora_shrink_kernel``)."""
    import torch

    from loraserve.lora.ops.triton.lora_shrink import lora_shrink
    from loraserve.lora.punica import LoRAMapping

    dev = torch.device("cuda")
    T, S, K, rank = 4096, 8, 4096, 16
    meta = LoRAMapping.build([(t // 128) % S for t in range(T)], [], dev).token_meta
    ranks = torch.full((S,), rank, dtype=torch.int32, device=dev)
    x = torch.randn(T, K, device=dev).bfloat16()
    calls = []
    for dt in (torch.bfloat16, torch.float32):
        A = tuple((torch.randn(S, 1, rank, K, device=dev) * 0.02).to(dt) for _ in range(3))
        calls.append(lambda A=A: lora_shrink(x, A, meta, ranks, rank))
    profile_once(calls)
    print("profiled the prefill shrink: qkv, 4096 tokens, bf16 then fp32 A")


def _rows(text: str) -> list[dict]:
    lines = [ln for ln in text.splitlines() if ln.startswith('"') and not ln.startswith('"Kernel Name"')]
    return list(csv.DictReader(io.StringIO("\n".join(lines))))


def summarize(out: Path) -> None:
    """details.csv (ncu --page details --csv) and source_<i>.csv (--page source --print-source sass --csv,
    one per launch) -> a table of durations and top stall reasons, and the hottest SASS of each LoRA launch."""
    details = _rows((out / "details.csv").read_text())
    per_launch: dict[str, dict[str, str]] = defaultdict(dict)
    for r in details:
        per_launch[r["ID"]][f"{r['Section Name']}/{r['Metric Name']}"] = f"{r['Metric Value']} {r['Metric Unit']}"
    want = ["GPU Speed Of Light Throughput/Duration", "GPU Speed Of Light Throughput/Memory Throughput",
            "GPU Speed Of Light Throughput/DRAM Throughput", "Launch Statistics/Registers Per Thread",
            "Launch Statistics/Dynamic Shared Memory Per Block", "Occupancy/Achieved Occupancy",
            "Warp State Statistics/Warp Cycles Per Issued Instruction", "Launch Statistics/Grid Size",
            "Occupancy/Theoretical Occupancy", "Launch Statistics/Waves Per SM", "Memory Workload Analysis/L2 Hit Rate",
            "GPU Speed Of Light Throughput/Compute (SM) Throughput", "Memory Workload Analysis/Mem Busy"]  # fmt: skip
    for i, (launch_id, metrics) in enumerate(sorted(per_launch.items(), key=lambda kv: int(kv[0]))):
        label = LAUNCHES[i] if i < len(LAUNCHES) and len(per_launch) == len(LAUNCHES) else ("launch", str(i))
        print(f"## launch {launch_id} {label[0]} {label[1]}")
        for k in want:
            print(f"   {k}: {metrics.get(k, '-')}")
    for path in sorted(out.glob("source_*.csv"), key=lambda p: int(p.stem.split("_")[1])):
        i = int(path.stem.split("_")[1])
        rows = _rows(path.read_text())
        if not rows:
            continue
        sample_col = next((c for c in rows[0] if c.startswith("Warp Stall Sampling (All")), None)
        if sample_col is None:
            print(f"## {path.name}: columns {list(rows[0])[:12]}")
            continue
        samples = [float(r[sample_col] or 0) for r in rows]
        executed = [int(r.get("Instructions Executed") or 0) for r in rows]
        in_loop = [j for j, e in enumerate(executed) if e == max(executed)]  # the K loop: the most executed
        lo, hi = in_loop[0], in_loop[-1]
        print(f"## {path.name} {LAUNCHES[i] if len(per_launch) == len(LAUNCHES) else ''}: {len(rows)} SASS, {sum(samples):.0f} samples: "
              f"{sum(samples[:lo]):.0f} before the K loop, {sum(samples[lo:hi + 1]):.0f} in it, {sum(samples[hi + 1:]):.0f} after "
              f"({sum(executed[hi + 1:])} warp instructions after it)")  # fmt: skip
        stalls = {c: sum(float(r[c] or 0) for r in rows) for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c}
        print("   stalls: " + ", ".join(f"{k[6:]} {v:.0f}" for k, v in sorted(stalls.items(), key=lambda kv: -kv[1])[:8]))
        hot = sorted(rows, key=lambda r: -float(r[sample_col] or 0))[:25]
        for r in hot:
            print(f"   {float(r[sample_col] or 0):7.0f}  {r.get('Address', '')}  {r.get('Source', '')[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summarize", type=Path, help="the folder of ncu's csv exports")
    p.add_argument("--prefill-shrink", action="store_true", help="profile the prefill shrink instead (run_prefill_shrink)")
    a = p.parse_args()
    if a.prefill_shrink:
        run_prefill_shrink()
    elif a.summarize:
        summarize(a.summarize)
    else:
        run()


if __name__ == "__main__":
    main()
