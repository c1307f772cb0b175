"""Decode-size linear layers on the GPU: cuBLAS vs ``decode_linear``, and the LoRA'd layer unfused
(cuBLAS GEMM + shrink + expand) vs fused (shrink + GEMM with the expand in its epilogue).

Each measurement is a CUDA graph of the op over ``--layers`` distinct weight copies (so W streams from
HBM as in a real decode step, not from L2), replayed by ``triton.testing.do_bench``; µs per op = graph
time / layers. x is bf16, weights bf16; LoRA: 8 slots of rank 16 (fp32 as PEFT loads them, or bf16),
tokens round-robin over the slots. % BW = bytes of W (+ the active A and B) / time, against a
device-to-device copy measured in the same run.

    python benchmarks/gpu/bench_decode_linear.py                # the table (default tiles)
    python benchmarks/gpu/bench_decode_linear.py --tune         # the tile sweep at M = 32 first
    python benchmarks/gpu/bench_decode_linear.py --matrix       # the LoRA cost per op under each variant (MATRIX)
    python benchmarks/gpu/bench_decode_linear.py --lora-tune    # the fused LoRA op's time per tile config
    python benchmarks/gpu/bench_decode_linear.py --trace DIR    # each kernel's start and end in a graph replay
    python benchmarks/gpu/bench_decode_linear.py --gated        # gate_up + SiLU-and-mul: the delta in the GEMM or the activation
    python benchmarks/gpu/bench_decode_linear.py --augmented    # the delta as more K of the base GEMM, against today's path
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from loraserve.layers import triton_decode_linear as dl
from loraserve.lora.ops import precision, triton_ops
from loraserve.lora.ops.triton import expand_block
from loraserve.lora.ops.triton import utils as triton_utils
from loraserve.lora.ops.triton.lora_shrink import lora_shrink
from loraserve.lora.ops.triton_ops import TritonLoRAOps
from loraserve.lora.punica import LoRAMapping

DEV = torch.device("cuda")
# name, K, slices (sum = N); lm_head: base only
SHAPES = {
    "llama-8b": [
        ("qkv", 4096, (4096, 1024, 1024)),
        ("o", 4096, (4096,)),
        ("gate_up", 4096, (14336, 14336)),
        ("down", 14336, (4096,)),
        ("lm_head", 4096, (128256,)),
    ],
    "qwen-0.5b": [
        ("qkv", 896, (896, 128, 128)),
        ("o", 896, (896,)),
        ("gate_up", 896, (4864, 4864)),
        ("down", 4864, (896,)),
        ("lm_head", 896, (151936,)),
    ],
}


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def graph_us(fn, layers: int) -> float:
    """GPU µs per op: fn() runs the op once per layer; captured once, replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: compiles the kernels
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=5, rep=40, return_mode="median") * 1e3 / layers


class Case:
    """One shape at M tokens: ``layers`` copies of W (and of the LoRA stacks), x, the mapping."""

    def __init__(self, K: int, slices: tuple[int, ...], M: int, layers: int, lora_dtype=None, S=8, R=16):
        g = torch.Generator(device=DEV).manual_seed(0)
        N = sum(slices)
        self.M, self.K, self.N, self.slices = M, K, N, slices
        self.x = torch.randn(M, K, device=DEV, generator=g).bfloat16()
        self.ws = [(torch.randn(N, K, device=DEV, generator=g) * 0.02).bfloat16() for _ in range(layers)]
        self.lora = None
        if lora_dtype is not None:
            slots = [t % S for t in range(M)]
            self.mapping = LoRAMapping.build(slots, slots, DEV)
            self.meta = self.mapping.token_meta
            self.ranks = [R] * S
            self.As = [
                tuple((torch.randn(S, 1, R, K, device=DEV, generator=g) * 0.02).to(lora_dtype) for _ in slices)
                for _ in range(layers)
            ]
            self.Bs = [
                tuple((torch.randn(S, 1, n, R, device=DEV, generator=g) * 0.02).to(lora_dtype) for n in slices)
                for _ in range(layers)
            ]
            active = min(S, M)
            el = torch.empty((), dtype=lora_dtype).element_size()
            self.lora_bytes = active * R * (K * len(slices) + N) * el
        self.w_bytes = N * K * 2

    def bytes(self) -> int:
        return self.w_bytes + (self.lora_bytes if hasattr(self, "lora_bytes") else 0)


def bench_base(case: Case, tiles: dl.DecodeTiles | None) -> tuple[float, float]:
    """(cuBLAS µs, decode_linear µs) per op."""
    out = {}

    def cublas():
        for w in case.ws:
            out["y"] = F.linear(case.x, w)

    def ours():
        for w in case.ws:
            out["y"] = dl.decode_linear(case.x, w, tiles=tiles)

    return graph_us(cublas, len(case.ws)), graph_us(ours, len(case.ws))


def fused_epilogue(case: Case, ops: TritonLoRAOps, A, B, rank_dev, R) -> dl.ExpandEpilogue:
    """The LoRA epilogue as linear_with_lora builds it: the shrink launched first (PDL)."""
    buf = lora_shrink(case.x, A, case.meta, rank_dev, R, zero_fill=True)
    return dl.ExpandEpilogue(buf, B, case.mapping.token_slots, pdl=ops_pdl(case.x.device))


def bench_lora(case: Case, ops: TritonLoRAOps, tiles: dl.DecodeTiles | None) -> tuple[float, float]:
    """(unfused µs, fused µs) per LoRA'd op, 8 adapters mixed."""
    rank_dev = ops.ranks_tensor(case.ranks)
    R = case.As[0][0].shape[2]

    def unfused():
        for w, A, B in zip(case.ws, case.As, case.Bs):
            y = F.linear(case.x, w)
            ops.add_lora_linear(y, case.x, A, B, case.ranks, case.meta)

    def fused():  # the engine's path (TritonLoRAOps.linear_with_lora), with these tiles
        for w, A, B in zip(case.ws, case.As, case.Bs):
            dl.decode_linear(case.x, w, lora=fused_epilogue(case, ops, A, B, rank_dev, R), tiles=tiles)

    return graph_us(unfused, len(case.ws)), graph_us(fused, len(case.ws))


def bench_parts(case: Case, ops: TritonLoRAOps, tiles: dl.DecodeTiles | None) -> tuple[float, float]:
    """(shrink + plain GEMM µs, GEMM with the epilogue on a precomputed buf µs) per op: which half of the
    fused op's LoRA cost is the shrink launch and which the epilogue."""
    rank_dev = ops.ranks_tensor(case.ranks)
    R = case.As[0][0].shape[2]
    bufs = [lora_shrink(case.x, A, case.meta, rank_dev, R, zero_fill=True) for A in case.As]

    def shrink_then_gemm():
        for w, A in zip(case.ws, case.As):
            lora_shrink(case.x, A, case.meta, rank_dev, R, zero_fill=True)
            dl.decode_linear(case.x, w, tiles=tiles)

    def epilogue_only():
        for w, B, buf in zip(case.ws, case.Bs, bufs):
            dl.decode_linear(case.x, w, lora=dl.ExpandEpilogue(buf, B, case.mapping.token_slots), tiles=tiles)

    return graph_us(shrink_then_gemm, len(case.ws)), graph_us(epilogue_only, len(case.ws))


def ops_pdl(device) -> bool:
    return triton_ops.use_pdl(device)


MATRIX = {  # name -> (what it changes, how): the LoRA paths' constants and dtypes, one at a time against the default
    "default": ("a lora_shrink launch that sums its splits, then the GEMM with the expand in its epilogue (PDL); "
                "fp16 A and B (auto's storage for a bf16 model on the GPU), tf32 products", {}),
    "fp32 LoRA": ("A and B stored in fp32 (--lora-dtype float32): no B pull, a slice a shrink program",
                  {"lora_dtype": torch.float32}),
    "64 columns per MMA": ("the epilogue's MMAs over 4 slots of rank 16 (2 chunks): fewer registers (MMA_COLUMNS)",
                           {"epi_cols": 64}),
    "32 columns per MMA": ("the epilogue's MMAs over 2 slots (4 chunks): fewer still", {"epi_cols": 32}),
    "bf16 LoRA": ("A and B stored in bf16 (the model's dtype)", {"lora_dtype": torch.bfloat16}),
    "fp16 products": ("x and s cast to fp16 for fp16 MMAs (not what the engine does: x may overflow fp16)",
                      {"mixed_fp32": False}),
    "no PDL": ("two ordinary launches (what a GPU before sm_90 runs)", {"pdl": False}),
    "B to L2 2 steps ahead": ("each LoRA'd GEMM program pulls its epilogue's B into L2 2 K steps before its loop "
                              "ends (PREFETCH_B_AHEAD)", {"pf_ahead": 2}),
    "B 8 steps ahead": ("B pulled 8 K steps before the end", {"pf_ahead": 8}),
    "shrink K blocks 256/1024": ("down's decode shrink on K blocks of 1024 (half the programs; DECODE_BLOCK_K)",
                                 {"block_k": (256, 1024)}),
}
PARTS = ("default", "bf16 LoRA", "fp32 LoRA")
# the LoRA weights' dtype of every row that names none: what auto stores for a bf16 model on the GPU
DEFAULT_LORA_DTYPE = torch.float16  # configs whose cost is also split into shrink and epilogue


def matrix(layers: int, only: list[str] | None = None) -> list[dict]:
    """LoRA cost per Llama-8B op at 32 tokens (8 adapters mixed; DEFAULT_LORA_DTYPE unless a knob says another), unfused and
    fused, per knob of MATRIX."""
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    rows = []
    bases: dict[bool, dict[str, tuple[float, float]]] = {}

    def base_times() -> dict[str, tuple[float, float]]:
        """(cuBLAS, decode_linear) µs per op with PDL or not, which the base GEMM takes part in: each variant's
        LoRA cost is measured against the base GEMM of the same setting."""
        chain = triton_utils.pdl_chain(DEV)
        if chain not in bases:
            bases[chain] = {}
            for name, K, slices in SHAPES["llama-8b"][:4]:
                case = Case(K, slices, 32, layers)
                bases[chain][name] = bench_base(case, dl.default_tiles(32, case.N, K, torch.bfloat16))
                del case
        return bases[chain]

    # NOTE: module constants, read at each launch, set here for one row and put back
    saved = (triton_utils._pdl_on, shrink_mod.DECODE_BLOCK_K, expand_block.MMA_COLUMNS, dl.PREFETCH_B_AHEAD,
             precision.MIXED_HALVES_IN_FP32)  # fmt: skip
    for cfg, (what, knobs) in MATRIX.items():
        if only and cfg not in only:
            continue
        if knobs.get("pdl") is False:
            triton_utils._pdl_on = lambda index: False
        shrink_mod.DECODE_BLOCK_K = knobs.get("block_k", saved[1])
        expand_block.MMA_COLUMNS = knobs.get("epi_cols", saved[2])
        dl.PREFETCH_B_AHEAD = knobs.get("pf_ahead", saved[3])
        precision.MIXED_HALVES_IN_FP32 = knobs.get("mixed_fp32", saved[4])
        ops = TritonLoRAOps(DEV)
        base = base_times()
        for name, K, slices in SHAPES["llama-8b"][:4]:
            lc = Case(K, slices, 32, layers, lora_dtype=knobs.get("lora_dtype", DEFAULT_LORA_DTYPE))
            tiles = dl.default_tiles(32, lc.N, K, torch.bfloat16)
            t_unf, t_fus = bench_lora(lc, ops, tiles)
            err = check(lc, ops, tiles)
            t_cublas, t_ours = base[name]
            if cfg in PARTS:
                t_sh, t_epi = bench_parts(lc, ops, tiles)
                print(f"| {cfg} parts | {name} | shrink + plain GEMM costs {t_sh - t_ours:.1f} µs | "
                      f"epilogue on a ready buf costs {t_epi - t_ours:.1f} µs | fused {t_fus - t_ours:.1f} µs |", flush=True)  # fmt: skip
            rows.append(dict(cfg=cfg, what=what, op=name, cublas_us=t_cublas, ours_us=t_ours, unfused_us=t_unf,
                             fused_us=t_fus, cost_unfused=t_unf - t_cublas, cost_fused=t_fus - t_ours, err=err))  # fmt: skip
            print(f"| {cfg} | {name} | {t_cublas:.1f} | {t_unf:.1f} | {t_unf - t_cublas:.1f} | {t_ours:.1f} | "
                  f"{t_fus:.1f} | {t_fus - t_ours:.1f} | {err:.1e} |", flush=True)  # fmt: skip
            del lc
        (triton_utils._pdl_on, shrink_mod.DECODE_BLOCK_K, expand_block.MMA_COLUMNS, dl.PREFETCH_B_AHEAD,
         precision.MIXED_HALVES_IN_FP32) = saved  # fmt: skip
    sums = {}
    for r in rows:
        s = sums.setdefault(r["cfg"], [0.0, 0.0])
        s[0] += r["cost_unfused"]
        s[1] += r["cost_fused"]
    print("\n| variant | what | LoRA cost per layer, unfused µs | fused µs |\n|---|---|---:|---:|")
    for cfg, (u, f) in sums.items():
        print(f"| {cfg} | {MATRIX[cfg][0]} | {u:.1f} | {f:.1f} |")
    return rows


def _replay_kernels(fn, path: str) -> list[tuple[str, float, float]]:
    """(kernel name, start µs, end µs) of one CUDA-graph replay of fn, from the profiler's trace."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return graph_kernels(g, path)


def graph_kernels(graph, path: str) -> list[tuple[str, float, float]]:
    """(kernel name, start µs, end µs) of one replay of a captured graph (after 3 warm ones), from the
    profiler's trace (written to ``path``)."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel")
    return [(name, t0, t1) for t0, t1, name in ks]


def trace(layers: int, out_dir: str) -> None:
    """Where the LoRA cost of each op goes, from kernel timestamps (profiler, CUDA graph of ``layers``
    ops): per op the base GEMM's period (end to end of consecutive GEMMs) and, fused, the shrink's span,
    the GEMM's start after the shrink's start, the GEMM's end after the shrink's end, and the period."""
    import os
    import statistics as st

    os.makedirs(out_dir, exist_ok=True)
    ops = TritonLoRAOps(DEV)
    med = st.median

    def base(case: Case, tiles):
        return lambda: [dl.decode_linear(case.x, w, tiles=tiles) for w in case.ws]

    def fused(lc: Case, tiles):
        rank_dev, R = ops.ranks_tensor(lc.ranks), lc.As[0][0].shape[2]
        return lambda: [dl.decode_linear(lc.x, w, lora=fused_epilogue(lc, ops, A, B, rank_dev, R), tiles=tiles)
                        for w, A, B in zip(lc.ws, lc.As, lc.Bs)]  # fmt: skip

    for name, K, slices in SHAPES["llama-8b"][:4]:
        case = Case(K, slices, 32, layers)
        tiles = dl.default_tiles(32, case.N, K, torch.bfloat16)
        ks = _replay_kernels(base(case, tiles), f"{out_dir}/{name}_base.json")
        ends = [t1 for _, _, t1 in ks]
        print(f"trace {name} base: {len(ks)} kernels, GEMM span {med([t1 - t0 for _, t0, t1 in ks]):.1f} µs, "
              f"period {med([b - a for a, b in zip(ends, ends[1:])]):.1f} µs", flush=True)  # fmt: skip
        del case
        for ldt in (torch.bfloat16, torch.float16, torch.float32):
            lc = Case(K, slices, 32, layers, lora_dtype=ldt)
            ks = _replay_kernels(fused(lc, tiles), f"{out_dir}/{name}_{str(ldt)[6:]}.json")
            del lc
            sh = [k for k in ks if "shrink" in k[0]]
            gm = [k for k in ks if "decode_linear" in k[0]]
            if len(sh) != len(gm):
                print(f"trace {name} {ldt}: {len(sh)} shrinks, {len(gm)} GEMMs: " + ", ".join(k[0][:30] for k in ks[:8]))
                continue
            print(f"trace {name} {str(ldt)[6:]}: shrink span {med([b - a for _, a, b in sh]):.1f} | GEMM span "
                  f"{med([b - a for _, a, b in gm]):.1f} | GEMM start - shrink start {med([g[1] - s[1] for s, g in zip(sh, gm)]):.1f} "
                  f"| GEMM end - shrink end {med([g[2] - s[2] for s, g in zip(sh, gm)]):.1f} | shrink start - previous GEMM end "
                  f"{med([s[1] - g[2] for s, g in zip(sh[1:], gm)]):.1f} | period {med([b[2] - a[2] for a, b in zip(gm, gm[1:])]):.1f} µs",
                  flush=True)  # fmt: skip
            if name == "qkv":
                t00 = ks[0][1]
                for kname, t0, t1 in ks[:9]:
                    print(f"    {kname[:40]:40s} {t0 - t00:8.1f} {t1 - t00:8.1f}")
        torch.cuda.empty_cache()


def _gated_row(lc: Case, ops: TritonLoRAOps, tiles, t_base: float, configs) -> str:
    """One --gated row: the default pair and silu_and_mul_lora per (block_n, num_warps) on one LoRA case."""
    from loraserve.layers.triton_elementwise import silu_and_mul
    from loraserve.lora.ops.triton.gated_lora import silu_and_mul_lora

    rank_dev, R, layers = ops.ranks_tensor(lc.ranks), lc.As[0][0].shape[2], len(lc.ws)
    trio = list(zip(lc.ws, lc.As, lc.Bs))

    def default(w, A, B):
        return silu_and_mul(dl.decode_linear(lc.x, w, lora=fused_epilogue(lc, ops, A, B, rank_dev, R), tiles=tiles))

    def gated(w, A, B, bn, nw):
        buf = lora_shrink(lc.x, A, lc.meta, rank_dev, R, zero_fill=True)
        y = dl.decode_linear(lc.x, w, tiles=tiles, after_shrink=True)
        return silu_and_mul_lora(y, buf, B, lc.mapping.token_slots, block_n=bn, num_warps=nw)

    t_def = graph_us(lambda: [default(*t) for t in trio], layers)
    ref = default(*trio[0]).float()
    cells = [f"default {t_def:.1f} µs, LoRA {t_def - t_base:.1f}"]
    for bn, nw in configs:
        try:
            t_new = graph_us(lambda bn=bn, nw=nw: [gated(*t, bn, nw) for t in trio], layers)
        except OutOfResources as e:
            cells.append(f"{bn}/{nw}: {type(e).__name__}")
            continue
        err = ((gated(*trio[0], bn, nw).float() - ref).norm() / ref.norm()).item()
        cells.append(f"{bn}/{nw}: {t_new:.1f} µs, LoRA {t_new - t_base:.1f}, err {err:.1e}")
    return " | ".join(cells)


def gated(layers: int, configs=((64, 4), (64, 8), (128, 8))) -> None:
    """gate_up + SiLU-and-mul per layer (32 tokens, 8 adapters mixed): the base pair, the GEMM with the delta in
    its epilogue then silu_and_mul (the default), and the shrink, the plain GEMM (after_shrink) then
    silu_and_mul_lora with the delta (``gated_lora``) per (block_n, num_warps); µs per layer and the LoRA
    cost (minus the base pair); rel err of the gated output against the default's."""
    from loraserve.layers.triton_elementwise import silu_and_mul

    ops = TritonLoRAOps(DEV)
    gate_ups = [(m, *next(s for s in SHAPES[m] if s[0] == "gate_up")[1:]) for m in ("llama-8b", "qwen-0.5b")]
    # between the two (where gated_lora.GATED_MAX_K is drawn): Llama-3.2-1B, Qwen2.5-1.5B, Llama-3.2-3B
    gate_ups += [("llama-1b", 2048, (8192, 8192)), ("qwen-1.5b", 1536, (8960, 8960)), ("llama-3b", 3072, (8192, 8192))]
    for model, K, slices in gate_ups:
        case = Case(K, slices, 32, layers)
        tiles = dl.default_tiles(32, case.N, K, torch.bfloat16)
        t_base = graph_us(lambda c=case, t=tiles: [silu_and_mul(dl.decode_linear(c.x, w, tiles=t)) for w in c.ws], layers)
        del case
        for ldt in (torch.bfloat16, torch.float16, torch.float32):
            lc = Case(K, slices, 32, layers, lora_dtype=ldt)
            cfgs = configs if model in ("llama-8b", "qwen-0.5b") else ((64, 8),)
            print(f"gated {model} {str(ldt)[6:]} ({slices[0]} x 2 by {K}): base {t_base:.1f} µs | "
                  + _gated_row(lc, ops, tiles, t_base, cfgs),
                  flush=True)  # fmt: skip
            del lc
        torch.cuda.empty_cache()


def _augmented_times(name: str, K: int, slices: tuple[int, ...], layers: int, S: int, R: int) -> tuple[float, ...]:
    """(base, K + S*R, K + n*S*R, the in_k GEMM, today's LoRA without its shrink) µs per op of one shape
    (``augmented``; the in_k GEMM for two slices only: decode_linear's in_k, ``delta_in_k``'s layout)."""
    from loraserve.layers.triton_elementwise import silu_and_mul
    from loraserve.lora.ops.triton import gated_lora
    from loraserve.lora.ops.triton.gated_lora import silu_and_mul_lora

    act = silu_and_mul if name == "gate_up" else (lambda y: y)
    case = Case(K, slices, 32, layers, lora_dtype=torch.float16, S=S, R=R)
    N = case.N

    def plain(k_extra: int, in_k: bool = False) -> float:
        # in_k: W k_extra more columns, x one set a slice, each slice's rows reading its own (decode_linear's in_k)
        x = torch.zeros(32, K + k_extra * (len(slices) if in_k else 1), device=DEV, dtype=torch.bfloat16)
        x[:, :K] = case.x
        ws = [torch.zeros(N, K + k_extra, device=DEV, dtype=torch.bfloat16) for _ in case.ws]
        tiles = dl.default_tiles(32, N, K + k_extra, torch.bfloat16, slices if in_k else None)
        k_args = (K, slices[0], k_extra) if in_k else None
        return graph_us(lambda: [act(dl.decode_linear(x, w, tiles=tiles, in_k=k_args)) for w in ws], layers)

    ops = TritonLoRAOps(DEV)
    rank_dev = ops.ranks_tensor(case.ranks)
    bufs = [lora_shrink(case.x, A, case.meta, rank_dev, R, zero_fill=True) for A in case.As]
    tiles = dl.default_tiles(32, N, K, torch.bfloat16, slices)
    slots = case.mapping.token_slots
    gated = name == "gate_up" and gated_lora.prefer(N // 2, K)

    def today():
        for w, B, buf in zip(case.ws, case.Bs, bufs):
            if gated:
                silu_and_mul_lora(dl.decode_linear(case.x, w, tiles=tiles), buf, B, slots)
            else:
                act(dl.decode_linear(case.x, w, lora=dl.ExpandEpilogue(buf, B, slots), tiles=tiles))

    per_slice = plain(S * R, in_k=True) if len(slices) == 2 and K % 128 == 0 else float("nan")
    return plain(0), plain(S * R), plain(len(slices) * S * R), per_slice, graph_us(today, layers)


def augmented(layers: int, S: int = 8, R: int = 16) -> None:
    """The LoRA delta as more K of the base GEMM, timed before it is built: x (32, K) with each token's shrink s
    written into its slot's R columns past K, W with every slot's B (times the scaling) in those columns, so one
    plain GEMM gives base + delta (bf16 s and B, PEFT's own roundings of a bf16 model). Per op of each shape,
    µs per op (gate_up: with its SiLU-and-mul): the base GEMM; the GEMM over K + S*R (one set of columns, which a
    K loop that picks each slice's set needs) and over K + n*S*R (n slices' sets: a plain GEMM); and today's
    LoRA path without its shrink (computed outside the graph, as the norms and GEMMs compute it beside
    something else): the epilogue, or for gate_up where ``gated_lora.prefer`` the plain GEMM and silu_and_mul_lora.
    And for two slices the GEMM that ``delta_in_k`` runs (W S*R more columns, each slice's rows reading its set of
    x's: ``decode_linear(in_k=...)``)."""
    print("| model | op | K | base µs | K + S*R µs | K + n*S*R µs | in_k GEMM µs | today's LoRA without its shrink µs | "
          "LoRA cost: K + S*R / K + n*S*R / in_k / today |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for model in ("qwen-0.5b", "llama-8b"):
        for name, K, slices in SHAPES[model][:4]:
            t_base, t_one, t_all, t_in_k, t_now = _augmented_times(name, K, slices, layers, S, R)
            print(f"| {model} | {name} | {K} | {t_base:.1f} | {t_one:.1f} | {t_all:.1f} | {t_in_k:.1f} | {t_now:.1f} | "
                  f"{t_one - t_base:.1f} / {t_all - t_base:.1f} / {t_in_k - t_base:.1f} / {t_now - t_base:.1f} |",
                  flush=True)  # fmt: skip
            torch.cuda.empty_cache()


def check(case: Case, ops: TritonLoRAOps, tiles) -> float:
    """Relative error of the fused layer vs the unfused one (bf16: a rounding apart)."""
    rank_dev = ops.ranks_tensor(case.ranks)
    w, A, B = case.ws[0], case.As[0], case.Bs[0]
    R = A[0].shape[2]
    ref = F.linear(case.x, w)
    ops.add_lora_linear(ref, case.x, A, B, case.ranks, case.meta)
    y = dl.decode_linear(case.x, w, lora=fused_epilogue(case, ops, A, B, rank_dev, R), tiles=tiles)
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def lora_tune(layers: int, ops_names=("gate_up", "down"), lora_dtype=torch.float32) -> None:
    """The fused LoRA op (the engine's default path) per tile config, Llama-8B shapes, 32 tokens, 8
    adapters: whether the LoRA'd layers want other tiles than the base ones (fewer stages, more programs
    resident, fewer waves after which the epilogue's latency shows)."""
    ops = TritonLoRAOps(DEV)
    configs = [
        dl.DecodeTiles(bn, 128, 8 if bn == 128 else 4, st, sk)
        for bn, st, sk in itertools.product((32, 64, 128), (3, 4, 5), (1, 2))
    ]
    for name, K, slices in SHAPES["llama-8b"]:
        if name not in ops_names:
            continue
        lc = Case(K, slices, 32, layers, lora_dtype=lora_dtype)
        default = dl.default_tiles(32, lc.N, K, torch.bfloat16)
        rows = []
        for t in configs:
            if any(n % t.block_n for n in slices):
                continue
            try:
                rows.append((bench_lora(lc, ops, t)[1], t))
            except OutOfResources as e:  # a config that does not fit the SM's shared memory: print, go on
                print(f"  lora-tune {name} {t}: {type(e).__name__}", flush=True)
        rows.sort(key=lambda r: r[0])
        t_def = next((u for u, t in rows if t == default), float("nan"))
        print(f"lora-tune {name} {str(lora_dtype)[6:]}: default {default} {t_def:.1f} µs | best " +
              "; ".join(f"{u:.1f} {tuple(t.__dict__.values())}" for u, t in rows[:5]), flush=True)  # fmt: skip
        del lc
        torch.cuda.empty_cache()


def tune(shapes, M: int, layers: int, bw: float) -> dict:
    configs = [
        dl.DecodeTiles(bn, 128, 8 if bn == 128 else 4, st, sk)
        for bn, st, sk in itertools.product((32, 64, 128), (4, 5), (1, 2, 3, 4))
    ]
    best = {}
    for model, name, K, slices in shapes:
        case = Case(K, slices, M, layers)
        t_cublas = graph_us(lambda c=case: [F.linear(c.x, w) for w in c.ws], layers)
        rows = []
        for t in configs:
            if any(n % t.block_n for n in slices) or K % t.block_k or (t.split_k > 1 and sum(slices) > 16384):
                continue
            try:
                us = graph_us(lambda c=case, t=t: [dl.decode_linear(c.x, w, tiles=t) for w in c.ws], layers)
            except OutOfResources as e:  # a config that does not fit the SM's shared memory: print, go on
                print(f"  {model} {name} {t}: {type(e).__name__}")
                continue
            rows.append((us, t))
        rows.sort(key=lambda r: r[0])
        us, t = rows[0]
        pct = 100 * case.w_bytes / (us * 1e-6) / bw
        print(
            f"tune M={M} {model} {name}: cuBLAS {t_cublas:.1f} µs | best {us:.1f} µs ({pct:.0f}% BW) "
            f"{t} | next: " + "; ".join(f"{u:.1f} {tuple(x.__dict__.values())}" for u, x in rows[1:5]),
            flush=True,
        )  # fmt: skip
        best[f"{sum(slices)},{K}"] = dict(cublas_us=t_cublas, best_us=us, tiles=t.__dict__, top=[(u, x.__dict__) for u, x in rows[:6]])
        del case
        torch.cuda.empty_cache()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tokens", default="1,16,32,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--models", default="llama-8b,qwen-0.5b")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiles-out", default=None, help="write the sweep's best tiles per (N, K) (for bench_e2e --decode-tiles)")
    ap.add_argument("--tables", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--matrix", action="store_true", help="only the LoRA cost per op under each knob of MATRIX")
    ap.add_argument("--rows", default=None, help="--matrix: only these rows of MATRIX (names separated by ';')")
    ap.add_argument("--lora-tune", action="store_true", help="only the fused LoRA op's time per tile config")
    ap.add_argument("--lora-tune-ops", default="gate_up,down", help="--lora-tune: these ops")
    ap.add_argument("--lora-tune-dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="--lora-tune: the LoRA weights' dtype")
    ap.add_argument("--augmented", action="store_true", help="only the LoRA delta as more K of the base GEMM, against today's")
    ap.add_argument("--gated", action="store_true", help="only gate_up + SiLU-and-mul: the delta in the GEMM or in the activation")
    ap.add_argument("--trace", default=None, help="only the kernel timestamps of each op (profiler traces into this folder)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if args.lora_tune:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.lora_tune_dtype]
        lora_tune(args.layers, tuple(args.lora_tune_ops.split(",")), dtype)
        return
    if args.trace:
        trace(args.layers, args.trace)
        return
    if args.gated:
        gated(args.layers)
        return
    if args.augmented:
        augmented(args.layers)
        return
    if args.matrix:
        print("| knob | op | cuBLAS µs | unfused µs | LoRA cost | decode_linear µs | fused µs | LoRA cost | fused rel err |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        result = {"copy_bw": bw, "matrix": matrix(args.layers, args.rows.split(";") if args.rows else None)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    shapes = [(m, *s) for m in args.models.split(",") for s in SHAPES[m]]
    result = {"copy_bw": bw}
    if args.tune:  # the Llama-8B shapes only: the small model's are launch-bound whatever the tiles
        result["tune"] = tune([s for s in shapes if s[0] == "llama-8b"], 32, args.layers, bw)
        table = {k: dl.DecodeTiles(**v["tiles"]) for k, v in result["tune"].items()}
        if args.tiles_out:
            with open(args.tiles_out, "w") as f:
                json.dump({k: v["tiles"] for k, v in result["tune"].items()}, f)
        default = dl.default_tiles  # the tables below run the tuned tiles where the sweep has them
        dl.default_tiles = lambda M, N, K, dtype, slices=None: table.get(f"{N},{K}") or default(M, N, K, dtype, slices)
    if not args.tables:
        return
    ops = TritonLoRAOps(DEV)
    rows = []
    print("| model | op | M | cuBLAS µs | ours µs | ours/cuBLAS | % BW ours | LoRA | unfused µs | fused µs | LoRA cost unfused / fused µs | fused rel err |")
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for (model, name, K, slices), M in itertools.product(shapes, [int(t) for t in args.tokens.split(",")]):
        case = Case(K, slices, M, args.layers)
        tiles = dl.default_tiles(M, case.N, K, torch.bfloat16)
        t_cublas, t_ours = bench_base(case, tiles)
        del case
        lora_cols = []
        if name != "lm_head":
            for ldt in (torch.float32, torch.bfloat16):
                lc = Case(K, slices, M, args.layers, lora_dtype=ldt)
                t_unf, t_fus = bench_lora(lc, ops, tiles)
                err = check(lc, ops, tiles)
                lora_cols.append((str(ldt).replace("torch.", ""), t_unf, t_fus, err))
                del lc
        torch.cuda.empty_cache()
        pct = 100 * sum(slices) * K * 2 / (t_ours * 1e-6) / bw
        base = f"| {model} | {name} | {M} | {t_cublas:.1f} | {t_ours:.1f} | {t_ours / t_cublas:.2f}x | {pct:.0f}% |"
        if not lora_cols:
            print(base + " - | - | - | - | - |", flush=True)
        for ldt, t_unf, t_fus, err in lora_cols:
            print(
                base + f" {ldt} | {t_unf:.1f} | {t_fus:.1f} | {t_unf - t_cublas:.1f} / {t_fus - t_ours:.1f} | {err:.1e} |",
                flush=True,
            )
        rows.append(dict(model=model, op=name, M=M, cublas_us=t_cublas, ours_us=t_ours, lora=lora_cols))
    result["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
