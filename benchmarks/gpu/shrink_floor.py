"""How far the prefill LoRA shrink is from what reading x allows: the shrink of qkv at 4096 tokens (x 33.5 MB
bf16, rank 16, three slices) against floors measured in the same run.

Rows (graph replay, median µs, and x's bytes over the time as % of copy bandwidth):
- x read once: ``x.sum(dim=1)`` in torch (a reduction that streams x);
- cuBLAS on one dense skinny GEMM, x @ A (4096 x 48): what a shrink with a single adapter would cost;
- cuBLAS on x @ [A of 8 adapters] (4096 x 384): all adapters for every token, 8x the products;
- our shrink with the 4096 tokens in one segment (one adapter), in 32 segments of 128 tokens (8 adapters,
  the benchmark's prefill), and in 512 segments of 8 (many short prompts);
for bf16 and fp16 A (fp16: auto's storage, tf32 products). Read what the gaps say about the kernel: the
difference between one segment and 32 is the per-segment cost, between cuBLAS and one segment the kernel.

    python benchmarks/gpu/shrink_floor.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from loraserve.lora.ops.triton.lora_shrink import lora_shrink
from loraserve.lora.punica import LoRAMapping

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import copy_bandwidth, graph_us  # noqa: E402  (a sibling script, not a package)

DEV = torch.device("cuda")
T, K, R, SLICES, S = 4096, 4096, 16, 3, 8


def main() -> None:
    bw = copy_bandwidth()
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, K, device=DEV, generator=g).bfloat16()
    x_bytes = x.numel() * 2
    rows = []

    def row(name, fn):
        us = graph_us(fn)
        rows.append((name, us))
        print(f"| {name} | {us:.1f} | {100 * x_bytes / (us * 1e-6) / bw:.0f}% |", flush=True)

    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; x {x_bytes / 1e6:.1f} MB")
    print("| what | µs | x's bytes, % of copy BW |\n|---|---:|---:|")
    out = torch.empty(T, device=DEV, dtype=torch.float32)
    row("x read once (torch sum over K)", lambda: torch.sum(x, dim=1, dtype=torch.float32, out=out))
    a1 = torch.randn(K, R * SLICES, device=DEV, generator=g).bfloat16() * 0.02
    a8 = torch.randn(K, R * SLICES * S, device=DEV, generator=g).bfloat16() * 0.02
    y1 = torch.empty(T, R * SLICES, device=DEV, dtype=torch.bfloat16)
    y8 = torch.empty(T, R * SLICES * S, device=DEV, dtype=torch.bfloat16)
    row("cuBLAS x @ A, one adapter (N = 48)", lambda: torch.mm(x, a1, out=y1))
    row("cuBLAS x @ A of 8 adapters (N = 384)", lambda: torch.mm(x, a8, out=y8))
    for wdt in (torch.bfloat16, torch.float16):
        As = tuple((torch.randn(S, 1, R, K, device=DEV, generator=g) * 0.02).to(wdt) for _ in range(SLICES))
        ranks = torch.full((S,), R, dtype=torch.int32, device=DEV)
        for seg_len, label in ((T, "one segment"), (128, "32 segments of 128"), (8, "512 segments of 8")):
            slots = [0] * T if seg_len == T else [(t // seg_len) % S for t in range(T)]
            meta = LoRAMapping.build(slots, [], DEV).token_meta
            row(f"our shrink, {str(wdt)[6:]} A, {label}", lambda As=As, meta=meta, ranks=ranks: lora_shrink(x, As, meta, ranks, R))


if __name__ == "__main__":
    main()
