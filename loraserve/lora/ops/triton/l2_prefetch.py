"""LoRA weights pulled into L2 by a latency-bound launch, ahead of the launches that read them (opt-in,
``LORASERVE_LORA_L2_PREFETCH=1``: measured slower).

The idea: on a small model's decode step the MLP's GEMMs stream their W near the memory's bandwidth, and the
LoRA weights read beside them (gate/up's B in the gated SiLU-and-mul, down's A in its GEMM's shrink blocks)
might queue behind that stream; session 29's critical path (``step_trace.py``, H100, Qwen2.5-0.5B, 8
adapters) puts 3.4-4.5 µs a layer on gate/up's delta wherever it is computed. The decode attention before
them reads little (the KV of 32 tokens): its programs ask L2 for its layer's o, gate/up and down LoRA
weights (``prefetch.global.L2``: no registers held, nothing waited on), before their PDL wait.

Measured (session 29, H100, 8 adapters, step_trace; BENCHMARKS.md): slower. Qwen2.5-0.5B's step 1.141 ->
1.200-1.207 ms: the attention's advance of the layer's critical path grows 7.3 -> 12.0 µs, and what it
saves after it is small (the gated SiLU-and-mul 4.6 -> 4.2 µs, the o and down GEMMs 0.3-0.6 each): gate/up's
delta is not waiting on DRAM. Llama-8B's 6.546 -> 6.692 ms. Kept opt-in, with its GPU test, to build on.

Which bytes: the slots of this step's tokens only, each slot's lines once. The table (``region_table``)
lists regions, each a stack of per-slot weights: (base address, bytes between slots, bytes of a slot).
A program of the attention owns one (sequence, KV head); its token's slot is shared by ``c`` tokens, of
which it is the ``k``-th: it takes part ``k * Hk + kvh`` of ``c * Hk`` of every region's lines of that slot.

Prefetches change no value: the launch's outputs are the same bits with or without them (its GPU test).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from loraserve.lora.ops.triton.utils import interpreted, prefetch_l2

# The decode attention prefetches its layer's o, gate/up and down LoRA weights: opt-in, LORASERVE_LORA_L2_PREFETCH=1
# (measured slower, see above); a module attribute
ENABLED = os.environ.get("LORASERVE_LORA_L2_PREFETCH", "0") == "1"
LINE = tl.constexpr(128)  # bytes a prefetch asks for
CHUNK = tl.constexpr(256)  # lines a program asks for at once (two per thread on 4 warps)

_TABLES: dict[tuple, torch.Tensor] = {}


def region_table(stacks: list[torch.Tensor]) -> torch.Tensor | None:
    """The (n, 3) int64 table on the stacks' device: per stack (S, ...) of per-slot weights, contiguous
    within a slot, (its address, bytes between slots, bytes of a slot). Cached by the stacks' addresses
    (the LoRA stacks are allocated once): built outside CUDA graph capture (the warm-up forward), None if
    asked first during one, or when there is nothing to prefetch (off, no stacks, the interpreter)."""
    if not ENABLED or not stacks or interpreted():
        return None
    key = tuple((t.data_ptr(), t.stride(0), t[0].numel(), t.element_size()) for t in stacks)
    table = _TABLES.get(key)
    if table is None:
        if stacks[0].is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        for t in stacks:
            assert t[0].is_contiguous(), f"a LoRA stack {tuple(t.shape)} must be contiguous within a slot"
        rows = [[t.data_ptr(), t.stride(0) * t.element_size(), t[0].numel() * t.element_size()] for t in stacks]
        table = _TABLES[key] = torch.tensor(rows, dtype=torch.int64).to(stacks[0].device)
    return table


@triton.jit
def prefetch_token_slot(table_ptr, n_regions, slots_ptr, tok, n_tokens, part_of_token, parts_of_token,
                        BLOCK_T: tl.constexpr):  # fmt: skip
    """Ask L2 for this program's share of the lines of token ``tok``'s slot in every region of the table
    (``region_table``): the token's slot is shared by c tokens, ``tok`` the k-th of them; each token's
    share is split in ``parts_of_token`` parts, this program's is ``part_of_token``. Base tokens ask nothing."""
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if slot >= 0:
        offs_t = tl.arange(0, BLOCK_T)
        others = tl.load(slots_ptr + offs_t, mask=offs_t < n_tokens, other=-1).to(tl.int64)
        same = others == slot
        c = tl.sum(same.to(tl.int32), axis=0)
        k = tl.sum((same & (offs_t < tok)).to(tl.int32), axis=0)
        part = (k * parts_of_token + part_of_token).to(tl.int64)
        parts = (c * parts_of_token).to(tl.int64)
        for i in range(n_regions):
            base = tl.load(table_ptr + 3 * i)
            between = tl.load(table_ptr + 3 * i + 1)
            lines = (tl.load(table_ptr + 3 * i + 2) + LINE - 1) // LINE
            lo = part * lines // parts
            hi = (part + 1) * lines // parts
            for l0 in range(lo, hi, CHUNK):
                line = tl.minimum(l0 + tl.arange(0, CHUNK), hi - 1)  # the last line again past the end: no mask
                prefetch_l2((base + slot * between + line * LINE).to(tl.pointer_type(tl.uint8)))
