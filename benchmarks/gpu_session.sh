#!/usr/bin/env bash
# One device call: prewarm every module the GPU tests and benchmarks need (one parallel ninja), run the
# GPU tests, then the benchmarks. Logs and JSON go to $OUT (or ./gpu-out). Usage, from the repo root:
#   bash benchmarks/gpu_session.sh [tests|bench|all]
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
what=${1:-all}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FIVAR_TEST_FRESH_JIT_CACHE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
python3 -m fivar build --prewarm --all --ops single_prefill,batch_prefill,batch_decode 2>&1 | tail -5 | tee "$OUT/prewarm.log"
python3 -m fivar build --prewarm softcap alibi document_mask --ops single_prefill --dtypes fp16 --head-dims 64,128 2>&1 | tail -3
python3 -m fivar build --prewarm softcap alibi document_mask --ops single_prefill --dtypes bf16 --head-dims 256 2>&1 | tail -3
echo "prewarm took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/prewarm.log"
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == all || $what == bench ]]; then
  python3 benchmarks/bench_softcap_fa2.py --json "$OUT/bench_softcap_fa2.json" 2>&1 | tee "$OUT/bench_softcap_fa2.log" | tail -12
fi
