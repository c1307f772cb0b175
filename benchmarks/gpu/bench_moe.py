"""One MoE layer on the GPU: the Triton grouped path vs the per-expert loop (the torch path), base and LoRA.

Shapes (bf16, random weights): Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert intermediate 768)
and Mixtral-8x7B (8 experts, top-2, hidden 4096, intermediate 14336). Tokens: 1, 32 (decode of 32
sequences), 512 and 4096 (prefill). LoRA: 8 slots of rank 16 (fp32 weights, as PEFT upcasts them: --lora-dtype float32) on
gate, up and down of every expert, tokens round-robin over the 8 slots.

- ``loop``: ``FusedMoE.experts_forward`` (sort by expert, one matmul pair per expert with tokens, plus
  one matmul pair per (expert, slot) for LoRA): wall time per call, host syncs included;
- ``triton call``: the Triton path, wall time per call (launches included);
- ``triton graph``: the Triton path replayed from a CUDA graph (GPU time; the loop cannot be captured);
- bytes: the weights of the experts the batch touches (+ their LoRA A/B) once, plus activations;
  % of the copy bandwidth measured in the same run;
- rel err: max |triton - loop| / max |loop| on the layer output.

    python benchmarks/gpu/bench_moe.py --json /tmp/moe.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench

from loraserve.config import LoRAConfig
from loraserve.forward_context import forward_context
from loraserve.layers.moe import FusedMoE, RoutingConfig
from loraserve.lora.layers.fused_moe import FusedMoEWithLoRA
from loraserve.lora.punica import LoRAMapping, PunicaWrapper

DEV = torch.device("cuda")
SHAPES = {  # name: (experts, top_k, hidden, intermediate, renormalize)
    "qwen3-30b-a3b": (128, 8, 2048, 768, True),
    "mixtral-8x7b": (8, 2, 4096, 14336, True),
}
TOKENS = (1, 32, 512, 4096)
SLOTS, RANK = 8, 16


def copy_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.int16, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def wall_us(fn, n: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return 1e3 * do_bench(g.replay, warmup=10, rep=100, return_mode="median")


def build(shape: str):
    E, k, H, inter, renorm = SHAPES[shape]
    base = FusedMoE(E, H, inter, RoutingConfig(k, renormalize=renorm), reduce_results=False,
                    params_dtype=torch.bfloat16).to(DEV)  # fmt: skip
    with torch.no_grad():
        base.gate_up_proj.normal_(0, 0.02)
        base.down_proj.normal_(0, 0.02)
    layer = FusedMoEWithLoRA(base)
    layer.create_lora_weights(SLOTS, LoRAConfig(max_loras=SLOTS, max_lora_rank=RANK, lora_dtype="float32"))
    layer.set_mapping(PunicaWrapper(SLOTS, DEV))
    g = torch.Generator().manual_seed(0)
    for s in range(SLOTS):
        a = [torch.randn(E, RANK, fin, generator=g) * 0.02 for fin, _ in layer.full_shapes]
        b = [torch.randn(E, fout, RANK, generator=g) * 0.02 for _, fout in layer.full_shapes]
        layer.set_lora(s, a, b)
    return layer


def touched_bytes(layer, ids: torch.Tensor, T: int, lora: bool) -> int:
    base = layer.base_layer
    E, H, inter = base.num_experts, base.hidden_size, base.intermediate_per_partition
    experts = torch.unique(ids).numel()
    n = 2 * (3 * inter * H) * experts + 2 * 2 * T * H  # bf16 weights once, x in, out
    n += 2 * ids.numel() * (3 * inter + H)  # per-assignment h (2I), a (I), y (H), bf16
    if lora:
        pairs = torch.unique(layer._bench_slots.repeat_interleave(ids.shape[1]) * E + ids.reshape(-1)).numel()
        n += 4 * RANK * (H + 2 * inter + inter + H + 2 * inter) * pairs  # fp32 A and B of 3 slices
    return n


def run_case(layer, T: int, bw: float) -> list[dict]:
    base = layer.base_layer
    E, H = base.num_experts, base.hidden_size
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(T, H, generator=g)).to(DEV, torch.bfloat16)
    logits = torch.randn(T, E, generator=g).to(DEV, torch.bfloat16)
    slots = [t % SLOTS for t in range(T)]
    mapping = LoRAMapping.build(slots, slots, DEV)
    layer._bench_slots = mapping.token_slots
    _, ids = base.select_experts(logits)
    rows = []
    for lora in (False, True):
        mod = layer if lora else base

        def call(mod=mod):
            with forward_context(lora=mapping):
                return mod(x, logits)

        base.backend = "torch"
        want = call()
        loop = wall_us(call, n=20 if T <= 32 else 5)
        base.backend = "triton"
        got = call()
        tri = wall_us(call)
        gr = graph_us(call)
        err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        nbytes = touched_bytes(layer, ids, T, lora)
        rows.append(dict(tokens=T, lora=lora, loop_us=loop, triton_call_us=tri, triton_graph_us=gr,
                         speedup_call=loop / tri, speedup_graph=loop / gr, mb=nbytes / 1e6,
                         bw_pct=100 * nbytes / (gr * 1e-6) / bw, rel_err=err))  # fmt: skip
    return rows


TUNE_TILES = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (bm, bn, bk, w, st)
    for bm in (64, 128)
    for bn in (64, 128, 256)
    for bk in (64, 128)
    for w in (4, 8)
    for st in (3, 4)
    if not (bn == 256 and bk == 128) and not (bm == 128 and bn == 256 and st == 4)
]


def tune(shape: str, tokens: int) -> list[dict]:
    """GPU µs of the two grouped GEMMs (w13, w2) per tile config vs a cuBLAS matmul per expert on the
    same rows (index lists built before timing, so the loop has no host sync): the sweep behind
    ``triton_moe.default_tiles``."""
    from loraserve.layers.moe_align import align_by_group
    from loraserve.layers.triton_moe import GemmTiles, moe_gemm

    E, k, H, inter, _ = SHAPES[shape]
    g = torch.Generator(device=DEV).manual_seed(tokens)
    ids = torch.randn(tokens, E, device=DEV, generator=g).topk(k, dim=-1).indices
    flat = ids.reshape(-1)
    rows = []
    for name, N, K, token_div in (("w13", 2 * inter, H, k), ("w2", H, inter, 1)):
        w = (torch.randn(E, N, K, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(tokens if token_div == k else tokens * k, K, device=DEV, generator=g).to(torch.bfloat16)
        per_expert = [(flat == e).nonzero().squeeze(1) // token_div for e in range(E)]
        out = torch.empty(flat.numel(), N, device=DEV, dtype=torch.bfloat16)

        def loop(per_expert=per_expert, out=out, x=x, w=w):
            for e, idx in enumerate(per_expert):
                if idx.numel():
                    out[idx] = x[idx] @ w[e].T

        ref_us = 1e3 * do_bench(loop, warmup=5, rep=50, return_mode="median")
        flops = 2 * flat.numel() * N * K
        best = None
        for bm, bn, bk, nw, st in TUNE_TILES:
            blocks = align_by_group(flat, E, bm)
            tiles = GemmTiles(bn, bk, nw, st)
            try:
                us = 1e3 * do_bench(lambda x=x, w=w, b=blocks, d=token_div, t=tiles: moe_gemm(x, w, b, d, t), warmup=5, rep=50,
                                    return_mode="median")  # fmt: skip
            except Exception as e:  # noqa: BLE001 - out of shared memory for this tile: skip it
                print(f"  {shape} T={tokens} {name} {(bm, bn, bk, nw, st)}: {type(e).__name__}", flush=True)
                continue
            r = dict(shape=shape, tokens=tokens, gemm=name, tiles=(bm, bn, bk, nw, st), us=us, cublas_loop_us=ref_us,
                     tflops=flops / us / 1e6)  # fmt: skip
            rows.append(r)
            if best is None or us < best["us"]:
                best = r
        print(f"| {shape} | {tokens} | {name} | {best['tiles']} | {best['us']:.0f} | {ref_us:.0f} | "
              f"{ref_us / best['us']:.2f}x | {best['tflops']:.0f} |", flush=True)  # fmt: skip
        for bm in (64, 128):
            top = sorted((r for r in rows if r["gemm"] == name and r["tiles"][0] == bm), key=lambda r: r["us"])[:3]
            print("   block_m", bm, "top3:", [(r["tiles"], round(r["us"])) for r in top], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tune", action="store_true", help="sweep the grouped GEMM's tiles at prefill sizes")
    args = ap.parse_args()
    if args.tune:
        print("| shape | tokens | gemm | best (block_m, n, k, warps, stages) | µs | cuBLAS per expert µs | ratio | TFLOP/s |")
        print("|---|---:|---|---|---:|---:|---:|---:|")
        cases = [("mixtral-8x7b", 512), ("mixtral-8x7b", 4096), ("qwen3-30b-a3b", 4096)]
        rows = [r for s, T in cases if s in args.shapes.split(",") for r in tune(s, T)]
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}; torch {torch.__version__}")
    out = {"copy_tb_s": bw / 1e12, "rows": {}}
    print("| shape | tokens | LoRA | loop µs | triton call µs | triton graph µs | loop / call | loop / graph "
          "| MB | % copy BW (graph) | rel err |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        layer = build(shape)
        out["rows"][shape] = []
        for T in TOKENS:
            for r in run_case(layer, T, bw):
                out["rows"][shape].append(r)
                print(f"| {shape} | {r['tokens']} | {'8 x r16' if r['lora'] else '-'} | {r['loop_us']:.0f} | "
                      f"{r['triton_call_us']:.0f} | {r['triton_graph_us']:.0f} | {r['speedup_call']:.1f}x | "
                      f"{r['speedup_graph']:.1f}x | {r['mb']:.0f} | {r['bw_pct']:.0f}% | {r['rel_err']:.1e} |",
                      flush=True)  # fmt: skip
        del layer
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
