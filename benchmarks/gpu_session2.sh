#!/usr/bin/env bash
# Second device call: fusion + Triton GPU tests, decode paths, and the fusion benchmark.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FIVAR_TEST_FRESH_JIT_CACHE=0 FIVAR_TRITON_AUTOTUNE=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
(time python3 benchmarks/prewarm_gpu.py --second) 2>&1 | grep -v "^\[\|INFO" | tail -4 | tee "$OUT/prewarm2.log"
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu_fusions.py tests/test_gpu_triton.py \
  "tests/test_gpu_kernels.py::test_decode" "tests/test_gpu_kernels.py::test_decode_cuda_core_path" \
  "tests/test_gpu_kernels.py::test_planned_decode_matches_reference" -p no:cacheprovider 2>&1 \
  | tee "$OUT/gpu_tests2.log" | tail -12
timeout 150 python3 benchmarks/bench_fusions.py --json "$OUT/bench_fusions.json" 2>&1 | grep -v INFO \
  | tee "$OUT/bench_fusions.log" | tail -25
