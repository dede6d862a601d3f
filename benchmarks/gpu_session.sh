#!/usr/bin/env bash
# One device call: prewarm every module the GPU tests and benchmarks need (one parallel ninja), run the
# GPU tests, then the benchmarks. Logs and JSON go to $OUT (or ./gpu-out). From the repo root:
#   bash benchmarks/gpu_session.sh [tests|bench|all] [bench args...]
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FIVAR_TEST_FRESH_JIT_CACHE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 benchmarks/prewarm_gpu.py 2>&1 | grep -v "^\[\|INFO" | tail -5 | tee "$OUT/prewarm.log"
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == all || $what == bench ]]; then
  python3 benchmarks/bench_fa3.py --json "$OUT/bench_fa3.json" "$@" 2>&1 | grep -v "INFO\|warn" | tee "$OUT/bench_fa3.log" | tail -30
fi
