"""Registers, spills and shared memory of ``decode_linear`` compiled for the H200 (sm_90), without a GPU.

Triton compiles the kernel for a given target and its bundled ptxas assembles it; ``cuobjdump`` (also
bundled) reads the registers per thread and the stack (spills) from the cubin. From them, how many
programs fit on one SM (65536 registers, 228 KB of shared memory, 1 KB reserved per program): what
decides how many waves a GEMM of many column blocks (gate_up: 448) runs in. Runs wherever Triton is
installed (the CPU machine too); nothing here is timed.

    python benchmarks/gpu/kernel_resources.py
    python benchmarks/gpu/kernel_resources.py --norm-shrink   # lora/ops/triton/norm_shrink.py's kernel
    python benchmarks/gpu/kernel_resources.py --norm-delta    # the norms with a pending LoRA delta (row_delta.py)
    python benchmarks/gpu/kernel_resources.py --gemm-shrink   # decode_linear with the shrink's column blocks (shrink_into)
    python benchmarks/gpu/kernel_resources.py --early         # the deltas computed before a PDL wait (rotary)
    python benchmarks/gpu/kernel_resources.py --beside        # whether a gated SiLU-and-mul program fits beside gate/up's
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from loraserve.layers import triton_decode_linear as dl
from loraserve.lora.ops.triton import decode_linear_kernel as dlk

TARGET = GPUTarget("cuda", 90, 32)
SM_REGS, SM_SMEM, RESERVED = 65536, 228 * 1024, 1024
OPS = [("qkv", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate_up", 4096, (14336, 14336)), ("down", 14336, (4096,))]


# NOTE: the integer arguments that are multiples of 16 at these shapes: a launch specializes them (sizes
# are not do_not_specialize), and the compiler then vectorizes the loads they address. Compiled without
# these hints (session 8's table) the kernel is not the one that runs.
SIXTEENS = {"N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_ym", "N0", "N1", "stride_bsp", "stride_bi",
            "stride_bm", "stride_ws0", "stride_ws1", "stride_ws2", "x_k_base", "x_shift_row", "x_shift"}  # fmt: skip


def compile_op(K: int, slices: tuple[int, ...], lora_dtype: str | None, columns: int, maxnreg: int = 0, pf_ahead: int = 0,
               shrink: bool = False, w_pf_lines: int = 0):
    """The kernel as decode_linear launches it for 32 tokens with the default tiles (bf16 x and W;
    8 slots of rank 16 when lora_dtype is "fp32", "bf16" or "fp16" (tf32 products); ``maxnreg``: a register cap, the launch
    option, which session 9 timed and dropped; ``pf_ahead``: the B pull's K steps, main() passes the
    default of the dtype, dl.prefetch_ahead; ``shrink``: the extra column blocks of ``shrink_into``, A's rows in bf16 as W;
    ``w_pf_lines``: W's 128-byte lines along K pulled into L2 before the wait, ``w_prefetch_lines``)."""
    N = sum(slices)
    tiles = dl.default_tiles(32, N, K, None)
    lora = lora_dtype is not None
    b = {"bf16": "*bf16", "fp16": "*fp16"}.get(lora_dtype, "*fp32")
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32",
            "cnt_ptr": "*i32", "buf_ptr": "*fp32", "b0_ptr": b, "b1_ptr": b, "b2_ptr": b, "slots_ptr": "*i32",
            "a_ptr": "*bf16", "s_ptr": "*fp32"}  # fmt: skip
    cdt = tl.bfloat16 if lora_dtype == "bf16" else tl.float32  # fp16 B with bf16 x: tf32 (precision.py)
    consts = dict(
        R=16, HAS_BIAS=False, HAS_LORA=lora, HAS_SHRINK=shrink, NUM_SLICES=len(slices) if lora else 1, BLOCK_M=32,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, BLOCK_R=16, SLOTS_PER_CHUNK=max(1, min(8, columns // 16)),
        RED=1, SPLIT_W=tiles.split_k, EVEN_K=K % tiles.block_k == 0, EVEN_N=N % tiles.block_n == 0,
        CDT=tl.bfloat16, IEEE=False, LORA_CDT=cdt, LORA_IEEE=False, USE_PDL=lora, PDL_CHAIN=True,
        WAIT_FIRST=not lora, TRIGGER_AFTER_WAIT=False, PF_AHEAD=pf_ahead if lora else 0, PF_SLOTS=8,
        PF_LINES=max(1, tiles.block_n * 16 * (2 if lora_dtype in ("bf16", "fp16") else 4) // 128),
        W_PF_LINES=w_pf_lines, W_PER_LINE=64, X_SHIFT=False,
    )  # fmt: skip
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    return compile_as_launched(dlk.decode_linear_kernel, ptrs, consts, SIXTEENS, options), tiles


def compile_as_launched(fn, ptrs: dict, consts: dict, sixteens: set, options: dict, floats: frozenset = frozenset({"eps"})):
    """``fn`` compiled for TARGET: pointer arguments typed by ``ptrs`` (16-byte aligned, as a launch
    specializes tensors), constexprs from ``consts``, the other arguments i32 (fp32 for those in ``floats``), those
    in ``sixteens`` marked multiples of 16 (as a launch specializes such sizes)."""
    sig, const, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in ptrs:
            sig[name] = ptrs[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif fn.params[i].is_constexpr:
            sig[name], const[name] = "constexpr", consts[name]
        else:
            sig[name] = "fp32" if name in floats else "i32"
            if name in sixteens:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, const, attrs), target=TARGET, options=options)


def registers_and_stack(kernel) -> tuple[int, int]:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    fields = dict(tok.split(":") for line in out.stdout.splitlines() if "REG:" in line for tok in line.split() if ":" in tok)
    return int(fields["REG"]), int(fields["STACK"])


def norm_shrink_resources() -> None:
    """``norm_shrink``'s kernel as launched for bf16 x (the fused add + norm) at a few hidden sizes."""
    from loraserve.layers import triton_elementwise as tew
    from loraserve.lora.ops.triton import norm_shrink as ns

    fn = ns._norm_shrink_kernel
    print("| K | A | fold | warps | ranks a program | registers | spill bytes |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for K, adt, fold in ((896, "*fp16", False), (896, "*fp16", True), (1536, "*fp16", False), (2048, "*bf16", False),
                         (2048, "*bf16", True), (4096, "*fp16", False), (4096, "*fp16", True)):  # fmt: skip
        block = triton.next_power_of_2(K)
        ptrs = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", r_out_ptr="*bf16", a0_ptr=adt,
                    a1_ptr=adt, a2_ptr=adt, buf_ptr="*fp32", slots_ptr="*i64", rank_ptr="*i32", d_buf_ptr="*fp32",
                    d_b_ptr="*fp16", d_slots_ptr="*i32")  # fmt: skip
        consts = dict(HAS_RESIDUAL=True, NUM_RBLOCKS=1, BLOCK=block, BLOCK_R=ns.BLOCK_R, PDL_CHAIN=True,
                      HAS_DELTA=False, D_BLOCK_R=16, D_RED=1, D_CDT=tl.float32, IN_K=False, S_POW2=8, FOLD=fold)
        # K and its multiples (stride_ar is K) are multiples of 16 at these shapes
        sixteens = {"N", "stride_x", "stride_r", "stride_o", "stride_ro", "stride_as", "stride_ar", "stride_bi", "stride_bm"}
        warps = tew.norm_warps(block)
        k = compile_as_launched(fn, ptrs, consts, sixteens, dict(num_warps=warps))
        regs, stack = registers_and_stack(k)
        print(f"| {K} | {adt[1:]} | {'yes' if fold else 'no'} | {warps} | {ns.BLOCK_R} | {regs} | {stack} |", flush=True)


def norm_delta_resources() -> None:
    """The add + norm kernels (``fused_add_rms_norm``, ``norm_shrink``) with and without a pending LoRA delta
    (``row_delta``: a token's B tile of 16 ranks by the row, fp16 B, bf16 x) at the warps they launch with,
    and at twice as many."""
    from loraserve.layers import triton_elementwise as tew
    from loraserve.lora.ops.triton import norm_shrink as ns

    delta_ptrs = dict(d_buf_ptr="*fp32", d_b_ptr="*fp16", d_slots_ptr="*i32")
    rows = ("x_ptr", "r_ptr", "w_ptr", "out_ptr", "r_out_ptr")
    print("| kernel | K | delta | warps | registers | spill bytes |")
    print("|---|---:|---|---:|---:|---:|")
    for K in (576, 896, 2048):
        block = triton.next_power_of_2(K)
        for has_delta in (False, True):
            d_consts = dict(HAS_DELTA=has_delta, D_BLOCK_R=16, D_RED=1, D_CDT=tl.float32)
            kernels = [
                ("fused_add_rms_norm", tew._fused_add_rms_norm_kernel, dict.fromkeys(rows, "*bf16"),
                 dict(BLOCK=block, PDL_CHAIN=True)),
                ("norm_shrink (qkv)", ns._norm_shrink_kernel,
                 {**dict.fromkeys(rows, "*bf16"), **dict.fromkeys(("a0_ptr", "a1_ptr", "a2_ptr"), "*fp16"),
                  "buf_ptr": "*fp32", "slots_ptr": "*i64", "rank_ptr": "*i32"},
                 dict(HAS_RESIDUAL=True, NUM_RBLOCKS=1, BLOCK=block, BLOCK_R=ns.BLOCK_R, PDL_CHAIN=True,
                      IN_K=False, S_POW2=8, FOLD=False)),
            ]  # fmt: skip
            name, fn, ptrs, consts = kernels[-1]
            kernels.append(("norm_shrink (qkv, fold)", fn, ptrs, {**consts, "FOLD": True}))
            for name, fn, ptrs, consts in kernels:
                for warps in (tew.norm_warps(block), 2 * tew.norm_warps(block)):
                    k = compile_as_launched(fn, {**ptrs, **delta_ptrs}, {**consts, **d_consts}, set(), dict(num_warps=warps))
                    regs, stack = registers_and_stack(k)
                    print(f"| {name} | {K} | {'yes' if has_delta else 'no'} | {warps} | {regs} | {stack} |", flush=True)


def gemm_shrink_resources() -> None:
    """``decode_linear`` for Qwen2.5-0.5B's o and down (32 tokens, bf16), plain and with the shrink's extra column
    blocks (``shrink_into``: A's rows in bf16, the same K loop as W's)."""
    print("| op | shrink columns | registers | spill bytes | shared KB |")
    print("|---|---|---:|---:|---:|")
    for name, K, N in (("o", 896, 896), ("down", 4864, 896)):
        for shrink in (False, True):
            k, _ = compile_op(K, (N,), None, 0, shrink=shrink)
            regs, stack = registers_and_stack(k)
            print(f"| {name} | {'yes' if shrink else 'no'} | {regs} | {stack} | {k.metadata.shared / 1024:.0f} |", flush=True)


def compile_gated(block_n: int, num_warps: int, maxnreg: int = 0):
    """The gated SiLU-and-mul (``gated_lora``) as launched for Qwen2.5-0.5B's gate_up: 32 tokens, bf16 y, fp16 B (tf32
    products), 8 slots of rank 16, a link of the PDL chain; ``maxnreg``: a register cap (0: none)."""
    from loraserve.lora.ops.triton import gated_lora

    ptrs = dict(y_ptr="*bf16", out_ptr="*bf16", buf_ptr="*fp32", bg_ptr="*fp16", bu_ptr="*fp16", slots_ptr="*i32")
    consts = dict(R=16, BLOCK_M=32, BLOCK_N=block_n, BLOCK_R=16, SLOTS_PER_CHUNK=8, RED=1, LORA_CDT=tl.float32,
                  LORA_IEEE=False, PDL_CHAIN=True)  # fmt: skip
    sixteens = {"D", "stride_ym", "stride_om", "stride_bsp", "stride_bi", "stride_bm", "stride_wsg", "stride_wsu"}
    options = dict(num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}))
    return compile_as_launched(gated_lora._silu_and_mul_lora_kernel, ptrs, consts, sixteens, options)


def early_resources() -> None:
    """The launches that compute a LoRA delta before their PDL wait, against the same launches without it (Qwen2.5-0.5B,
    32 tokens, bf16 x, fp16 B, 8 slots of rank 16): qkv's GEMM letting its dependent launch after its wait
    (``trigger_after_wait``), the rotary + KV-cache launch with qkv's delta (``rotary_kv_cache(delta=...)``; head_dim
    64, and 80 with a rest of 16 dims)."""
    from loraserve.layers import triton_elementwise as tew

    print("| kernel | variant | warps | registers | spill bytes |")
    print("|---|---|---:|---:|---:|")
    k, tiles = compile_op(896, (896, 128, 128), None, 0)
    print(f"| decode_linear qkv | plain | {tiles.num_warps} | {' | '.join(map(str, registers_and_stack(k)))} |", flush=True)
    fn = dlk.decode_linear_kernel
    ptrs = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
            "buf_ptr": "*fp32", "b0_ptr": "*fp32", "b1_ptr": "*fp32", "b2_ptr": "*fp32", "slots_ptr": "*i32",
            "a_ptr": "*bf16", "s_ptr": "*fp32"}  # fmt: skip
    base = dict(R=16, HAS_BIAS=True, HAS_LORA=False, HAS_SHRINK=False, NUM_SLICES=1, BLOCK_M=32, BLOCK_N=tiles.block_n,
                BLOCK_K=tiles.block_k, BLOCK_R=16, SLOTS_PER_CHUNK=1, RED=1, SPLIT_W=tiles.split_k, EVEN_K=True,
                EVEN_N=True, CDT=tl.bfloat16, IEEE=False, LORA_CDT=tl.float32, LORA_IEEE=False, USE_PDL=False,
                PDL_CHAIN=True, WAIT_FIRST=True, PF_AHEAD=0, PF_SLOTS=1, PF_LINES=1, W_PF_LINES=0, W_PER_LINE=64,
                X_SHIFT=False)  # fmt: skip
    opts = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    for trigger in (False, True):
        k = compile_as_launched(fn, ptrs, {**base, "TRIGGER_AFTER_WAIT": trigger}, SIXTEENS, opts)
        name = "trigger after wait" if trigger else "trigger first (the chain's default)"
        print(f"| decode_linear qkv | {name} | {tiles.num_warps} | {' | '.join(map(str, registers_and_stack(k)))} |", flush=True)
    r_ptrs = {**dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr", "cos_ptr", "sin_ptr"), "*bf16"),
              "slot_ptr": "*i64", "d_buf_ptr": "*fp32", "dbq_ptr": "*fp16", "dbk_ptr": "*fp16", "dbv_ptr": "*fp16",
              "d_slots_ptr": "*i32"}  # fmt: skip
    for D, rd, R in ((64, 64, 16), (80, 64, 16), (128, 128, 16), (128, 128, 64)):
        for has_delta in (False, True):
            consts = dict(ROT_BLOCK=rd // 2, REST_BLOCK=triton.next_power_of_2(D - rd) if D > rd else 0,
                          D_BLOCK=triton.next_power_of_2(D), PDL_CHAIN=True, HAS_DELTA=has_delta, D_BLOCK_R=R, D_RED=1,
                          D_CDT=tl.float32)  # fmt: skip
            warps = min(8, max(1, triton.next_power_of_2(D) * R // 1024)) if has_delta else 1  # as tew._rotary_warps
            k = compile_as_launched(tew._rotary_kv_cache_kernel, r_ptrs, consts, set(), dict(num_warps=warps))
            name = f"head_dim {D}, rotary {rd}, " + (f"qkv's delta, rank {R}" if has_delta else "plain")
            print(f"| rotary_kv_cache | {name} | {warps} | {' | '.join(map(str, registers_and_stack(k)))} |", flush=True)


def program_footprint(kernel, num_warps: int) -> tuple[int, int]:
    """(registers, shared bytes) one program of ``kernel`` holds on an SM: registers allocated 8 a thread at a time,
    the 1 KB the SM reserves a program counted with its shared memory."""
    regs, _ = registers_and_stack(kernel)
    return (regs + 7) // 8 * 8 * 32 * num_warps, kernel.metadata.shared + RESERVED


def beside_resources() -> None:
    """Whether a program of the gated SiLU-and-mul (``gated_lora``; Qwen2.5-0.5B, 32 tokens, fp16 B, 8 slots of rank 16)
    fits on an SM beside a program of gate/up's one-wave GEMM (K 896, 2 x 4864 rows of 128, one an SM), by registers
    and shared memory. Where it does not, the launch's programs past the SMs the GEMM leaves free (132 - 76) start only
    as the GEMM's end (a reading of a step trace; 128 columns, 38 programs, measured no faster)."""
    dl.sm_count = lambda *args: 132  # the H100 SXM's and H200's SMs: the one-wave tiles without a device
    gemm, tiles = compile_op(896, (4864, 4864), None, 0)
    g_regs, g_smem = program_footprint(gemm, tiles.num_warps)
    print(f"gate/up's GEMM: {tiles}, a program {g_regs} registers, {g_smem // 1024} KB shared; left beside it:"
          f" {SM_REGS - g_regs} registers, {(SM_SMEM - g_smem) // 1024} KB")
    print("| gated block_n | warps | register cap | registers a thread | spill bytes | shared KB | programs | fits beside |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for block_n, warps, cap in ((64, 8, 0), (128, 8, 0), (64, 8, 192), (64, 4, 0), (32, 4, 0)):
        k = compile_gated(block_n, warps, cap)
        regs, stack = registers_and_stack(k)
        p_regs, p_smem = program_footprint(k, warps)
        fits = p_regs <= SM_REGS - g_regs and p_smem <= SM_SMEM - g_smem
        print(f"| {block_n} | {warps} | {cap or '-'} | {regs} | {stack} | {k.metadata.shared // 1024} |"
              f" {triton.cdiv(4864, block_n)} | {'yes' if fits else 'no'} |", flush=True)


def main() -> None:
    import sys

    if "--early" in sys.argv:
        early_resources()
        return
    if "--beside" in sys.argv:
        beside_resources()
        return

    if "--gemm-shrink" in sys.argv:
        gemm_shrink_resources()
        return
    if "--norm-shrink" in sys.argv:
        norm_shrink_resources()
        return
    if "--norm-delta" in sys.argv:
        norm_delta_resources()
        return
    print("| op | LoRA B | epilogue columns per MMA | register cap | registers | spill bytes | shared KB | programs per SM (regs, smem) | programs | waves |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    configs = [(None, 0, 0), ("fp32", 128, 0), ("fp32", 64, 0), ("fp32", 32, 0), ("fp32", 128, 168),
               ("bf16", 128, 0), ("bf16", 32, 0), ("bf16", 128, 168), ("fp16", 128, 0)]  # fmt: skip
    for name, K, slices in OPS:
        for lora_dtype, columns, cap in configs:
            pf = dl.prefetch_ahead({"bf16": torch.bfloat16, "fp16": torch.float16}.get(lora_dtype, torch.float32))
            k, tiles = compile_op(K, slices, lora_dtype, columns, cap, pf)
            regs, stack = registers_and_stack(k)
            threads = 32 * tiles.num_warps
            by_regs = SM_REGS // (((regs + 7) // 8 * 8) * threads)
            by_smem = SM_SMEM // (k.metadata.shared + RESERVED)
            per_sm = min(by_regs, by_smem, 2048 // threads, 32)
            programs = triton.cdiv(sum(slices), tiles.block_n) * tiles.split_k
            print(f"| {name} | {lora_dtype or '-'} | {columns or '-'} | {cap or '-'} | {regs} | {stack} | {k.metadata.shared / 1024:.0f} | "
                  f"{per_sm} ({by_regs}, {by_smem}) | {programs} | {programs / (132 * per_sm):.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
