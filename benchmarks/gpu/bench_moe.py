"""One MoE layer on the GPU: the Triton grouped path vs the per-expert loop (the torch path), base and LoRA.

Shapes (bf16, random weights): Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert intermediate 768)
and Mixtral-8x7B (8 experts, top-2, hidden 4096, intermediate 14336). Tokens: 1, 32 (decode of 32
sequences), 512 and 4096 (prefill). LoRA: 8 slots of rank 16 (fp32 weights, as PEFT upcasts them) on
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
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
