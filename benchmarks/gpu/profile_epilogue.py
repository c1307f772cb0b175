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
    for _, fn in calls:  # compile and warm every variant outside the profiled range
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for _, fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled {len(calls)} launches: {LAUNCHES}")


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
            "Warp State Statistics/Warp Cycles Per Issued Instruction"]  # fmt: skip
    for i, (launch_id, metrics) in enumerate(sorted(per_launch.items(), key=lambda kv: int(kv[0]))):
        label = LAUNCHES[i] if i < len(LAUNCHES) else ("?", "?")
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
        print(f"## {path.name} {LAUNCHES[i] if i < len(LAUNCHES) else ''}: {len(rows)} SASS, {sum(samples):.0f} samples: "
              f"{sum(samples[:lo]):.0f} before the K loop, {sum(samples[lo:hi + 1]):.0f} in it, {sum(samples[hi + 1:]):.0f} after "
              f"({sum(executed[hi + 1:])} warp instructions after it)")  # fmt: skip
        hot = sorted(rows, key=lambda r: -float(r[sample_col] or 0))[:25]
        for r in hot:
            print(f"   {float(r[sample_col] or 0):7.0f}  {r.get('Address', '')}  {r.get('Source', '')[:90]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summarize", type=Path, help="the folder of ncu's csv exports")
    a = p.parse_args()
    if a.summarize:
        summarize(a.summarize)
    else:
        run()


if __name__ == "__main__":
    main()
