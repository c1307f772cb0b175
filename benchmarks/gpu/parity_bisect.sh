#!/usr/bin/env bash
# bf16 parity vs HF + PEFT (bench_e2e.py --parity-only: tiny Llama, 4 adapters + base, eager and graphs)
# under each switch, to find which path moves the numbers:
#   LORASERVE_DECODE_LINEAR=0      cuBLAS + separate LoRA expand instead of the decode GEMM (+ LoRA epilogue)
#   LORASERVE_FUSED_ELEMENTWISE=0  separate add / RMSNorm / rotary / KV-write launches
#   --no-async                     async scheduling off
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
for cfg in "1 1 " "0 1 " "1 1 --no-async" "1 0 " "1 0 --no-async"; do
    read -r dl fe extra <<<"$cfg"
    echo "== LORASERVE_DECODE_LINEAR=$dl LORASERVE_FUSED_ELEMENTWISE=$fe ${extra:-}"
    LORASERVE_DECODE_LINEAR=$dl LORASERVE_FUSED_ELEMENTWISE=$fe timeout 90 \
        python3 benchmarks/gpu/bench_e2e.py --parity-only ${extra:-} 2>&1 | grep "^parity\|Error"
done
