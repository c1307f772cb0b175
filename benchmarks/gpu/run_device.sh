#!/usr/bin/env bash
# One device call: GPU tests and benchmarks, logs under $OUT (or /tmp/gpu_out). Stages pick what runs, in order:
#   bash benchmarks/gpu/run_device.sh tests          # every GPU test (tests/gpu), pytest-xdist over 8 workers
#   bash benchmarks/gpu/run_device.sh trace          # step_trace.py: one decode step's kernel timeline, base vs 8
#                                                    # adapters, Qwen2.5-0.5B and Llama-3.1-8B shapes, the defaults
#   bash benchmarks/gpu/run_device.sh e2e            # bench_e2e.py: both shapes, base vs 8 adapters vs HF + PEFT
#   bash benchmarks/gpu/run_device.sh scale          # benchmarks/bench_scale.py --preset gpu-core: the adapter-scale matrix
#   bash benchmarks/gpu/run_device.sh kernels        # bench_lora_kernels.py and bench_decode_linear.py (the kernels alone)
#   bash benchmarks/gpu/run_device.sh tests trace    # several stages in one call
# With no stage: tests, trace, e2e. $TESTS: the test paths (default tests/gpu); $SHAPES: the shapes of trace and e2e.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
SHAPES="${SHAPES:-qwen2.5-0.5b,llama-3.1-8b}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"

stage_tests() {
    local workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n 8)  # pytest-xdist where installed, else one process
    # shellcheck disable=SC2086
    timeout 480 python3 -m pytest -o addopts= -q -p no:cacheprovider "${workers[@]}" ${TESTS:-tests/gpu} 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
}

stage_trace() {
    local shape
    for shape in ${SHAPES//,/ }; do
        timeout 240 python3 benchmarks/gpu/step_trace.py --shapes "$shape" --out "$OUT/traces_$shape" 2>&1 | grep -v Warn | tee "$OUT/step_trace_$shape.txt" | grep "graph replay"
    done
}

stage_e2e() {
    timeout 540 python3 benchmarks/gpu/bench_e2e.py --shapes "$SHAPES" --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.txt" | grep "^| \|replay\|parity max\|greedy ids\|tok/s"
}

stage_scale() {
    timeout 580 python3 benchmarks/bench_scale.py --preset gpu-core --json "$OUT/scale.json" 2>&1 | tee "$OUT/scale.txt" | tail -40
}

stage_kernels() {
    timeout 300 python3 benchmarks/gpu/bench_lora_kernels.py --json "$OUT/lora_kernels.json" 2>&1 | tee "$OUT/lora_kernels.txt" | tail -30
    timeout 240 python3 benchmarks/gpu/bench_decode_linear.py 2>&1 | tee "$OUT/decode_linear.txt" | tail -30
}

stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(tests trace e2e)
for stage in "${stages[@]}"; do
    case "$stage" in
        tests | trace | e2e | scale | kernels) echo "### $stage" | tee -a "$OUT/stages.txt"; "stage_$stage" ;;
        *) echo "unknown stage '$stage': give tests, trace, e2e, scale or kernels" >&2; exit 2 ;;
    esac
done
