"""Small helpers shared by the Triton LoRA kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from loraserve.config import triton_interpreted
from loraserve.lora.ops import precision

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(dtype: torch.dtype):
    if dtype not in _TL:
        raise TypeError(f"LoRA kernels take float32, bfloat16 or float16 tensors, got {dtype}")
    return _TL[dtype]


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``config.triton_interpreted``): no inline PTX, no PDL."""
    return triton_interpreted()


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and later): a LoRA kernel launches while the kernel before
    it finishes and waits (``gdc_wait``) before touching its outputs, hiding the launch gap that
    dominates decode-size LoRA ops. Off under the interpreter and before Hopper (sm_90)."""
    if device.type != "cuda" or interpreted():
        return False
    return _pdl_on(device.index if device.index is not None else torch.cuda.current_device())


def pdl_chain(device: torch.device) -> bool:
    """Whether a decode step's small kernels (the norms, SiLU-and-mul, rotary + KV write, attention, the
    decode GEMM) are links of one PDL chain: each is launched as a PDL dependent of the kernel before
    it, lets its own dependent launch as soon as all its programs have started, and waits for the
    kernel before it to finish before touching any memory (``pdl_link``). A LoRA shrink that follows
    one of them then launches while it runs, loads its A, and waits; the launch gaps between the links
    are hidden. Correct whatever comes before or after a link: a predecessor that never triggers
    (cuBLAS, torch) only makes the launch ordinary. The rule every PDL dependent keeps: before its
    wait it reads only what was written before the forward (weights, the mapping) or what its
    predecessor's own wait already covered (the GEMM after a shrink, with the epilogue or
    ``after_shrink``, reads x before its wait: the shrink waited for x before letting it launch; the
    gated SiLU-and-mul loads its B before its wait), and it writes only buffers no earlier kernel still
    uses (the split-K partials and counters of its own persistent buffers). A kernel whose successor
    reads what its predecessor wrote waits before it ends (``decode_linear``'s after_shrink: the gated
    kernel after it reads the shrink's buf). A decode GEMM with ``trigger_after_wait`` waits for its
    predecessor before letting its dependent launch, so that the dependent may read, before its own wait, what
    the kernel two launches back wrote (the norm's shrink: the rotary launch's qkv delta).

    Measured on the H200 (Llama-8B, 8 adapters): the 8-adapter step 5.56 ms with the chain against 5.98
    without it; the base step 4.79 against 4.89."""
    return use_pdl(device)


@triton.jit
def pdl_link(WAIT: tl.constexpr):
    """A PDL chain link's first instructions (``pdl_chain``): let the dependent launch, then (WAIT) wait
    for the kernel before this one to finish and flush its memory."""
    tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()


@triton.jit
def slice_ptr(sl, a0_ptr, a1_ptr, a2_ptr):
    """The base pointer of slice ``sl`` (0-2) of a layer's 1-3 LoRA stacks, passed as three pointers."""
    if sl == 0:
        a_ptr = a0_ptr
    elif sl == 1:
        a_ptr = a1_ptr
    else:
        a_ptr = a2_ptr
    return a_ptr


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (one per element) without waiting or using registers
    (GPU only: inline PTX, which the Triton interpreter cannot run)."""
    tl.inline_asm_elementwise(
        "mov.b32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@functools.cache
def _pdl_on(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def compute_dtype_of(act_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The dtype a LoRA product runs in (``precision.compute_dtype``, the torch reference's rule): the
    activations cast to the weights' dtype, fp32 for fp32 weights or mixed half precisions.

    NOTE: fp32 products with fp32 activations are true fp32 (IEEE: no tf32), as the reference's fp32
    matmul. With bf16/fp16 activations they are tf32 on the tensor cores (exact for the activations,
    10-bit mantissa for the weights, which is what fp16 storage holds; ~5e-4 relative on the delta, far
    under the bf16 rounding of the layer output it is added to), always accumulated in fp32: the
    true-fp32 path measured 2.4x slower at decode sizes on the H200. One exception: the prefill shrink
    with bf16 x and fp16 weights casts x to fp16 for fp16 MMAs, the same exact products
    (``lora_shrink.x_dot``).
    """
    tl_dtype(act_dtype)
    tl_dtype(w_dtype)
    return precision.compute_dtype(act_dtype, w_dtype)


@triton.jit
def dot_in(a, b, CDT: tl.constexpr, IEEE: tl.constexpr):
    """a @ b, both cast to CDT, accumulated in fp32. IEEE: true fp32 products (fp32 inputs, as the
    reference's fp32 matmul); else fp32 inputs multiply in tf32 (``compute_dtype_of`` says when)."""
    if IEEE:
        out = tl.dot(a.to(CDT), b.to(CDT), input_precision="ieee")
    else:
        out = tl.dot(a.to(CDT), b.to(CDT))
    return out


@triton.jit
def sum_planes(ptrs, mask, n_planes, plane_stride, RED: tl.constexpr, PAST_L1: tl.constexpr):
    """The sum over p < n_planes of the (masked) tiles at ptrs + p * plane_stride, in fp32, in plane order.

    The split-K planes of the LoRA shrink, summed by whoever reads them (the shrink's last split, the
    expand, decode_linear's epilogue). RED loads are issued together: one L2 round trip for up to RED
    planes, where one load per plane in a runtime loop paid one each (the shrink splits K 16-56 ways at
    decode sizes); unrolling all planes made the compiler stage them in shared memory (704 KB,
    OutOfResources). Plane order whatever the tile shape gives the same bits (a tl.sum's order follows
    the layout). PAST_L1 (.cg): the planes were written by other SMs during this launch, and L1 is not
    coherent across SMs. Every caller passes RED = min(next_power_of_2(n_planes), 16), so RED == 1 means
    exactly one plane: one load, no runtime loop (the engine's shrink sums its own splits; the loop's
    branches cost decode_linear's epilogue instructions that nothing hides, as Nsight Compute showed).
    """
    if RED == 1:
        tl.device_assert(n_planes == 1, "sum_planes: RED == 1 reads one plane; pass RED = min(next_pow2(n_planes), 16)")
        if PAST_L1:
            return tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    total = tl.zeros(ptrs.shape, dtype=tl.float32)
    for p0 in range(0, n_planes, RED):
        for j in tl.static_range(RED):
            m = mask & (p0 + j < n_planes)
            if PAST_L1:
                total += tl.load(ptrs + (p0 + j) * plane_stride, mask=m, other=0.0, cache_modifier=".cg")
            else:
                total += tl.load(ptrs + (p0 + j) * plane_stride, mask=m, other=0.0)
    return total


_PERSISTENT: dict[tuple[str, torch.device, torch.dtype], list[torch.Tensor]] = {}


def persistent_buffer(device: torch.device, owner: str, n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A buffer of >= n elements (zeros when allocated) kept for the life of the process, one per owner.

    For split-K kernels: ``owner`` names a kernel and a use ("lora_shrink/arrivals",
    "decode_linear/partials"). Arrival counters must be zero between launches: the kernels put each
    one back to zero after its last arrival, so one buffer serves every launch of its owner on a
    stream. Kernels that can overlap under PDL (the shrink and the GEMM that is its dependent) never
    share an owner.

    NOTE: an outgrown buffer is kept, never freed: a CUDA graph captured with it keeps using it at
    every replay. The first call for a size runs before capture (the graphs' warm-up forward).
    """
    pool = _PERSISTENT.setdefault((owner, device, dtype), [])
    if not pool or pool[-1].numel() < n:
        have = pool[-1].numel() if pool else 0
        pool.append(torch.zeros(max(n, 2 * have, 1024), dtype=dtype, device=device))
    return pool[-1]
