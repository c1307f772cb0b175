#!/usr/bin/env bash
# One device call: GPU tests and benchmarks, logs under $OUT (or /tmp/gpu_out). Stages pick what runs:
#   bash benchmarks/gpu/run_device.sh kernels   # kernel tests + bench_lora_kernels + bench_moe
#   bash benchmarks/gpu/run_device.sh tests     # every GPU test
#   bash benchmarks/gpu/run_device.sh e2e       # bench_e2e (Llama-8B and Qwen-0.5B shapes, HF + PEFT)
#   bash benchmarks/gpu/run_device.sh moe       # bench_moe only
#   bash benchmarks/gpu/run_device.sh tune      # bench_moe --tune: the grouped GEMM's tile sweep
#   bash benchmarks/gpu/run_device.sh decode    # bench_decode_linear: decode GEMM (+ fused LoRA) vs cuBLAS, Llama-8B
#   bash benchmarks/gpu/run_device.sh decode-tune  # the same after its tile sweep
#   bash benchmarks/gpu/run_device.sh peft      # tests/lora/test_peft_features.py on the GPU (every PEFT extra, graphs on)
#   bash benchmarks/gpu/run_device.sh lora      # the LoRA decode loop: kernel tests, bench_e2e Llama-8B (no HF), then --matrix
#   bash benchmarks/gpu/run_device.sh prefill   # LoRA kernel tests, the 4096-token rows as they are, then after
#                                               bench_lora_kernels --tune-prefill (the shrink's and expand's tile sweep)
#   bash benchmarks/gpu/run_device.sh prefill-tune   # only the sweep (and the 4096-token rows after it)
#   bash benchmarks/gpu/run_device.sh prefill-check  # every GPU test, then the 4096-token rows
#   bash benchmarks/gpu/run_device.sh confirm   # every GPU test, --matrix rows around the bf16 defaults, bench_e2e both
#                                               shapes without HF
#   bash benchmarks/gpu/run_device.sh gated     # the decode GEMM and gated-LoRA tests, bench_decode_linear --gated (gate_up's
#                                               delta in its GEMM's epilogue or in the SiLU-and-mul launch)
#   bash benchmarks/gpu/run_device.sh step      # every GPU test, bench_e2e both shapes without HF, --matrix rows default
#                                               and bf16 LoRA, then --gated
#   bash benchmarks/gpu/run_device.sh e2e-fast  # every GPU test, then bench_e2e both shapes without HF
#   bash benchmarks/gpu/run_device.sh knobs11   # --matrix rows around the bf16 defaults (MMA columns, B pull steps), then
#                                               --lora-tune with bf16 LoRA weights on the four ops
#   bash benchmarks/gpu/run_device.sh ncu       # Nsight Compute on the plain and the LoRA'd decode GEMM (profile_epilogue.py)
#   bash benchmarks/gpu/run_device.sh epi13     # the LoRA decode kernel tests, --matrix rows default and bf16 LoRA, bench_e2e Llama-8B
#   bash benchmarks/gpu/run_device.sh shrink-tune  # bench_lora_kernels --tune-prefill of the shrink only (the 4096-token rows after)
#   bash benchmarks/gpu/run_device.sh evenr     # every GPU test, the 4096-token LoRA rows, --matrix rows default and bf16 LoRA
#   bash benchmarks/gpu/run_device.sh fp16      # every GPU test, --matrix rows for fp32 / bf16 / fp16 LoRA weights (fp16: tf32 or
#                                               fp16 products, half or fp32 knobs), the 4096-token LoRA rows
#   bash benchmarks/gpu/run_device.sh split     # the LoRA kernel tests, the 4096-token rows, the shrink's wide-K tile sweep (bf16, fp16;
#                                               session 14 ran it with the split fp16 MMAs, since removed)
#   bash benchmarks/gpu/run_device.sh confirm14 # every GPU test, --matrix rows default (fp16), fp32 and bf16 LoRA, bench_e2e both
#                                               shapes without HF for auto, float32 and bfloat16 LoRA weights
#   bash benchmarks/gpu/run_device.sh floor     # shrink_floor.py (the prefill shrink vs reading x, cuBLAS), the wide-K sweep for fp16 A
#   bash benchmarks/gpu/run_device.sh e2e-dtypes  # bench_e2e Llama-8B without HF: auto (fp16 LoRA weights), float32, bfloat16
#   bash benchmarks/gpu/run_device.sh trace     # LoRA decode kernel tests, bench_decode_linear --trace (kernel
#                                               timestamps per op), --matrix rows default, bf16 LoRA, bf16 LoRA, neither (MATRIX_ROWS sets them)
#   bash benchmarks/gpu/run_device.sh fused     # the LoRA kernel tests (one-launch prefill too), the 4096-token rows (one launch
#                                               vs shrink + expand), then the one-launch tile sweep (TUNE_DTYPES, fp16 default)
#   bash benchmarks/gpu/run_device.sh steady    # the LoRA kernel tests, then steady_state.py (the 4096-token ops timed after do_bench's
#                                               L2 flush and back to back)
#   bash benchmarks/gpu/run_device.sh fp16x     # every GPU test, steady_state.py, --matrix rows default and bf16 LoRA
#                                               (session 18's first call also had a "tf32 shrink" row, removed once the
#                                               fp16 shrink became prefill-only: at decode it ran the default's code)
#   bash benchmarks/gpu/run_device.sh confirm18 # every GPU test, steady_state.py, bench_e2e Llama-8B with HF + PEFT
#   bash benchmarks/gpu/run_device.sh steptrace # step_trace.py: one decode step's kernel timeline, base vs 8 adapters, both shapes
#   bash benchmarks/gpu/run_device.sh norm19    # every GPU test, then step_trace.py on the Qwen-0.5B shape: the shrink in
#                                               the norms off (LORASERVE_NORM_SHRINK=0), on (the default), the decode shrink unsplit for K <= 1024
#   bash benchmarks/gpu/run_device.sh e2e19     # bench_e2e both shapes without HF: LORASERVE_NORM_SHRINK=0, then the default (on)
#   bash benchmarks/gpu/run_device.sh trace8b   # step_trace.py on the Llama-8B shape: LORASERVE_NORM_SHRINK=0, then the default (on)
#   bash benchmarks/gpu/run_device.sh fuse21    # the new kernels' tests, every GPU test, then step_trace.py on the Qwen-0.5B shape:
#                                               down's shrink in SiLU-and-mul and o's in attention both off (the default), each alone, both
#   bash benchmarks/gpu/run_device.sh e2e21     # bench_e2e both shapes without HF: the default (both off), then both on
#   bash benchmarks/gpu/run_device.sh all21     # the new tests, Qwen-0.5B's trace and bench_e2e (both fused shrinks off, on; session 21 ran it when on was the default), every GPU test
#   bash benchmarks/gpu/run_device.sh attn21    # o's shrink in attention (second form): its tests, off vs on, bench_e2e Qwen-0.5B, step_trace Llama-8B
#   bash benchmarks/gpu/run_device.sh defer22   # o's and down's delta in the norm after them, and o's shrink in attention:
#                                               their tests, bench_e2e Qwen-0.5B per setting, step_trace Qwen-0.5B
#   bash benchmarks/gpu/run_device.sh final22   # every GPU test, bench_e2e Qwen-0.5B with o's/down's delta in the norms off and on,
#                                               and Llama-8B
#   bash benchmarks/gpu/run_device.sh gemm24    # o's and down's shrink as their GEMM's extra column blocks (A's rows in W's dtype,
#                                               one K loop; session 23's first form, measured slower, is gone) off and on: its
#                                               tests, bench_e2e and step_trace Qwen-0.5B per setting, every GPU test with it on
#   bash benchmarks/gpu/run_device.sh early26   # gate/up's delta before the gated SiLU-and-mul's wait (LORASERVE_GATED_EARLY_DELTA), qkv's
#                                               in the rotary launch (LORASERVE_DEFER_QKV): their tests, bench_e2e and step_trace
#                                               Qwen-0.5B with neither, the first, both; every GPU test with both on
#   bash benchmarks/gpu/run_device.sh qkv26     # every GPU test with qkv's delta in the rotary launch, then step_trace Qwen-0.5B after
#                                               8 and 128 tokens and bench_e2e: qkv's delta in its epilogue, then in the rotary launch
#   bash benchmarks/gpu/run_device.sh wave27    # gate/up's GEMM in one wave (LORASERVE_DECODE_ONE_WAVE), alone and with gate/up's early
#                                               delta: their tests, step_trace and bench_e2e Qwen-0.5B with neither, the first, both
#   bash benchmarks/gpu/run_device.sh knobs27   # the norms on twice the warps (LORASERVE_NORM_ROW_PER_WARP=128: no spill with a delta), gate/up's
#                                               GEMM in one wave, alone and with its early delta: the norm and decode GEMM tests
#                                               with them on, then step_trace and bench_e2e Qwen-0.5B per setting ($KNOBS27_MORE: more)
#   bash benchmarks/gpu/run_device.sh all27     # qkv26's, knobs27's and wave27's questions in one call: every GPU test with all four knobs
#                                               on, then step_trace Qwen-0.5B adding them one by one (and after 128 tokens, qkv's
#                                               off and on), bench_e2e the same but the norms' warps alone
#   bash benchmarks/gpu/run_device.sh conf27    # every GPU test with session 27's defaults, then step_trace and bench_e2e Qwen-0.5B: the
#                                               defaults, the gated SiLU-and-mul on 128 columns a program, and with its early delta,
#                                               the norms' weight before their wait, the GEMMs' W pulled into L2 before theirs
#                                               (bench_e2e: all but the second); bn27: the
#                                               128 columns only, without every GPU test and bench_e2e
#   bash benchmarks/gpu/run_device.sh conf28    # conf27 in the order that matters when a call is cut short (every GPU test,
#                                               the step traces, the knobs' tests, bench_e2e of the defaults and of the three)
#   bash benchmarks/gpu/run_device.sh conf29    # every GPU test at session 28's defaults; step_trace Qwen-0.5B: the defaults, the
#                                               gated SiLU-and-mul under a register cap of 192 (and with its early delta);
#                                               Llama-8B: the defaults, the norms' weight after their wait; bench_e2e Qwen
#                                               of the defaults and the cap
#   bash benchmarks/gpu/run_device.sh cp29      # step_trace Qwen-0.5B with its critical path table, the defaults (twice)
#                                               and gate/up's delta in its GEMM; the raw kernel traces under $OUT
#   bash benchmarks/gpu/run_device.sh pf29      # the attention's LoRA L2 prefetch on and off: step_trace Qwen (raw traces
#                                               under $OUT) and Llama-8B, every GPU test, bench_e2e Qwen
#   bash benchmarks/gpu/run_device.sh aug29     # bench_decode_linear --augmented; the attention tests (prefetch on in its
#                                               test); step_trace Qwen at the defaults
#   bash benchmarks/gpu/run_device.sh ink29     # gate/up's delta as more K: step_trace Qwen off/on/off, bench_e2e Qwen on,
#                                               every GPU test with it on
#   bash benchmarks/gpu/run_device.sh final29   # every GPU test at the defaults; two test files with LORASERVE_DELTA_IN_K=1
#   bash benchmarks/gpu/run_device.sh slice29   # gate/up's delta as more K with each slice's set: step_trace Qwen off/on,
#                                               its tests, bench_e2e Qwen on, bench_decode_linear --augmented (its GEMM alone)
#   bash benchmarks/gpu/run_device.sh fold30    # the norms' shrink from the row before its normalization (LORASERVE_NORM_SHRINK_FOLD)
#                                               and gate/up's delta as more K: Qwen step_trace per setting, their tests, every
#                                               GPU test with both on, Llama-8B step_trace default vs more K
#   bash benchmarks/gpu/run_device.sh vocab30   # the embedding's and lm_head's delta skipped where no slot has one: Qwen step_trace
#                                               default and more K + fold, the new graph test, test_qkv_delta per knob,
#                                               every GPU test, bench_e2e Qwen (more K + fold), Llama-8B step_trace
#   bash benchmarks/gpu/run_device.sh conf30    # session 30's defaults: Qwen step_trace default, o's/down's shrink from both pieces of
#                                               A, session 29's defaults; the new tests; test_qkv_delta's rotary test with the fold
#                                               on (PDL chain on and off) and off; every GPU test; bench_e2e both shapes with HF
#                                               + PEFT (8 of its new tokens); Llama-8B step_trace
#   bash benchmarks/gpu/run_device.sh final30   # conf30's failed tests after their fixes, every GPU test, Qwen step_trace at the defaults twice
#   bash benchmarks/gpu/run_device.sh post30    # after session 30's review fixes (run on the CPU only): every GPU test, Qwen step_trace
#                                               and bench_e2e Qwen at the defaults
#   bash benchmarks/gpu/run_device.sh trace8b21 # step_trace.py on the Llama-8B shape: o's shrink in attention off (the default), then on
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
# Helpers of the stages since session 19. Every output goes to one file per kind under $OUT (few files come back
# from a device call: step_trace's per-kernel files go under /tmp).
gpu_tests() {  # every GPU test; $1: its timeout
    timeout "$1" python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | grep "passed\|failed\|FAILED\|Error" | tail -12 | tee -a "$OUT/gpu_tests.txt"
}
new_tests() {  # some GPU tests; $1: their timeout, then pytest's arguments
    local limit=$1
    shift
    timeout "$limit" python3 -m pytest -o addopts= -q -p no:cacheprovider "$@" 2>&1 | tail -8 | tee -a "$OUT/new_tests.txt"
}
e2e_per_setting() {  # bench_e2e without HF once per setting; $1: timeout, $2: shapes ("": both), then the settings ("": defaults);
    # $E2E_EXTRA: more arguments of bench_e2e
    local limit=$1 shapes=$2
    shift 2
    for knobs in "$@"; do
        echo "### bench_e2e ${shapes:-both shapes}: ${knobs:-default}" | tee -a "$OUT/e2e.txt"
        env $knobs timeout "$limit" python3 benchmarks/gpu/bench_e2e.py ${shapes:+--shapes "$shapes"} --skip-hf ${E2E_EXTRA:-} 2>&1 | grep "^| \|replay\|parity max\|greedy ids" | tee -a "$OUT/e2e.txt"
    done
}
trace_per_setting() {  # step_trace once per setting; $1: timeout, $2: the shape, then the settings ("": defaults);
    # $TRACE_EXTRA: more arguments of step_trace
    local limit=$1 shape=$2
    shift 2
    for knobs in "$@"; do
        name=$(echo "${knobs:-default}" | tr ' =,' '___')
        echo "### step_trace $shape: ${knobs:-default}" | tee -a "$OUT/step_trace_$shape.txt"
        env $knobs timeout "$limit" python3 benchmarks/gpu/step_trace.py --shapes "$shape" ${TRACE_EXTRA:-} --out "/tmp/traces_${shape}_$name" 2>&1 | grep -v Warn | tee -a "$OUT/step_trace_$shape.txt" | grep "graph replay"
    done
}
raw_traces_per_setting() {  # trace_per_setting, each setting's kernel traces under $OUT (numbered: settings repeat)
    local limit=$1 shape=$2 i=0
    shift 2
    for knobs in "$@"; do
        i=$((i + 1))
        name=${i}_$(echo "${knobs:-default}" | tr ' =,' '___')
        echo "### step_trace $shape: ${knobs:-default}" | tee -a "$OUT/step_trace_$shape.txt"
        env $knobs timeout "$limit" python3 benchmarks/gpu/step_trace.py --shapes "$shape" --out "$OUT/traces_$name" 2>&1 | grep -v Warn | tee -a "$OUT/step_trace_$shape.txt" | grep "graph replay"
    done
}
for stage in "$@"; do
    start=$SECONDS
    case "$stage" in
        kernels)
            timeout 200 python3 -m pytest -o addopts= -q -x -p no:cacheprovider tests/gpu/test_triton_moe.py tests/gpu/test_triton_lora.py 2>&1 | tail -15 | tee "$OUT/kernel_tests.txt"
            timeout 200 python3 benchmarks/gpu/bench_moe.py --json "$OUT/moe.json" 2>&1 | tee "$OUT/bench_moe.txt"
            timeout 200 python3 benchmarks/gpu/bench_lora_kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/bench_kernels.txt"
            ;;
        tests)
            timeout 330 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
            ;;
        tune)
            timeout 240 python3 benchmarks/gpu/bench_moe.py --tune --json "$OUT/moe_tune.json" 2>&1 | tee "$OUT/moe_tune.txt"
            ;;
        decode)
            timeout 150 python3 benchmarks/gpu/bench_decode_linear.py --models llama-8b --tokens 16,32 --json "$OUT/decode.json" 2>&1 | tee "$OUT/bench_decode.txt"
            ;;
        decode-tune)
            timeout 300 python3 benchmarks/gpu/bench_decode_linear.py --tune --json "$OUT/decode.json" 2>&1 | grep -v OutOfResources | tee "$OUT/bench_decode.txt"
            ;;
        peft)
            timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 6 tests/lora/test_peft_features.py 2>&1 | tail -5 | tee "$OUT/peft_tests.txt"
            ;;
        lora)
            timeout 120 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu/test_decode_linear.py tests/gpu/test_triton_lora.py 2>&1 | tail -3 | tee "$OUT/lora_tests.txt"
            timeout 170 python3 benchmarks/gpu/bench_e2e.py --shapes llama-3.1-8b --skip-hf --bf16-loras --json "$OUT/e2e_8b.json" 2>&1 | tee "$OUT/e2e_8b.txt" | grep -A6 "^| model"
            timeout 240 python3 benchmarks/gpu/bench_decode_linear.py --matrix --json "$OUT/matrix.json" 2>&1 | grep -v "^|---" | tee "$OUT/matrix.txt"
            ;;
        prefill)
            timeout 120 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu/test_triton_lora.py 2>&1 | tail -3 | tee "$OUT/lora_tests.txt"
            timeout 100 python3 benchmarks/gpu/bench_lora_kernels.py --prefill-only --json "$OUT/prefill_default.json" 2>&1 | tee "$OUT/prefill_default.txt" | grep "^| qkv\|^| gate_up\|copy"
            timeout 420 python3 benchmarks/gpu/bench_lora_kernels.py --tune-prefill --prefill-only --json "$OUT/prefill_tuned.json" 2>&1 | tee "$OUT/prefill_tuned.txt" | grep -v "^|---"
            ;;
        prefill-check)
            timeout 300 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
            timeout 80 python3 benchmarks/gpu/bench_lora_kernels.py --prefill-only --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.txt" | grep "^| qkv\|^| gate_up\|copy"
            ;;
        prefill-tune)
            timeout 420 python3 benchmarks/gpu/bench_lora_kernels.py --tune-prefill --prefill-only --json "$OUT/prefill_tuned.json" 2>&1 | tee "$OUT/prefill_tuned.txt" | grep -v "^|---"
            ;;
        confirm)
            timeout 220 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
            timeout 100 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "default;bf16 LoRA;bf16 LoRA, neither;bf16 LoRA, B 8 steps ahead;bf16 LoRA, shrink K blocks 256/1024" --json "$OUT/matrix.json" 2>&1 | grep -v "^|---\|parts" | tee "$OUT/matrix.txt" | tail -8
            timeout 260 python3 benchmarks/gpu/bench_e2e.py --skip-hf --bf16-loras --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" | grep -A8 "^| model\|parity max\|greedy ids\|replay"
            ;;
        trace)
            timeout 120 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu/test_decode_linear.py tests/gpu/test_triton_lora.py 2>&1 | tail -3 | tee "$OUT/lora_tests.txt"
            timeout 120 python3 benchmarks/gpu/bench_decode_linear.py --trace "$OUT/traces" 2>&1 | tee "$OUT/trace.txt"
            timeout 200 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "${MATRIX_ROWS:-default;bf16 LoRA;bf16 LoRA, neither}" --json "$OUT/matrix.json" 2>&1 | grep -v "^|---" | tee "$OUT/matrix.txt"
            ;;
        step)
            timeout 200 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
            timeout 240 python3 benchmarks/gpu/bench_e2e.py --skip-hf --bf16-loras --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" | grep -A8 "^| model\|parity max\|greedy ids\|replay"
            timeout 80 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "default;bf16 LoRA" --json "$OUT/matrix.json" 2>&1 | grep -v "^|---" | tee "$OUT/matrix.txt" | tail -14
            timeout 100 python3 benchmarks/gpu/bench_decode_linear.py --gated 2>&1 | tee "$OUT/gated.txt"
            ;;
        e2e-fast)
            timeout 200 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
            timeout 240 python3 benchmarks/gpu/bench_e2e.py --skip-hf --bf16-loras --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" | grep -A8 "^| model\|parity max\|greedy ids\|replay"
            ;;
        knobs11)
            timeout 150 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "default;bf16 LoRA;bf16 LoRA, 64 columns per MMA;bf16 LoRA, B 2 steps ahead;bf16 LoRA, B 6 steps ahead;64 columns per MMA" --json "$OUT/matrix.json" 2>&1 | grep -v "^|---\|parts" | tee "$OUT/matrix.txt" | tail -8
            timeout 240 python3 benchmarks/gpu/bench_decode_linear.py --lora-tune --lora-tune-dtype bf16 --lora-tune-ops qkv,o,gate_up,down --layers 4 2>&1 | grep -v OutOfResources | tee "$OUT/lora_tune.txt"
            ;;
        gated)
            timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu/test_decode_linear.py tests/gpu/test_gated_lora.py 2>&1 | tail -5 | tee "$OUT/gated_tests.txt"
            timeout 200 python3 benchmarks/gpu/bench_decode_linear.py --gated 2>&1 | tee "$OUT/gated.txt"
            ;;
        ncu)
            # Nsight Compute on the LoRA'd decode GEMM vs the plain one (profile_epilogue.py): the full set with
            # the warp-state samples per SASS instruction, exported as csv and summarized
            NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
            echo "ncu: $NCU"; "$NCU" --version | tail -1
            NCU_TMP=$(mktemp -d)  # the report and the exports stay here: a call brings back at most 8 files
            timeout 300 "$NCU" --clock-control none --profile-from-start off --set full --import-source yes \
                -k regex:_decode_linear_kernel -f -o "$NCU_TMP/epilogue" python3 benchmarks/gpu/profile_epilogue.py 2>&1 | tail -3
            "$NCU" --import "$NCU_TMP/epilogue.ncu-rep" --page details --csv > "$NCU_TMP/details.csv"
            for i in ${NCU_SOURCES:-0 1 5}; do
                "$NCU" --import "$NCU_TMP/epilogue.ncu-rep" --page source --print-source sass --csv --launch-skip "$i" --launch-count 1 > "$NCU_TMP/source_$i.csv"
            done
            python3 benchmarks/gpu/profile_epilogue.py --summarize "$NCU_TMP" 2>&1 | tee "$OUT/ncu_summary.txt" | grep "^## source"
            for i in ${NCU_KEEP:-1}; do cp "$NCU_TMP/source_$i.csv" "$OUT/"; done
            ;;
        epi13)
            timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu/test_decode_linear.py tests/gpu/test_triton_lora.py tests/gpu/test_gated_lora.py tests/gpu/test_fused_decoder_path.py 2>&1 | tail -3 | tee "$OUT/lora_tests.txt"
            timeout 100 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "default;bf16 LoRA" 2>&1 | grep -v "^|---" | tee "$OUT/matrix.txt" | tail -14
            timeout 200 python3 benchmarks/gpu/bench_e2e.py --shapes llama-3.1-8b --skip-hf --bf16-loras --json "$OUT/e2e_8b.json" 2>&1 | tee "$OUT/e2e_8b.txt" | grep -A6 "^| model\|parity max\|greedy ids\|replay"
            ;;
        shrink-tune)
            timeout 480 python3 benchmarks/gpu/bench_lora_kernels.py --tune-prefill --tune-kinds shrink --prefill-only --json "$OUT/shrink_tuned.json" 2>&1 | tee "$OUT/shrink_tuned.txt" | grep -v "^|---"
            ;;
        ncu-shrink)
            # Nsight Compute on the prefill shrink (qkv, 4096 tokens, bf16 and fp32 A): launches 0 and 1
            NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
            NCU_TMP=$(mktemp -d)
            timeout 200 "$NCU" --clock-control none --profile-from-start off --set full --import-source yes \
                -k regex:_lora_shrink_kernel -f -o "$NCU_TMP/shrink" python3 benchmarks/gpu/profile_epilogue.py --prefill-shrink 2>&1 | tail -2
            "$NCU" --import "$NCU_TMP/shrink.ncu-rep" --page details --csv > "$NCU_TMP/details.csv"
            "$NCU" --import "$NCU_TMP/shrink.ncu-rep" --page details > "$OUT/shrink_details.txt"
            for i in 0 1; do
                "$NCU" --import "$NCU_TMP/shrink.ncu-rep" --page source --print-source sass --csv --launch-skip "$i" --launch-count 1 > "$NCU_TMP/source_$i.csv"
            done
            python3 benchmarks/gpu/profile_epilogue.py --summarize "$NCU_TMP" 2>&1 | tee "$OUT/ncu_shrink_summary.txt" | head -60
            cp "$NCU_TMP/source_0.csv" "$OUT/shrink_source_0.csv"
            ;;
        evenr)
            timeout 200 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -2 | tee "$OUT/gpu_tests.txt"
            timeout 100 python3 benchmarks/gpu/bench_lora_kernels.py --prefill-only 2>&1 | grep "^| qkv\|^| gate_up\|copy" | tee "$OUT/prefill.txt"
            timeout 100 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "default;bf16 LoRA" 2>&1 | grep -v "^|---\|parts" | tee "$OUT/matrix.txt" | tail -4
            ;;
        fp16)
            timeout 220 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
            timeout 200 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "${MATRIX_ROWS:-default;bf16 LoRA;fp16 LoRA;fp16 LoRA, fp16 products;fp16 LoRA, fp32 knobs}" --json "$OUT/matrix.json" 2>&1 | grep -v "^|---" | tee "$OUT/matrix.txt" | tail -30
            timeout 150 python3 benchmarks/gpu/bench_lora_kernels.py --prefill-only 2>&1 | grep "^| qkv\|^| gate_up\|copy" | tee "$OUT/prefill.txt"
            ;;
        split)
            timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu/test_triton_lora.py 2>&1 | tail -3 | tee "$OUT/lora_tests.txt"
            timeout 100 python3 benchmarks/gpu/bench_lora_kernels.py --prefill-only 2>&1 | grep "^| qkv\|^| gate_up\|copy" | tee "$OUT/prefill.txt"
            timeout 330 python3 benchmarks/gpu/bench_lora_kernels.py --tune-prefill --tune-kinds shrink --tune-grid wide-k --tune-dtypes bfloat16,float16 --prefill-only 2>&1 | grep -v "^|---" | tee "$OUT/shrink_wide_k.txt" | grep -v "skipped"
            ;;
        confirm14)
            timeout 200 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -2 | tee "$OUT/gpu_tests.txt"
            timeout 100 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "default;fp32 LoRA;bf16 LoRA" --json "$OUT/matrix.json" 2>&1 | grep -v "^|---\|parts" | tee "$OUT/matrix.txt" | tail -4
            timeout 280 python3 benchmarks/gpu/bench_e2e.py --skip-hf --lora-dtypes float32,bfloat16 --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" | grep -A12 "^| model\|parity max\|greedy ids\|replay"
            ;;
        floor)
            timeout 120 python3 benchmarks/gpu/shrink_floor.py 2>&1 | tee "$OUT/shrink_floor.txt"
            timeout 300 python3 benchmarks/gpu/bench_lora_kernels.py --tune-prefill --tune-kinds shrink --tune-grid wide-k --tune-dtypes float16 --prefill-only 2>&1 | grep -v "^|---" | tee "$OUT/shrink_wide_k_fp16.txt" | grep -v "skipped"
            ;;
        e2e-dtypes)
            timeout 400 python3 benchmarks/gpu/bench_e2e.py --shapes "${E2E_SHAPES:-llama-3.1-8b}" --skip-hf --lora-dtypes float32,bfloat16 --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" | grep -A9 "^| model\|parity max\|greedy ids\|replay"
            ;;
        fused)
            timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu/test_lora_prefill.py tests/gpu/test_triton_lora.py 2>&1 | tail -6 | tee "$OUT/lora_tests.txt"
            timeout 100 python3 benchmarks/gpu/bench_lora_kernels.py --prefill-only --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.txt" | grep -A14 "copy\|^| prefill op"
            timeout 330 python3 benchmarks/gpu/bench_lora_kernels.py --tune-fused "${TUNE_GRID:-default}" --tune-dtypes "${TUNE_DTYPES:-float16}" --prefill-only --json "$OUT/fused_tuned.json" 2>&1 | grep -v "^|---" | tee "$OUT/fused_tuned.txt" | grep -v "skipped" | grep -A14 "^| \|^fused\|^| prefill op"
            ;;
        steady)
            timeout 150 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu/test_lora_prefill.py tests/gpu/test_triton_lora.py 2>&1 | tail -6 | tee "$OUT/lora_tests.txt"
            timeout 240 python3 benchmarks/gpu/steady_state.py --json "$OUT/steady.json" 2>&1 | tee "$OUT/steady.txt"
            ;;
        fp16x)
            timeout 300 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
            timeout 150 python3 benchmarks/gpu/steady_state.py --json "$OUT/steady.json" 2>&1 | tee "$OUT/steady.txt"
            timeout 120 python3 benchmarks/gpu/bench_decode_linear.py --matrix --rows "default;bf16 LoRA" --json "$OUT/matrix.json" 2>&1 | grep -v "^|---\|parts" | tee "$OUT/matrix.txt" | tail -5
            ;;
        confirm18)
            timeout 240 python3 -m pytest -o addopts= -q -p no:cacheprovider -n 8 tests/gpu 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
            timeout 120 python3 benchmarks/gpu/steady_state.py --json "$OUT/steady.json" 2>&1 | grep -v Warn | tee "$OUT/steady.txt"
            timeout 200 python3 benchmarks/gpu/bench_e2e.py --shapes llama-3.1-8b --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" | grep -A8 "^| model\|parity max\|greedy ids\|replay"
            ;;
        norm19)
            gpu_tests 240
            trace_per_setting 100 qwen2.5-0.5b "LORASERVE_NORM_SHRINK=0" "" "LORASERVE_SHRINK_DECODE_BLOCK_K=1024,512 LORASERVE_SHRINK_FUSE_DECODE=0"
            ;;
        trace8b)
            trace_per_setting 250 llama-3.1-8b "LORASERVE_NORM_SHRINK=0" ""
            ;;
        e2e19)
            e2e_per_setting 270 "" "LORASERVE_NORM_SHRINK=0" ""
            ;;
        fuse21)
            new_tests 150 tests/gpu/test_gated_lora.py tests/gpu/test_attention_shrink.py tests/gpu/test_norm_shrink.py
            gpu_tests 240
            trace_per_setting 100 qwen2.5-0.5b "" "LORASERVE_GATED_SHRINK=1" "LORASERVE_ATTN_SHRINK=1" "LORASERVE_GATED_SHRINK=1 LORASERVE_ATTN_SHRINK=1"
            ;;
        e2e21)
            e2e_per_setting 200 "" "" "LORASERVE_GATED_SHRINK=1 LORASERVE_ATTN_SHRINK=1"
            ;;
        all21)
            # one call's worth, most wanted first: the new kernels' tests, the Qwen-0.5B step (trace, then bench_e2e) with the
            # fused shrinks of down and o off (the default) and on, then every GPU test
            new_tests 120 tests/gpu/test_gated_lora.py tests/gpu/test_attention_shrink.py tests/gpu/test_norm_shrink.py
            trace_per_setting 80 qwen2.5-0.5b "" "LORASERVE_GATED_SHRINK=1 LORASERVE_ATTN_SHRINK=1"
            e2e_per_setting 90 qwen2.5-0.5b "" "LORASERVE_GATED_SHRINK=1 LORASERVE_ATTN_SHRINK=1"
            gpu_tests 240
            ;;
        attn21)
            # o's shrink in the decode attention, second form (A before the wait, one MMA, per-KV-head planes that o's
            # GEMM sums): its tests, then off (the default) and on: bench_e2e Qwen-0.5B, step_trace Llama-8B
            new_tests 120 tests/gpu/test_attention_shrink.py tests/gpu/test_norm_shrink.py tests/gpu/test_gated_lora.py
            e2e_per_setting 90 qwen2.5-0.5b "" "LORASERVE_ATTN_SHRINK=1"
            trace_per_setting 100 llama-3.1-8b "" "LORASERVE_ATTN_SHRINK=1"
            ;;
        defer22)
            # o's and down's delta left to the norm after them (row_delta, then opt-in: LORASERVE_DEFER_DELTA=1) and o's shrink in
            # attention (second form, LORASERVE_ATTN_SHRINK=1): their tests, then bench_e2e Qwen-0.5B for each
            # setting and step_trace's Qwen-0.5B timeline for the default and the deferred delta
            [ -n "${SKIP_NEW_TESTS:-}" ] || new_tests 200 -n 4 tests/gpu/test_row_delta.py tests/gpu/test_attention_shrink.py tests/gpu/test_norm_shrink.py tests/gpu/test_triton_elementwise.py tests/gpu/test_fused_decoder_path.py tests/gpu/test_gated_lora.py
            e2e_per_setting 90 qwen2.5-0.5b "" "LORASERVE_DEFER_DELTA=1" "LORASERVE_ATTN_SHRINK=1" "LORASERVE_DEFER_DELTA=1 LORASERVE_ATTN_SHRINK=1"
            trace_per_setting 90 qwen2.5-0.5b "" "LORASERVE_DEFER_DELTA=1"
            ;;
        final22)
            # the default with o's and down's delta in the norms (row_delta, on since session 22): every GPU test, then
            # bench_e2e Qwen-0.5B off (LORASERVE_DEFER_DELTA=0) and on, and Llama-8B (which row_delta does not take)
            gpu_tests 240
            e2e_per_setting 90 qwen2.5-0.5b "LORASERVE_DEFER_DELTA=0" ""
            e2e_per_setting 150 llama-3.1-8b ""
            ;;
        gemm24)
            # the second form of o's and down's shrink in their GEMM (A's rows in W's dtype, one K loop: W's registers):
            # its tests, bench_e2e and step_trace Qwen-0.5B off (LORASERVE_GEMM_SHRINK=0) and on, every GPU test
            [ -n "${SKIP_NEW_TESTS:-}" ] || new_tests 200 -n 4 tests/gpu/test_row_delta.py tests/gpu/test_decode_linear.py tests/gpu/test_norm_shrink.py tests/gpu/test_triton_elementwise.py tests/gpu/test_fused_decoder_path.py tests/gpu/test_gated_lora.py
            E2E_EXTRA=--bf16-loras e2e_per_setting 120 qwen2.5-0.5b "LORASERVE_GEMM_SHRINK=0" "LORASERVE_GEMM_SHRINK=1"  # bf16 A: one piece
            trace_per_setting 90 qwen2.5-0.5b "LORASERVE_GEMM_SHRINK=0" "LORASERVE_GEMM_SHRINK=1"
            # every GPU test with the GEMM shrink on: the setting that would become the default
            [ -n "${SKIP_ALL_GPU_TESTS:-}" ] || (export LORASERVE_GEMM_SHRINK=1; gpu_tests 240)  # (set when little device time is left)
            ;;
        early26)
            # two LoRA deltas computed before a PDL wait, off the chain's critical path (the GEMM before lets the reader
            # launch only after its own wait for the norm that wrote s): gate/up's in the gated SiLU-and-mul
            # (LORASERVE_GATED_EARLY_DELTA) and qkv's in the rotary + KV-cache launch (LORASERVE_DEFER_QKV). Their tests,
            # bench_e2e and step_trace Qwen-0.5B with neither, the first, both; every GPU test with both on
            both="LORASERVE_GATED_EARLY_DELTA=1 LORASERVE_DEFER_QKV=1"
            [ -n "${SKIP_NEW_TESTS:-}" ] || (export $both; new_tests 200 -n 4 tests/gpu/test_qkv_delta.py tests/gpu/test_norm_shrink.py tests/gpu/test_gated_lora.py tests/gpu/test_decode_linear.py tests/gpu/test_row_delta.py tests/gpu/test_triton_elementwise.py tests/gpu/test_fused_decoder_path.py)
            E2E_EXTRA=--bf16-loras e2e_per_setting 120 qwen2.5-0.5b "LORASERVE_GATED_EARLY_DELTA=0" "LORASERVE_GATED_EARLY_DELTA=1" "$both"
            trace_per_setting 90 qwen2.5-0.5b "LORASERVE_GATED_EARLY_DELTA=0" "LORASERVE_GATED_EARLY_DELTA=1" "$both"
            [ -n "${SKIP_ALL_GPU_TESTS:-}" ] || (export $both; gpu_tests 240)
            ;;
        qkv26)
            # qkv's delta in the rotary launch (LORASERVE_DEFER_QKV), measured two ways in session 26 that disagreed: every
            # GPU test with it on (the decoder tests early26 found counting the other setting's launches now pin theirs),
            # then step_trace Qwen-0.5B after 8 and after 128 decoded tokens (bench_e2e's context) and bench_e2e, each
            # with qkv's delta in its epilogue (0) and in the rotary launch (1)
            [ -n "${SKIP_ALL_GPU_TESTS:-}" ] || (export LORASERVE_DEFER_QKV=1; gpu_tests 200)
            for n in 8 128; do
                for q in 0 1; do
                    echo "### step_trace qwen2.5-0.5b --new-tokens $n: LORASERVE_DEFER_QKV=$q" | tee -a "$OUT/step_trace_qwen2.5-0.5b.txt"
                    LORASERVE_DEFER_QKV=$q timeout 80 python3 benchmarks/gpu/step_trace.py --shapes qwen2.5-0.5b --new-tokens $n --out "/tmp/traces_q${q}_$n" 2>&1 | grep -v Warn | tee -a "$OUT/step_trace_qwen2.5-0.5b.txt" | grep "graph replay"
                done
            done
            e2e_per_setting 100 qwen2.5-0.5b "LORASERVE_DEFER_QKV=0" "LORASERVE_DEFER_QKV=1"
            ;;
        wave27)
            # gate/up's GEMM in one wave of 128-row blocks (LORASERVE_DECODE_ONE_WAVE), so that the gated SiLU-and-mul
            # launches early, alone and with its delta before its wait (LORASERVE_GATED_EARLY_DELTA): the decode GEMM and
            # gated tests with both on, then step_trace and bench_e2e Qwen-0.5B with neither, the first, both
            wave="LORASERVE_DECODE_ONE_WAVE=1"
            (export $wave LORASERVE_GATED_EARLY_DELTA=1; new_tests 150 -n 4 tests/gpu/test_decode_linear.py tests/gpu/test_gated_lora.py tests/gpu/test_norm_shrink.py)
            trace_per_setting 90 qwen2.5-0.5b "LORASERVE_DECODE_ONE_WAVE=0" "$wave" "$wave LORASERVE_GATED_EARLY_DELTA=1"
            e2e_per_setting 100 qwen2.5-0.5b "LORASERVE_DECODE_ONE_WAVE=0" "$wave" "$wave LORASERVE_GATED_EARLY_DELTA=1"
            ;;
        all27)
            q=LORASERVE_DEFER_QKV=1 n=LORASERVE_NORM_ROW_PER_WARP=128 w=LORASERVE_DECODE_ONE_WAVE=1
            on="$q $n $w LORASERVE_GATED_EARLY_DELTA=1"
            [ -n "${SKIP_ALL_GPU_TESTS:-}" ] || (export $on; gpu_tests 150)
            trace_per_setting 60 qwen2.5-0.5b "" "$q" "$n" "$q $n" "$q $n $w" "$on"
            echo "### after 128 decoded tokens (bench_e2e's context):" | tee -a "$OUT/step_trace_qwen2.5-0.5b.txt"
            TRACE_EXTRA="--new-tokens 128" trace_per_setting 60 qwen2.5-0.5b "" "$q"
            e2e_per_setting 80 qwen2.5-0.5b "" "$q" "$q $n" "$q $n $w" "$on"
            ;;
        conf27)
            [ -n "${SKIP_ALL_GPU_TESTS:-}" ] || gpu_tests 150
            g=LORASERVE_GATED_BLOCK_N=128 w=LORASERVE_NORM_WEIGHT_EARLY=1 p=LORASERVE_DECODE_W_PREFETCH=1
            (export $g LORASERVE_GATED_EARLY_DELTA=1 $w $p; new_tests 120 -n 4 tests/gpu/test_gated_lora.py tests/gpu/test_norm_shrink.py tests/gpu/test_fused_decoder_path.py tests/gpu/test_triton_elementwise.py tests/gpu/test_row_delta.py tests/gpu/test_decode_linear.py)
            trace_per_setting 60 qwen2.5-0.5b "" "$g" "$g LORASERVE_GATED_EARLY_DELTA=1" "$w" "$p"
            e2e_per_setting 80 qwen2.5-0.5b "" "$g LORASERVE_GATED_EARLY_DELTA=1" "$w" "$p"
            ;;
        conf28)  # conf27 in the order of what matters when a call is cut short: every GPU test at the defaults, the
            # step traces, the knobs' tests, bench_e2e of the defaults and of the three together
            [ -n "${SKIP_ALL_GPU_TESTS:-}" ] || gpu_tests 150
            g=LORASERVE_GATED_BLOCK_N=128 w=LORASERVE_NORM_WEIGHT_EARLY=1 p=LORASERVE_DECODE_W_PREFETCH=1
            trace_per_setting 60 qwen2.5-0.5b "" "$g" "$w" "$p" "$g $w $p"
            (export $g LORASERVE_GATED_EARLY_DELTA=1 $w $p; new_tests 120 -n 4 tests/gpu/test_gated_lora.py tests/gpu/test_norm_shrink.py tests/gpu/test_fused_decoder_path.py tests/gpu/test_triton_elementwise.py tests/gpu/test_row_delta.py tests/gpu/test_decode_linear.py)
            e2e_per_setting 80 qwen2.5-0.5b "" "$g $w $p"
            ;;
        conf29)
            [ -n "${SKIP_ALL_GPU_TESTS:-}" ] || gpu_tests 150
            c=LORASERVE_GATED_MAXNREG=192
            trace_per_setting 60 qwen2.5-0.5b "" "$c" "$c LORASERVE_GATED_EARLY_DELTA=1"
            (export $c; new_tests 60 -n 4 tests/gpu/test_gated_lora.py tests/gpu/test_fused_decoder_path.py)
            trace_per_setting 120 llama-3.1-8b "" "LORASERVE_NORM_WEIGHT_EARLY=0"
            e2e_per_setting 80 qwen2.5-0.5b "" "$c"
            ;;
        ink29)  # gate/up's delta as more K (LORASERVE_DELTA_IN_K=1): Qwen's step_trace off/on, bench_e2e on, every GPU test on
            k=LORASERVE_DELTA_IN_K=1
            trace_per_setting 60 qwen2.5-0.5b "" "$k" ""
            e2e_per_setting 80 qwen2.5-0.5b "$k"
            (export $k; gpu_tests 150)
            ;;
        post30)  # session 30's review fixes on the GPU: every GPU test, Qwen's step and e2e at the defaults
            gpu_tests 170
            trace_per_setting 50 qwen2.5-0.5b ""
            e2e_per_setting 60 qwen2.5-0.5b ""
            ;;
        final30)  # the fixed tests, every GPU test, Qwen's step twice at the defaults
            new_tests 90 -n 3 tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_cuda_graphs.py tests/gpu/test_qkv_delta.py -k "one_piece or lm_head_delta or decoder_rotary"
            gpu_tests 150
            trace_per_setting 50 qwen2.5-0.5b "" ""
            ;;
        conf30)  # session 30's defaults against the knobs that undo them; the new tests; every GPU test; e2e with HF; Llama
            trace_per_setting 50 qwen2.5-0.5b "" "LORASERVE_ONE_PIECE_WHERE_EXACT=0" "LORASERVE_DELTA_IN_K=0 LORASERVE_NORM_SHRINK_FOLD=0 LORASERVE_ONE_PIECE_WHERE_EXACT=0"
            new_tests 120 -n 4 tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_cuda_graphs.py -k "one_piece or fold or delta_in_k or lm_head_delta"
            for knobs in "" "LORASERVE_PDL_CHAIN=0" "LORASERVE_NORM_SHRINK_FOLD=0"; do
                echo "### test_qkv_delta: ${knobs:-default}" | tee -a "$OUT/new_tests.txt"
                (if [ -n "$knobs" ]; then export $knobs; fi; new_tests 40 tests/gpu/test_qkv_delta.py -k decoder_rotary)
            done
            gpu_tests 170
            timeout 260 python3 benchmarks/gpu/bench_e2e.py --hf-new-tokens 8 2>&1 | grep "^| \|replay\|parity max\|greedy ids\|tok/s" | tee "$OUT/e2e.txt"
            trace_per_setting 70 llama-3.1-8b ""
            ;;
        vocab30)  # the vocab deltas skipped: Qwen default and more K + fold, the new tests, every GPU test, e2e, Llama
            k=LORASERVE_DELTA_IN_K=1
            f=LORASERVE_NORM_SHRINK_FOLD=1
            trace_per_setting 50 qwen2.5-0.5b "" "$k $f"
            new_tests 60 tests/gpu/test_gpu_cuda_graphs.py -k lm_head_delta
            for knobs in "$k" "$f" "$k $f" "$k $f"; do
                echo "### test_qkv_delta: $knobs" | tee -a "$OUT/new_tests.txt"
                (if [ -n "$knobs" ]; then export $knobs; fi; new_tests 40 tests/gpu/test_qkv_delta.py -k decoder_rotary)
            done
            gpu_tests 170
            e2e_per_setting 60 qwen2.5-0.5b "$k $f"
            trace_per_setting 70 llama-3.1-8b ""
            ;;
        fold30)  # the folded shrink and gate/up's delta as more K: Qwen per setting, their tests, every GPU test both on, Llama
            k=LORASERVE_DELTA_IN_K=1
            f=LORASERVE_NORM_SHRINK_FOLD=1
            trace_per_setting 50 qwen2.5-0.5b "" "$k" "$k $f" "$f"
            new_tests 90 -n 4 tests/gpu/test_norm_shrink.py tests/gpu/test_gpu_engine.py -k "fold or delta_in_k or unrounded"
            (export $k $f; gpu_tests 170)
            trace_per_setting 70 llama-3.1-8b "" "$k" "$k $f"
            ;;
        slice29)  # gate/up's delta as more K, each slice's set (W 128 more columns): Qwen step_trace off/on, its tests, e2e on
            k=LORASERVE_DELTA_IN_K=1
            trace_per_setting 50 qwen2.5-0.5b "" "$k"
            new_tests 60 -n 4 tests/gpu/test_delta_in_k.py tests/gpu/test_gpu_engine.py -k "delta_in_k or more_columns or reads_each"
            e2e_per_setting 60 qwen2.5-0.5b "$k"
            timeout 240 python3 benchmarks/gpu/bench_decode_linear.py --augmented 2>&1 | grep -v Warn | tee "$OUT/augmented.txt"
            ;;
        final29)  # every GPU test at the defaults; the decoder norms' tests with gate/up's delta as more K on (they pin it off)
            gpu_tests 150
            (export LORASERVE_DELTA_IN_K=1; new_tests 60 -n 4 tests/gpu/test_norm_shrink.py tests/gpu/test_row_delta.py)
            ;;
        aug29)  # the LoRA delta as more K of the base GEMM (bench_decode_linear --augmented), the prefetch's tests, the defaults
            timeout 240 python3 benchmarks/gpu/bench_decode_linear.py --augmented 2>&1 | grep -v Warn | tee "$OUT/augmented.txt"
            new_tests 90 -n 4 tests/gpu/test_l2_prefetch.py tests/gpu/test_triton_attention.py tests/gpu/test_attention_shrink.py
            trace_per_setting 60 qwen2.5-0.5b ""
            ;;
        pf29)  # the attention's LoRA L2 prefetch: Qwen's critical path on and off (raw traces back), every GPU test, Llama-8B, e2e
            raw_traces_per_setting 60 qwen2.5-0.5b "" "LORASERVE_LORA_L2_PREFETCH=0" ""
            gpu_tests 150
            trace_per_setting 120 llama-3.1-8b "" "LORASERVE_LORA_L2_PREFETCH=0"
            e2e_per_setting 80 qwen2.5-0.5b "" "LORASERVE_LORA_L2_PREFETCH=0"
            ;;
        cp29)  # the critical path of a Qwen layer, kernel by kernel, base vs 8 adapters; the raw traces come back
            raw_traces_per_setting 60 qwen2.5-0.5b "" "LORASERVE_GATED_LORA=0" ""
            ;;
        bn27)  # conf27 without every GPU test and bench_e2e (the end of session 27's device time)
            g=LORASERVE_GATED_BLOCK_N=128
            (export $g LORASERVE_GATED_EARLY_DELTA=1; new_tests 60 -n 4 tests/gpu/test_gated_lora.py tests/gpu/test_norm_shrink.py)
            trace_per_setting 40 qwen2.5-0.5b "" "$g" "$g LORASERVE_GATED_EARLY_DELTA=1"
            ;;
        knobs27)
            wave="LORASERVE_DECODE_ONE_WAVE=1"
            (export LORASERVE_NORM_ROW_PER_WARP=128 $wave LORASERVE_GATED_EARLY_DELTA=1; new_tests 150 -n 4 tests/gpu/test_norm_shrink.py tests/gpu/test_row_delta.py tests/gpu/test_triton_elementwise.py tests/gpu/test_decode_linear.py tests/gpu/test_gated_lora.py)
            trace_per_setting 90 qwen2.5-0.5b "" "LORASERVE_NORM_ROW_PER_WARP=128" "$wave" "$wave LORASERVE_GATED_EARLY_DELTA=1" ${KNOBS27_MORE:+"$KNOBS27_MORE"}
            e2e_per_setting 100 qwen2.5-0.5b "" "LORASERVE_NORM_ROW_PER_WARP=128" "$wave" "$wave LORASERVE_GATED_EARLY_DELTA=1" ${KNOBS27_MORE:+"$KNOBS27_MORE"}
            ;;
        trace8b21)
            trace_per_setting 120 llama-3.1-8b "" "LORASERVE_ATTN_SHRINK=1"
            ;;
        steptrace)
            timeout 240 python3 benchmarks/gpu/step_trace.py --out "$OUT/step_traces" 2>&1 | grep -v Warn | tee "$OUT/step_trace.txt"
            ;;
        moe)
            timeout 120 python3 benchmarks/gpu/bench_moe.py --json "$OUT/moe.json" 2>&1 | tee "$OUT/bench_moe.txt"
            ;;
        e2e)
            timeout 470 python3 benchmarks/gpu/bench_e2e.py --bf16-loras --json "$OUT/e2e.json" 2>&1 | tee "$OUT/bench_e2e.txt"
            ;;
        *) echo "unknown stage $stage" ;;
    esac
    echo "stage $stage took $((SECONDS - start))s" | tee -a "$OUT/stages.txt"
done
