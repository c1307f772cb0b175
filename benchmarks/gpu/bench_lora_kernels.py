"""LoRA and attention kernels on the GPU: ours (Triton) vs the torch reference, µs and % of copy bandwidth.

For each shape, every token has an adapter, rank 16, x bf16, output bf16 (the layer's output, rounded
once, as the engine runs it). Decode sizes (<= 256 tokens): one token per sequence, adapters
round-robin. Prefill (4096 tokens): 32 sequences of 128 tokens, adapters round-robin by sequence. Times are medians of triton.testing.do_bench
(L2 flushed between runs):

- ``call``: wall time per eager ``add_lora_linear`` call, 300 calls back to back (ranks lookup,
  buffer allocation, shrink + expand launches): what a layer pays per forward without CUDA graphs,
  CPU launch cost included (inputs stay in L2 here);
- ``graph``: the same call replayed from a CUDA graph, timed by do_bench (GPU time, L2 flushed);
- ``torch``: the reference path (``torch_ops``, one matmul pair per adapter and slice), wall time
  per call like ``call``.

Bytes = x + each active adapter's A and B (at its rank) + y read and written; the shrink's fp32
partials are counted too. Bandwidth % is against a device-to-device copy measured in the same run.
NOTE: do_bench's L2 flush writes zeros, so a kernel timed here first writes back the L2's dirty lines
(~50 MB), which a kernel run back to back in a decode step does not.

    python benchmarks/gpu/bench_lora_kernels.py
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from triton.testing import do_bench

from loraserve.forward_context import AttentionMetadata
from loraserve.layers.attention import reference_paged_attention
from loraserve.layers.triton_attention import paged_attention
from loraserve.lora.ops import torch_ops
from loraserve.lora.ops.precision import compute_dtype
from loraserve.lora.ops.triton_ops import TritonLoRAOps
from loraserve.lora.punica import LoRAMapping

DEV = torch.device("cuda")
# name, T tokens, adapters, K, slice outs
LORA_CASES = [
    ("qkv", 16, 8, 4096, (4096, 1024, 1024)),
    ("qkv", 64, 8, 4096, (4096, 1024, 1024)),
    ("qkv", 256, 32, 4096, (4096, 1024, 1024)),
    ("qkv", 4096, 8, 4096, (4096, 1024, 1024)),
    ("o", 16, 8, 4096, (4096,)),
    ("gate_up", 16, 8, 4096, (14336, 14336)),
    ("gate_up", 256, 32, 4096, (14336, 14336)),
    ("gate_up", 4096, 8, 4096, (14336, 14336)),
    ("down", 16, 8, 14336, (4096,)),
    ("down", 256, 32, 14336, (4096,)),
    ("o", 4096, 8, 4096, (4096,)),
    ("down", 4096, 8, 14336, (4096,)),
]
VLLM_US = {("qkv", 16, 8): 41.5, ("qkv", 256, 32): 126.0}  # vLLM's Triton LoRA ops (bf16), from the issue


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def wall_us(fn, n: int = 300) -> float:
    """Wall-clock µs per call of n back-to-back calls (CPU launch cost included), after a warm-up."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_of(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def bench_lora(name, T, S, K, outs, wdtype, rank=16):
    g = torch.Generator(device=DEV).manual_seed(T * 131 + S)
    # decode: one token per sequence, adapters round-robin; prefill: sequences of 128 tokens, one adapter each
    slots = [t % S for t in range(T)] if T <= 256 else [(t // 128) % S for t in range(T)]
    ranks = [rank] * S
    mapping = LoRAMapping.build(slots, [], DEV)
    As = tuple(torch.randn(S, 1, rank, K, device=DEV, generator=g).mul_(0.02).to(wdtype) for _ in outs)
    Bs = tuple(torch.randn(S, 1, n, rank, device=DEV, generator=g).mul_(0.02).to(wdtype) for n in outs)
    x = torch.randn(T, K, device=DEV, generator=g).to(torch.bfloat16)
    y = torch.randn(T, sum(outs), device=DEV, generator=g).to(torch.bfloat16)
    ops = TritonLoRAOps(DEV)

    def ours():
        ops.add_lora_linear(y, x, As, Bs, ranks, mapping.token_meta)

    def reference():
        acc = y.float()
        off = 0
        for a, b in zip(As, Bs):
            buf = torch.zeros(T, rank, dtype=compute_dtype(x.dtype, wdtype), device=DEV)
            torch_ops.lora_shrink(x, a, mapping.token_segments, ranks, buf)
            torch_ops.lora_expand(acc, buf, b, mapping.token_segments, ranks, off, act_dtype=x.dtype)
            off += b.shape[2]
        return acc.to(y.dtype)

    t_call = wall_us(ours)
    gr = graph_of(ours)
    t_graph = do_bench(gr.replay, warmup=25, rep=200, return_mode="median") * 1e3
    t_ref = wall_us(reference, n=30)
    w = torch.finfo(wdtype).bits // 8
    n_slices, n_active = len(outs), len(set(slots))
    split = 1  # the partials plane count is small; count one read and one write of (T, slices, R) fp32
    nbytes = (
        T * K * 2
        + n_active * n_slices * rank * K * w
        + n_active * sum(outs) * rank * w
        + 2 * T * sum(outs) * 2
        + 2 * split * n_slices * T * rank * 4
    )
    return dict(
        op=name, T=T, adapters=S, dtype=str(wdtype).replace("torch.", ""), call_us=t_call, graph_us=t_graph,
        torch_us=t_ref, bytes=nbytes, vllm_us=VLLM_US.get((name, T, S)) if wdtype == torch.bfloat16 else None,
    )  # fmt: skip


LAYER_CASES = [  # Llama-8B's four LoRA'd linear ops at decode (32 tokens, 8 adapters round-robin)
    ("qkv", 32, 8, 4096, (4096, 1024, 1024)),
    ("o", 32, 8, 4096, (4096,)),
    ("gate_up", 32, 8, 4096, (14336, 14336)),
    ("down", 32, 8, 14336, (4096,)),
]


def bench_layer(name, T, S, K, outs, wdtype, rank=16):
    """GPU µs (graph replay) of a whole LoRA linear layer: the base GEMM alone vs base + LoRA (the
    punica wrapper's shrink + expand adding the delta into the GEMM's output)."""
    from loraserve.forward_context import forward_context
    from loraserve.lora.punica import PunicaWrapper

    g = torch.Generator(device=DEV).manual_seed(7)
    slots = [t % S for t in range(T)]
    mapping = LoRAMapping.build(slots, slots, DEV)
    As = tuple(torch.randn(S, 1, rank, K, device=DEV, generator=g).mul_(0.02).to(wdtype) for _ in outs)
    Bs = tuple(torch.randn(S, 1, n, rank, device=DEV, generator=g).mul_(0.02).to(wdtype) for n in outs)
    W = torch.randn(sum(outs), K, device=DEV, generator=g).mul_(0.02).to(torch.bfloat16)
    x = torch.randn(T, K, device=DEV, generator=g).to(torch.bfloat16)
    pw = PunicaWrapper(S, DEV)
    ranks = [rank] * S
    base = lambda x: torch.nn.functional.linear(x, W)  # noqa: E731

    def in_place():
        with forward_context(lora=mapping):
            return pw.apply_lora_linear(base(x), x, As, Bs, outs, ranks)

    times = {}
    for key, fn in (("base", lambda: base(x)), ("in_place", in_place)):
        gr = graph_of(fn)
        times[key] = do_bench(gr.replay, warmup=25, rep=200, return_mode="median") * 1e3
    return dict(op=name, T=T, adapters=S, dtype=str(wdtype).replace("torch.", ""), **times)


def check_lora_once():
    """A quick guard that the timed kernels compute the right thing (the full tests live in tests/gpu)."""
    T, S, K, outs, rank = 64, 8, 4096, (4096, 1024, 1024), 16
    g = torch.Generator(device=DEV).manual_seed(0)
    slots = [(t * 7) % (S + 1) - 1 for t in range(T)]
    mapping = LoRAMapping.build(slots, [], DEV)
    As = tuple(torch.randn(S, 1, rank, K, device=DEV, generator=g).mul_(0.02) for _ in outs)
    Bs = tuple(torch.randn(S, 1, n, rank, device=DEV, generator=g).mul_(0.02) for n in outs)
    x = torch.randn(T, K, device=DEV, generator=g).to(torch.bfloat16)
    y0 = torch.randn(T, sum(outs), device=DEV, generator=g)
    y = y0.clone()
    TritonLoRAOps(DEV).add_lora_linear(y, x, As, Bs, [rank] * S, mapping.token_meta)
    ref = y0.clone()
    off = 0
    for a, b in zip(As, Bs):
        buf = torch.zeros(T, rank, device=DEV)
        torch_ops.lora_shrink(x, a, mapping.token_segments, [rank] * S, buf)
        torch_ops.lora_expand(ref, buf, b, mapping.token_segments, [rank] * S, off, act_dtype=x.dtype)
        off += b.shape[2]
    err = ((y - ref).norm() / (ref - y0).norm()).item()
    assert err < 2e-3, err  # bf16 activations, fp32 weights: tf32 products, fp32 accumulation
    return err


def attn_metadata(q_lens, ctx_lens, block_size=16):
    tables, starts, slot_mapping, kv_slots, pos, nxt = [], [], [], [], 0, 0
    for n, c in zip(q_lens, ctx_lens):
        nb = -(-c // block_size)
        table = list(range(nxt, nxt + nb))[::-1]  # scattered order inside the sequence
        nxt += nb
        tables.append(table)
        slots = [table[p // block_size] * block_size + p % block_size for p in range(c)]
        kv_slots.append(torch.tensor(slots, device=DEV))
        slot_mapping += slots[c - n :]
        starts.append(pos)
        pos += n
    width = max(len(t) for t in tables)
    packed = torch.tensor(
        [[s, n, c] + t + [0] * (width - len(t)) for s, n, c, t in zip(starts, q_lens, ctx_lens, tables)],
        dtype=torch.int32,
        device=DEV,
    )
    md = AttentionMetadata(
        torch.tensor(slot_mapping, device=DEV), starts, list(q_lens), list(ctx_lens), kv_slots,
        block_tables=packed[:, 3:], seq_info=packed[:, :3], block_size=block_size,
    )  # fmt: skip
    return md, nxt * block_size


def bench_attention(name, q_lens, ctx_lens, heads=32, kv_heads=8, head_dim=128):
    md, num_slots = attn_metadata(q_lens, ctx_lens)
    T = sum(q_lens)
    q = torch.randn(T, heads, head_dim, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(num_slots, kv_heads, head_dim, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    scale = head_dim**-0.5
    out = paged_attention(q, k, v, md, scale, None)
    ref = reference_paged_attention(q, k, v, md, scale, None)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    t_ours = do_bench(
        lambda: paged_attention(q, k, v, md, scale, None), warmup=25, rep=200, return_mode="median"
    )
    t_ref = wall_us(lambda: reference_paged_attention(q, k, v, md, scale, None), n=10) * 1e-3
    kv_bytes = sum(ctx_lens) * kv_heads * head_dim * 2 * 2
    return dict(
        op=name,
        T=T,
        seqs=len(q_lens),
        ours_us=t_ours * 1e3,
        torch_us=t_ref * 1e3,
        bytes=kv_bytes + 2 * T * heads * head_dim * 2,
        rel_err=err,
    )


PREFILL_CASES = [c for c in LORA_CASES if c[1] > 256]  # the 4096-token (prefill) shapes


def prefill_inputs(wdtype, T, S, K, outs, rank):
    """A prefill batch (sequences of 128 tokens, adapters round-robin by sequence) and rank-``rank``
    weights: (meta, As, Bs, x, y, ranks on the device)."""
    g = torch.Generator(device=DEV).manual_seed(5)
    meta = LoRAMapping.build([(t // 128) % S for t in range(T)], [], DEV).token_meta
    As = tuple(torch.randn(S, 1, rank, K, device=DEV, generator=g).mul_(0.02).to(wdtype) for _ in outs)
    Bs = tuple(torch.randn(S, 1, n, rank, device=DEV, generator=g).mul_(0.02).to(wdtype) for n in outs)
    x = torch.randn(T, K, device=DEV, generator=g).to(torch.bfloat16)
    y = torch.randn(T, sum(outs), device=DEV, generator=g).to(torch.bfloat16)
    return meta, As, Bs, x, y, torch.full((S,), rank, dtype=torch.int32, device=DEV)


def tune_prefill(bw: float, tune_kinds: tuple[str, ...] = ("shrink", "expand"), grid: str = "default",
                 dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)) -> dict:
    """Sweeps the shrink's and the expand's prefill tiles (``lora_shrink.PREFILL``,
    ``lora_expand.PREFILL``) at 4096 tokens, each kernel timed alone (graph replay, L2 flushed), checked
    against the default tiles' result; prints the fastest per case and the tiles with the least time
    summed over the cases. Leaves those in place (so a table that follows measures them) and returns
    them."""
    import dataclasses
    import itertools

    from loraserve.lora.ops.triton import lora_expand as expand_mod
    from loraserve.lora.ops.triton import lora_shrink as shrink_mod

    default_s, default_e = shrink_mod.PREFILL, expand_mod.PREFILL
    # (session 9's first sweep: one slice a program, 64 x 64 tiles, 512 programs, 4 warps, 3 stages was
    # the fastest of 32, the defaults before; its second, block_m (64, 128) x block_k (64, 128, 256) x
    # programs (256, 512) x warps (4, 8) at 3 stages, chose every slice in a program, 4 stages, 256 programs.
    # Session 13's: more programs (K split up to 16 ways) and 3-5 stages around that choice)
    shrink_grid = [
        shrink_mod.PrefillTiles(
            block_m=bm, block_k=bk, programs=p, num_warps=w, num_stages=st, fuse_slices=True
        )
        for (bm, w), bk, p, st in itertools.product(((64, 4), (128, 8)), (64, 128), (256, 512, 1024), (3, 4, 5))
        if bm * bk * st <= 64 * 128 * 4  # the shared memory of x's stages (128 x 128 x 5 overflows)
    ]
    expand_grid = [
        expand_mod.PrefillTiles(block_m=bm, block_n=bn, num_warps=w)
        for bm, bn, w in itertools.product((32, 64, 128), (128, 256), (4, 8))
    ]
    if grid == "wide-k":  # session 14: longer K steps (256 or 512 contiguous bytes of each row of x a step)
        shrink_grid = [
            shrink_mod.PrefillTiles(block_m=bm, block_k=bk, programs=p, num_warps=w, num_stages=st, fuse_slices=True)
            for (bm, w), bk, p, st in itertools.product(((32, 4), (64, 4), (64, 8)), (128, 256), (256, 512), (2, 3, 4))
            if bm * bk * st <= 64 * 128 * 4 and bk * bm >= 64 * 128 // 2
        ]
    shrink_grid = [default_s] + [t for t in shrink_grid if t != default_s]  # the baseline is always timed
    expand_grid = [default_e] + [t for t in expand_grid if t != default_e]

    def tune_case(wdtype, name, T, S, K, outs):
        """The sweep of one case: per kernel, the candidates' (µs, tiles, rel err), fastest first."""
        rank = 16
        meta, As, Bs, x, y, ranks = prefill_inputs(wdtype, T, S, K, outs, rank)
        w = torch.finfo(wdtype).bits // 8
        s_bytes = T * K * 2 + S * len(outs) * rank * K * w + len(outs) * T * rank * 4
        e_bytes = 2 * T * sum(outs) * 2 + S * sum(outs) * rank * w + len(outs) * T * rank * 4
        shrink_mod.PREFILL, expand_mod.PREFILL = default_s, default_e
        ref_buf = shrink_mod.lora_shrink(x, As, meta, ranks, rank).clone()
        ref_y = y.clone()
        expand_mod.lora_expand(ref_y, ref_buf, Bs, meta, ranks, act_dtype=torch.bfloat16)  # bf16 x, as the engine

        def shrink_run():
            return shrink_mod.lora_shrink(x, As, meta, ranks, rank)

        def shrink_err():
            return ((shrink_run() - ref_buf).norm() / ref_buf.norm()).item()

        yy = y.clone()

        def expand_run():
            expand_mod.lora_expand(yy, ref_buf, Bs, meta, ranks, act_dtype=torch.bfloat16)

        def expand_err():
            yy.copy_(y)
            expand_run()
            return ((yy.float() - ref_y.float()).norm() / (ref_y.float() - y.float()).norm()).item()

        def measured(fn, check):
            """(µs, rel err vs the default tiles, None) or (None, None, why): a candidate that does not
            compile or launch (shared memory, registers) is skipped."""
            try:
                err = check()
                gr = graph_of(fn)
            except Exception as e:
                return None, None, str(e).splitlines()[0][:100]
            return do_bench(gr.replay, warmup=10, rep=60, return_mode="median") * 1e3, err, None

        best = {}
        kinds = (("shrink", shrink_grid, s_bytes), ("expand", expand_grid, e_bytes))
        for kind, grid, nbytes in [k for k in kinds if k[0] in tune_kinds]:
            rows = []
            for tiles in grid:
                if kind == "shrink":
                    shrink_mod.PREFILL = tiles
                    us, err, why = measured(shrink_run, shrink_err)
                    shrink_mod.PREFILL = default_s
                else:
                    expand_mod.PREFILL = tiles
                    us, err, why = measured(expand_run, expand_err)
                    expand_mod.PREFILL = default_e
                if us is None:
                    print(f"  {kind} {name} {wdtype} {tiles}: skipped ({why})")
                    continue
                if not err < 1e-2:  # a broken candidate is reported and never chosen
                    print(f"  {kind} {name} {wdtype} {tiles}: differs from the default tiles, {err:.1e}")
                    continue
                rows.append((us, tiles, err))
            rows.sort(key=lambda r: r[0])
            dflt = next(r[0] for r in rows if r[1] == (default_s if kind == "shrink" else default_e))
            for us, tiles, err in rows[:5]:
                print(f"| {name} | {T} | {str(wdtype)[6:]} | {kind} | {dataclasses.astuple(tiles)} | {us:.1f} | "
                      f"{100 * nbytes / (us * 1e-6) / bw:.0f}% | default {dflt:.1f} µs "
                      f"({100 * nbytes / (dflt * 1e-6) / bw:.0f}%) | rel err {err:.0e} |")  # fmt: skip
            best[kind] = rows
        return best

    picks = {}
    for wdtype in dtypes:
        for name, T, S, K, outs in PREFILL_CASES:
            picks[(name, str(wdtype))] = tune_case(wdtype, name, T, S, K, outs)
    # one pick per kernel for every case: the tiles with the least summed time over the cases
    chosen = {"shrink": default_s, "expand": default_e}
    for kind, default in [k for k in (("shrink", default_s), ("expand", default_e)) if k[0] in tune_kinds]:
        totals: dict = {}
        for best in picks.values():
            for us, tiles, _ in best[kind]:
                totals.setdefault(tiles, []).append(us)
        n = len(picks)
        full = {t: sum(v) for t, v in totals.items() if len(v) == n}
        chosen[kind] = min(full, key=full.get)
        print(f"{kind}: chosen {dataclasses.asdict(chosen[kind])}: summed {full[chosen[kind]]:.1f} µs vs default "
              f"{full[default]:.1f} µs over {n} cases")  # fmt: skip
    shrink_mod.PREFILL, expand_mod.PREFILL = chosen["shrink"], chosen["expand"]
    return {k: dataclasses.asdict(v) for k, v in chosen.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument(
        "--layers-only", action="store_true", help="only the table of Llama-8B's LoRA'd ops at decode"
    )
    ap.add_argument(
        "--tune-prefill", action="store_true",
        help="sweep the shrink's and expand's tiles at 4096 tokens, keep the fastest, then time the table with them",
    )  # fmt: skip
    ap.add_argument("--prefill-only", action="store_true", help="only the 4096-token rows of the table")
    ap.add_argument("--tune-kinds", default="shrink,expand", help="which kernels --tune-prefill sweeps")
    ap.add_argument("--tune-grid", default="default", choices=("default", "wide-k"), help="the shrink's candidates")
    ap.add_argument("--tune-dtypes", default="bfloat16,float32", help="LoRA weight dtypes --tune-prefill sweeps")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}")
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read + write)")
    tuned = None
    if args.tune_prefill:
        print(
            "| op | tokens | LoRA dtype | kernel | tiles | µs | % copy BW | default tiles | rel err vs default |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        tuned = tune_prefill(bw, tuple(args.tune_kinds.split(",")), args.tune_grid,
                             tuple(getattr(torch, d) for d in args.tune_dtypes.split(",")))
    print(
        f"correctness guard (qkv, 64 tokens, bf16 x, fp32 weights): rel err of the delta {check_lora_once():.1e}"
    )
    rows, att = [], []
    if not args.layers_only:
        for wdtype in (torch.bfloat16, torch.float16, torch.float32):  # fp16: auto's GPU storage, tf32 products
            for case in PREFILL_CASES if args.prefill_only else LORA_CASES:
                rows.append(bench_lora(*case, wdtype))
        att = [
            bench_attention("decode ctx 256", [1] * 32, [256] * 32),
            bench_attention("decode ctx 1024", [1] * 32, [1024] * 32),
            bench_attention("prefill 128", [128] * 32, [128] * 32),
        ]
    layers = (
        []
        if args.prefill_only
        else [bench_layer(*case, wd) for wd in (torch.float32, torch.float16, torch.bfloat16) for case in LAYER_CASES]
    )
    print()
    print(
        "| op | tokens | adapters | LoRA dtype | ours eager call µs | ours GPU (graph) µs | torch ref call µs | vs torch | vLLM µs / ours (call, graph) | MB moved | % copy BW (graph) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vl = (
            f"{r['vllm_us']} µs: {r['vllm_us'] / r['call_us']:.2f}x, {r['vllm_us'] / r['graph_us']:.2f}x"
            if r["vllm_us"]
            else "-"
        )
        pct = 100 * r["bytes"] / (r["graph_us"] * 1e-6) / bw
        print(
            f"| {r['op']} | {r['T']} | {r['adapters']} | {r['dtype']} | {r['call_us']:.1f} | {r['graph_us']:.1f} | "
            f"{r['torch_us']:.0f} | {r['torch_us'] / r['call_us']:.1f}x | {vl} | {r['bytes'] / 1e6:.1f} | {pct:.0f}% |"
        )
    print()
    print(
        "| attention (Llama-8B heads 32/8, d 128, bf16) | tokens | seqs | ours µs | torch ref µs | speedup | % copy BW | rel err |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in att:
        pct = 100 * r["bytes"] / (r["ours_us"] * 1e-6) / bw
        print(
            f"| {r['op']} | {r['T']} | {r['seqs']} | {r['ours_us']:.1f} | {r['torch_us']:.0f} | "
            f"{r['torch_us'] / r['ours_us']:.1f}x | {pct:.0f}% | {r['rel_err']:.1e} |"
        )
    print()
    print(
        "| layer (Llama-8B, decode) | tokens | adapters | LoRA dtype | base GEMM µs | + LoRA µs | LoRA µs | with / without |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in layers:
        print(f"| {r['op']} | {r['T']} | {r['adapters']} | {r['dtype']} | {r['base']:.1f} | {r['in_place']:.1f} | "
              f"{r['in_place'] - r['base']:.1f} | {r['in_place'] / r['base']:.2f}x |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"copy_bw": bw, "tuned": tuned, "lora": rows, "attention": att, "layers": layers}, f, indent=1
            )


if __name__ == "__main__":
    main()
