"""The prefill LoRA ops timed two ways in one run: alone after triton's L2 flush, and back to back.

``do_bench`` clears the L2 before each run by writing zeros over 256 MB (``cache.zero_()``), so a kernel
timed that way starts with the L2 full of dirty lines (up to the L2's size, ~50 MB on an H100 / H200)
that must reach DRAM before it can hold the kernel's own lines: a read-only kernel (the shrink) pays for
writes it never made, and a kernel that writes ends while its own last dirty lines still sit in the L2.
The copy bandwidth the tables compare against is a 2 GiB copy, where neither edge matters.

``back to back``: one CUDA graph runs the op over ``SETS`` distinct sets of inputs (x, y; the LoRA
weights shared, as a layer's are), ``LOOPS`` times over, no flush; replayed 10 times between two
events, µs per op. No op finds its inputs in the L2 (each set is > 80 MB and the others come between),
and each op pays for its own write-backs (the next op's time holds the previous one's, in a steady
stream): the steady state of a model's stream of prefill kernels, and the same accounting as the 2 GiB
copy. Floors timed the same two ways: x read once (a torch reduction) and y read and written in place.

    python benchmarks/gpu/steady_state.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

from loraserve.lora.ops.triton import lora_prefill as prefill_mod
from loraserve.lora.ops.triton import lora_shrink as shrink_mod
from loraserve.lora.ops.triton_ops import TritonLoRAOps

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_kernels import PREFILL_CASES, copy_bandwidth, graph_of, prefill_inputs  # noqa: E402

DEV = torch.device("cuda")
SETS, LOOPS = 4, 5


def flushed_us(fn) -> float:
    """One call from a CUDA graph, do_bench's way (L2 zeroed before each run): median µs."""
    return do_bench(graph_of(fn).replay, warmup=25, rep=200, return_mode="median") * 1e3


def steady_us(fns) -> float:
    """µs per call of ``fns`` (one per input set) run LOOPS times over from one graph, back to back."""
    g = graph_of(lambda: [f() for _ in range(LOOPS) for f in fns])
    g.replay()
    torch.cuda.synchronize()
    runs = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) * 1e3 / (10 * LOOPS * len(fns)))
    return statistics.median(runs)


def op_bytes(T, S, K, outs, rank, w) -> int:
    """What one add_lora_linear moves (bench_lora_kernels' count): x, every adapter's A and B (``w`` bytes an
    element), y read and written (bf16), s written and read (fp32)."""
    return T * K * 2 + S * rank * (len(outs) * K + sum(outs)) * w + 2 * T * sum(outs) * 2 + 2 * len(outs) * T * rank * 4


def op_sets(ops, wdtype, T, S, K, outs, rank):
    """SETS input sets of one prefill case sharing its LoRA weights: (the op on each set, the shrink alone on
    each set, xs, ys, meta)."""
    sets = [prefill_inputs(wdtype, T, S, K, outs, rank) for _ in range(SETS)]
    meta, As, Bs, _, _, ranks = sets[0]
    xs, ys = [s[3] for s in sets], [s[4] for s in sets]
    rank_list = [rank] * S  # one list: the ops cache its device copy by the list's id
    op = [lambda i=i: ops.add_lora_linear(ys[i], xs[i], As, Bs, rank_list, meta) for i in range(SETS)]
    shrink = [lambda i=i: shrink_mod.lora_shrink(xs[i], As, meta, ranks, rank) for i in range(SETS)]
    return op, shrink, xs, ys, meta


def bench_case(ops, wdtype, name, T, S, K, outs, report, floors: bool, rank: int = 16) -> None:
    """One op at one LoRA dtype: the default two launches, the shrink alone, the opt-in one launch (and,
    with ``floors``, x read once and y read + written), each timed both ways."""
    op, shrink, xs, ys, meta = op_sets(ops, wdtype, T, S, K, outs, rank)
    w = torch.finfo(wdtype).bits // 8
    nbytes = op_bytes(T, S, K, outs, rank, w)
    if floors:
        sums = [torch.empty(T, device=DEV) for _ in xs]
        read_x = [lambda i=i: torch.sum(xs[i], dim=1, dtype=torch.float32, out=sums[i]) for i in range(SETS)]
        rw_y = [lambda i=i: ys[i].mul_(1.0) for i in range(SETS)]
        report(name, "-", T * K * 2, "x read (torch sum)", flushed_us(read_x[0]), steady_us(read_x))
        report(name, "-", 2 * T * sum(outs) * 2, "y read + written (torch mul_)", flushed_us(rw_y[0]), steady_us(rw_y))
    dt = str(wdtype)[6:]
    report(name, dt, nbytes, "shrink + expand (default)", flushed_us(op[0]), steady_us(op))
    sb = T * K * 2 + S * rank * len(outs) * K * w + len(outs) * T * rank * 4  # x, A, s written
    report(name, dt, sb, "shrink alone", flushed_us(shrink[0]), steady_us(shrink))
    if wdtype == torch.float16:  # the shrink's products in tf32 (lora_shrink.FP16_X off; before session 18)
        fp16_x, shrink_mod.FP16_X = shrink_mod.FP16_X, False
        try:
            report(name, dt, nbytes, "shrink + expand, tf32 shrink", flushed_us(op[0]), steady_us(op))
            report(name, dt, sb, "shrink alone, tf32", flushed_us(shrink[0]), steady_us(shrink))
        finally:
            shrink_mod.FP16_X = fp16_x
    enabled, prefill_mod.ENABLED = prefill_mod.ENABLED, True
    try:
        if prefill_mod.applies(meta, rank, len(outs)):
            report(name, dt, nbytes, "one launch (opt-in)", flushed_us(op[0]), steady_us(op))
    finally:
        prefill_mod.ENABLED = enabled


def sweep_expand(ops, bw: float) -> None:
    """The expand's prefill tiles (``lora_expand.PREFILL``) timed back to back in the whole op, fp16 LoRA
    weights (auto's GPU storage), every 4096-token case; each candidate's y checked against the default's.
    Prints each case's best and the candidate with the least time summed over the cases."""
    import itertools

    from loraserve.lora.ops.triton import lora_expand as expand_mod

    default = expand_mod.PREFILL
    grid = [expand_mod.PrefillTiles(block_m=bm, block_n=bn, num_warps=w)
            for bm, bn, w in itertools.product((16, 32, 64, 128), (64, 128, 256), (2, 4, 8))
            if bm * bn <= 128 * 128 and bm * bn >= 16 * 128]  # fmt: skip
    total = {t: 0.0 for t in grid}
    print("| op | expand tiles (block_m, block_n, warps) | back to back µs | % copy BW | default µs |")
    print("|---|---|---:|---:|---:|")
    for name, T, S, K, outs in PREFILL_CASES:
        rank = 16
        op, _, _, ys, _ = op_sets(ops, torch.float16, T, S, K, outs, rank)
        nbytes = op_bytes(T, S, K, outs, rank, 2)
        y0 = ys[0].clone()
        expand_mod.PREFILL = default
        op[0]()
        want = ys[0].float().clone()
        d_us = steady_us(op)
        best = None
        for t in grid:
            expand_mod.PREFILL = t
            ys[0].copy_(y0)
            op[0]()
            torch.cuda.synchronize()
            err = ((ys[0].float() - want).norm() / want.norm()).item()
            us = steady_us(op) if err < 1e-6 else float("inf")
            total[t] += us
            if best is None or us < best[0]:
                best = (us, t)
        expand_mod.PREFILL = default
        us, t = best
        print(f"| {name} | {t.block_m}, {t.block_n}, {t.num_warps} | {us:.1f} | {100 * nbytes / (us * 1e-6) / bw:.0f}% "
              f"| {d_us:.1f} |", flush=True)  # fmt: skip
        del ys, op
        torch.cuda.empty_cache()
    ranked = sorted(total.items(), key=lambda kv: kv[1])
    print("summed over the cases, best 5: " + "; ".join(
        f"({t.block_m}, {t.block_n}, {t.num_warps}) {us:.1f}" for t, us in ranked[:5]) +
        f"; default {total.get(default, float('nan')):.1f}")  # fmt: skip


def sweep_shrink(ops, bw: float) -> None:
    """The shrink's prefill tiles (``lora_shrink.PREFILL`` for 2-3 slice layers, ``PREFILL_ONE_SLICE`` for
    one-slice ones) timed back to back on the shrink alone, fp16 LoRA weights (fp16 products), every
    4096-token case; each candidate's s checked against the default's."""
    import dataclasses
    import itertools

    grid = [dict(block_m=bm, block_k=bk, programs=p, num_warps=w, num_stages=st)
            for (bm, w), bk, p, st in itertools.product(((32, 4), (64, 4), (64, 8), (128, 8)), (64, 128), (256, 512), (3, 4))
            if bm * bk * st <= 64 * 128 * 4]  # fmt: skip
    total = [0.0] * len(grid)
    print("| op | shrink tiles | back to back µs | x's % copy BW | default µs |")
    print("|---|---|---:|---:|---:|")
    for name, T, S, K, outs in PREFILL_CASES:
        rank = 16
        _, shrink, _, _, _ = op_sets(ops, torch.float16, T, S, K, outs, rank)
        attr = "PREFILL" if len(outs) > 1 else "PREFILL_ONE_SLICE"
        default = getattr(shrink_mod, attr)
        want = shrink[0]().clone()
        d_us = steady_us(shrink)
        best = None
        try:
            for j, kw in enumerate(grid):
                setattr(shrink_mod, attr, dataclasses.replace(default, **kw))
                got = shrink[0]()
                err = ((got - want).norm() / want.norm()).item()
                us = steady_us(shrink) if err < 1e-5 else float("inf")
                total[j] += us
                if best is None or us < best[0]:
                    best = (us, kw)
        finally:
            setattr(shrink_mod, attr, default)
        us, kw = best
        print(f"| {name} | {tuple(kw.values())} | {us:.1f} | {100 * T * K * 2 / (us * 1e-6) / bw:.0f}% | {d_us:.1f} |",
              flush=True)  # fmt: skip
        del shrink
        torch.cuda.empty_cache()
    ranked = sorted(zip(total, range(len(grid))))
    print("summed over the cases, best 5 (block_m, block_k, programs, warps, stages): " + "; ".join(
        f"{tuple(grid[j].values())} {us:.1f}" for us, j in ranked[:5]))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep-expand", action="store_true", help="only the expand's tile sweep, back to back")
    ap.add_argument("--sweep-shrink", action="store_true", help="only the shrink's tile sweep (fp16 A), back to back")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__}; copy {bw / 1e12:.2f} TB/s")
    print("| op | LoRA dtype | MB | kernels | flushed µs | % copy BW | back to back µs | % copy BW |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    rows = []
    ops = TritonLoRAOps(DEV)
    if args.sweep_expand or args.sweep_shrink:
        if args.sweep_shrink:
            sweep_shrink(ops, bw)
        if args.sweep_expand:
            sweep_expand(ops, bw)
        return

    def report(op, dtype, nbytes, kernels, f_us, s_us):
        rows.append(dict(op=op, dtype=dtype, bytes=nbytes, kernels=kernels, flushed_us=f_us, steady_us=s_us))
        print(f"| {op} | {dtype} | {nbytes / 1e6:.1f} | {kernels} | {f_us:.1f} | {100 * nbytes / (f_us * 1e-6) / bw:.0f}% "
              f"| {s_us:.1f} | {100 * nbytes / (s_us * 1e-6) / bw:.0f}% |", flush=True)  # fmt: skip

    done_floor = set()
    for wdtype in (torch.bfloat16, torch.float16, torch.float32):
        for case in PREFILL_CASES:
            bench_case(ops, wdtype, *case, report, floors=case[0] not in done_floor)
            done_floor.add(case[0])
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
