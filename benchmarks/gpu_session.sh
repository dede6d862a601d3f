#!/usr/bin/env bash
# Device calls, one step each, chained while the machine stays warm (the JIT cache lives in ./.gpu-jit,
# git-ignored, so a later call on the same machine reuses it). From the repo root:
#   bash benchmarks/gpu_session.sh build|tests|clibench|tile192|clocks|sustained|choice|table|verify|tile192tests|triton-tests|attention|triton|kvranges|window|windowbench|kvprofile|fusiontests|membound|compile|nvsplit|fa2-tests|pinned|pinned-tests|standin|passes|passes-again|prewarm-jobs|build-all|tests-all|pipes|exp2|tiles|batch|bounded|extremes|mainjob|hdims|additions|wave|wavebench|persistent|persistentbench|windowtiles
# build + tests: the benchmark modules and a quick GPU test subset; build-all + tests-all: every module and
# every GPU test (about 5 min of 16-core compile first).
# Logs and JSON go to $OUT.
set -uo pipefail
export OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} FIVAR_TEST_FRESH_JIT_CACHE=0
export FLASHINFER_WORKSPACE_BASE=$PWD/.gpu-jit FIVAR_CACHE_DIR=$PWD/.gpu-jit/fivar
step=${1:-build}
quiet() { grep -v "^\[\|INFO\|UserWarning\|warnings.warn"; }
case $step in
build)
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log" ;;
build-all)  # about 10 min on 16 cores, past one call's limit: cut at 560 s, so call it again on the warm machine
  # (what was built stays in .gpu-jit) until it says done
  (time timeout 560 python3 benchmarks/prewarm_gpu.py --all; echo "build-all rc=$? (124: cut; call build-all again)") \
    2>&1 | quiet | tail -5 | tee -a "$OUT/prewarm.log" ;;
tests-all)
  export FIVAR_TRITON_AUTOTUNE=0
  # about 7 min after build-all (session 9: 433 s); cut at 570 s so a slow run still returns its log
  timeout 570 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tee "$OUT/gpu_tests.log" | tail -12 ;;
triton-tests)  # every Triton GPU test (ragged and decode too), against FA2 modules built first
  (time python3 benchmarks/prewarm_gpu.py --triton) 2>&1 | quiet | tail -4
  export FIVAR_TRITON_AUTOTUNE=0
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_triton.py 2>&1 \
    | tee "$OUT/gpu_tests_triton.log" | tail -6 ;;
tests)
  export FIVAR_TRITON_AUTOTUNE=0
  timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
    "tests/test_gpu_kernels.py::test_window_tile_skipping" "tests/test_gpu_kernels.py::test_window_tile_skipping_batch" \
    tests/test_gpu_triton.py -k "not decode and not ragged" 2>&1 | tee "$OUT/gpu_tests.log" | tail -8 ;;
kvranges)  # FA3's KV-range form (masks that are more than a band): its modules, its GPU tests, then the
  # document mask vs Flex (one-shot and planned), non-causal and causal
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --kv-ranges) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  export FIVAR_TRITON_AUTOTUNE=0
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    -k "kv_ranges or (document_mask and fa3) or (interior_tiles and fa3)" 2>&1 | tee "$OUT/gpu_tests_kv_ranges.log" | tail -8
  unset FIVAR_TRITON_AUTOTUNE
  timeout 300 python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens 8192 --flex-causal 0,1 \
    --variants ${VARIANTS:-document_mask} --triton-seqlens 8192 --json "$OUT/bench_kv_ranges.json" 2>&1 | quiet \
    | tee "$OUT/bench_kv_ranges.log" | grep -v "^CheckResult\|passed" | tail -12
  timeout 200 python3 benchmarks/profile_kv_ranges.py --json "$OUT/profile_kv_ranges.json" 2>&1 | quiet \
    | grep -A7 '"wall_us\|"checks\|row_runs' ;;
window)  # masks that are exactly a window run as FA3's own sliding window: its modules and GPU tests, and the
  # planned-ragged tests; then `windowbench`: the window variants vs stock FA3 and Flex, non-causal and causal
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --window --stock) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  export FIVAR_TRITON_AUTOTUNE=0
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    -k "(window_tile_skipping and not triton) or planned_ragged_without" 2>&1 | tee "$OUT/gpu_tests_window.log" | tail -8
  ;;
windowbench)  # after `window` on a warm machine
  timeout 560 python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens 8192 --flex-causal 0,1 \
    --variants ${VARIANTS:-softcap,sliding_window,softcap_sliding_window} --triton-seqlens 0 \
    --json "$OUT/bench_window.json" 2>&1 | quiet | tee "$OUT/bench_window.log" | grep -v "^CheckResult\|passed" | tail -12 ;;
kvprofile)  # FA3's KV-range form, kernel by kernel, next to stock FA3 (after kvranges on a warm machine)
  [ -d .gpu-jit ] || (python3 benchmarks/prewarm_gpu.py --kv-ranges 2>&1 | quiet | tail -2)
  timeout 300 python3 benchmarks/profile_kv_ranges.py --json "$OUT/profile_kv_ranges.json" 2>&1 | quiet | tail -60 ;;
exp2)  # FA3's exp2 split between the MUFU and FMA pipes (fivar_fa3_softmax.cuh), one call: its modules and stock
  # FA3's, its GPU tests, then every split vs stock FA3 and Flex, soft-capped variants, non-causal and causal
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --exp2 --stock) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py -k "(exp2 and 8]) or (window_tile_skipping and softcap and fa3)" \
    2>&1 | tee "$OUT/gpu_tests_exp2.log" | tail -6
  timeout ${BENCH_S:-330} python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens 8192 --flex-causal 0,1 \
    --variants ${VARIANTS:-softcap,softcap_sliding_window} --triton-seqlens 0 --exp2-splits ${SPLITS:-2,4,6} \
    --json "$OUT/bench_exp2.json" 2>&1 | quiet | tee "$OUT/bench_exp2.log" | grep -v "^CheckResult\|passed" | tail -12 ;;
tiles)  # FA3 single prefill of the soft-capped variants at other exp2 splits and CTA tiles (bench_fa3.py
  # --exp2-splits/--cta-tiles: all built first) vs fivar's default, stock FA3 and Flex, at SEQLENS (default
  # 8192), non-causal and causal (CAUSALS); SPLITS= / TILES= (empty) for none, EXTRA=--running-max or --planned adds
  # one. #3's open rows: SEQLENS=16384 CAUSALS=0 VARIANTS=softcap SPLITS= TILES="128x176,128x128 128x192,128x128";
  # session 10's planned-kernel row: CAUSALS=1 VARIANTS=softcap_sliding_window SPLITS= TILES= EXTRA=--planned
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout ${BENCH_S:-540} python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens ${SEQLENS:-8192} \
    --flex-causal ${CAUSALS:-0,1} --variants ${VARIANTS:-softcap,softcap_sliding_window} --triton-seqlens 0 \
    --exp2-splits "${SPLITS-0,1,3}" \
    --cta-tiles ${TILES-128x176,192x128 128x160,128x176 128x128,128x96 192x128,128x64} ${EXTRA:-} \
    --json "$OUT/bench_tiles.json" 2>&1 | quiet | tee "$OUT/bench_tiles.log" | grep -v "^CheckResult\|passed" | tail -12 ;;
tile192)  # cold machine, one call: #3's lead (README Known gaps, session 21): FA3 soft-cap single prefill with a 192-row
  # non-causal tile (three consumer warpgroups) vs fivar's default 128x128, stock FA3 and Flex at S=4096/8192/16384,
  # 6 rounds; CAUSALS=1 TILES="128x128,192x64" for the full causal kernel. Then `tile192tests` on the warm machine.
  SEQLENS=${SEQLENS:-4096,8192,16384} CAUSALS=${CAUSALS:-0} VARIANTS=${VARIANTS:-softcap} SPLITS= \
    TILES=${TILES-192x64,128x128 192x48,128x128 192x80,128x128} EXTRA=${EXTRA:---rounds 6} BENCH_S=${BENCH_S:-560} \
    bash "$0" tiles ;;
clocks)  # cold machine, one call: tile192 (default rounds 8, causal too) with every timing sample's SM clock, board
  # power and clock-event reasons (bench_fa3.py --clock-trace): faster kernel, or the same kernel at a higher clock?
  nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm,clocks.sm --format=csv | tee "$OUT/power.txt"
  CAUSALS=${CAUSALS:-0,1} EXTRA="--rounds ${ROUNDS:-8} --clock-trace" bash "$0" tile192 ;;
sustained)  # cold machine, one call: like `clocks`, but each contender alone for ${SECONDS_ON:-3} s after 1 s untimed
  # (bench_fa3.py --sustained): the rate each keeps at the board's power limit, with its clock
  nvidia-smi --query-gpu=name,power.limit,power.max_limit,clocks.max.sm,clocks.sm --format=csv | tee "$OUT/power.txt"
  SEQLENS=${SEQLENS:-8192,16384} CAUSALS=${CAUSALS:-0,1} VARIANTS=${VARIANTS:-softcap,softcap_sliding_window} \
    EXTRA="--sustained ${SECONDS_ON:-3} --clock-trace" bash "$0" tile192
  python3 benchmarks/clock_report.py "$OUT/bench_tiles.json" | tee "$OUT/clock_report.txt" ;;
choice)  # cold machine, one call: the soft-caps' non-causal default (192x64 from fa3.LONG_QO_LEN rows, 128x128 below)
  # vs the previous default (128x128), stock FA3 and Flex at S=4096/8192/16384, interleaved; then its GPU tests.
  # Session 22 gave the bench 265 s and lost it: the build alone took 171 s cold on an H100
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout ${BENCH_S:-450} python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens ${SEQLENS:-4096,8192,16384} \
    --flex-causal 0 --variants ${VARIANTS:-softcap,softcap_sliding_window} --triton-seqlens 0 \
    --cta-tiles 128x128,128x128 --rounds ${ROUNDS:-4} --json "$OUT/bench_choice.json" 2>&1 | quiet \
    | tee "$OUT/bench_choice.log" | grep -v "^CheckResult\|passed" | tail -7
  timeout ${TESTS_S:-90} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    -k "non_causal_choice or wave_split_planned" 2>&1 | tee "$OUT/gpu_tests_choice.log" | tail -4 ;;
table)  # cold machine, one call: the issue's soft-cap rows on the final code, both modes, and decode, in one run
  # (each row's ratios from its own interleaved rounds), with the clock trace; the other variants: VARIANTS=...
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout ${BENCH_S:-560} python3 benchmarks/bench_fa3.py --parts flex,decode --flex-seqlens ${SEQLENS:-4096,8192,16384} \
    --flex-causal 0,1 --variants ${VARIANTS:-softcap,softcap_sliding_window} --triton-seqlens 0 --rounds ${ROUNDS:-4} \
    --clock-trace --json "$OUT/bench_table.json" 2>&1 | quiet | tee "$OUT/bench_table.log" \
    | grep -v "^CheckResult\|passed\|clocks:" | tail -14 ;;
verify)  # what session 22 could not run on a GPU: the non-causal choice on the persistent schedule (GPU test),
  # `fivar bench --sustained` as a user types it, the clock trace by device UUID, bench_fusions.py after its refactor
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --verify --stock) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py -k "persistent_schedule and softcap and (6200 or 777)" \
    2>&1 | tee "$OUT/gpu_tests_verify.log" | tail -4
  timeout 150 python3 -m fivar bench softcap --vs stock --vs flex --seqlens ${SEQLENS:-8192} --sustained 2 \
    --json "$OUT/clibench_sustained.json" 2>&1 | quiet | tee "$OUT/clibench_sustained.log" | tail -8
  timeout 100 python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens 8192 --flex-causal 0 --variants softcap \
    --triton-seqlens 0 --rounds 2 --clock-trace --json "$OUT/bench_clock.json" 2>&1 | quiet > "$OUT/bench_clock.log"
  python3 -c "import json, sys; print('clock trace:', json.load(open(sys.argv[1]))['clock_trace'])" "$OUT/bench_clock.json"
  python3 benchmarks/clock_report.py "$OUT/bench_clock.json" 2>&1 | tee "$OUT/clock_report.txt" | tail -6
  timeout 150 python3 benchmarks/bench_fusions.py --quick --json "$OUT/bench_fusions.json" 2>&1 | quiet \
    | tee "$OUT/bench_fusions.log" | tail -8 ;;
tile192tests)  # after tile192: the GPU tests of the 192-row non-causal tile (partial tiles, GQA, forced wave splits)
  export FIVAR_TRITON_AUTOTUNE=0
  timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    -k "${TESTS_K:-cta_tile_override or wave_split}" 2>&1 | tee "$OUT/gpu_tests_tile192.log" | tail -8 ;;
bounded)  # FA3's bounded softmax (fivar's default for bounded transforms): its modules, their running-max twins and
  # stock FA3's, its GPU tests, then the soft-capped variants with it vs the running max, stock FA3 and Flex, at
  # SEQLENS, both modes
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --bounded --stock) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py -k "bounded_softmax" \
    2>&1 | tee "$OUT/gpu_tests_bounded.log" | tail -6
  timeout ${BENCH_S:-330} python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens ${SEQLENS:-8192} \
    --flex-causal ${CAUSALS:-0,1} --variants ${VARIANTS:-softcap,softcap_sliding_window} --triton-seqlens 0 \
    --running-max --json "$OUT/bench_bounded.json" 2>&1 | quiet | tee "$OUT/bench_bounded.log" \
    | grep -v "^CheckResult\|passed" | tail -12 ;;
wave)  # FA3 single prefill's last wave split along the keys (fivar/runtime/wave_split.py): soft-cap's modules and
  # stock FA3's, the split's GPU tests, and whether the last wave idles (wave_quantization.py: 31/32/33 heads);
  # then `wavebench`
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --wave --stock) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py -k "wave_split" \
    2>&1 | tee "$OUT/gpu_tests_wave.log" | tail -6
  timeout ${BENCH_S:-200} python3 benchmarks/wave_quantization.py --json "$OUT/wave_quantization.json" 2>&1 | quiet \
    | tee "$OUT/wave_quantization.log" | tail -14 ;;
wavebench)  # after `wave` on a warm machine: fivar's soft-cap (VARIANTS) on FA3 with the planned split, without it
  # (wave_0) and forced (WAVES), vs stock FA3 and Flex, at SEQLENS, non-causal (CAUSALS=0,1: both)
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout ${BENCH_S:-540} python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens ${SEQLENS:-8192,16384} \
    --flex-causal ${CAUSALS:-0} --variants ${VARIANTS:-softcap} --triton-seqlens 0 --wave-splits ${WAVES:-0,1x4,2x8,4x4} --rounds ${ROUNDS:-8} \
    --json "$OUT/bench_wave.json" 2>&1 | quiet | tee "$OUT/bench_wave.log" | grep -v "^CheckResult\|passed" | tail -8 ;;
persistent)  # FA3 single prefill on the persistent schedule (csrc/fivar_fa3_persistent.cuh; fivar's default for the
  # causal kernel of window variants): its modules and stock FA3's, its GPU tests and the window tests; then
  # `persistentbench`
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --persistent --stock) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    -k "persistent_schedule or persistent_empty_query or wave_rule or (window_tile_skipping and fa3 and not batch)" 2>&1 | tee "$OUT/gpu_tests_persistent.log" | tail -6 ;;
persistentbench)  # after `persistent` on a warm machine: the window variants (VARIANTS) on fivar's default schedule
  # and on SCHEDULES (default: grid, FlashInfer's) vs stock FA3 and Flex, at SEQLENS, causal (CAUSALS=0,1: both)
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout ${BENCH_S:-540} python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens ${SEQLENS:-4096,8192,16384} \
    --flex-causal ${CAUSALS:-1} --variants ${VARIANTS:-softcap_sliding_window,sliding_window} --triton-seqlens 0 \
    --schedules ${SCHEDULES:-grid} --rounds ${ROUNDS:-8} --json "$OUT/bench_persistent.json" 2>&1 | quiet \
    | tee "$OUT/bench_persistent.log" | grep -v "^CheckResult\|passed" | tail -12 ;;
windowtiles)  # cold machine, one call: the soft-capped window's causal kernel on fivar's default (192x64, persistent)
  # vs 128x128 and a choice of both picked per launch by the wave rule, stock FA3 and Flex at S=4096/8192/16384 (each
  # contender checked against the reference first); then the GPU test that runs a shape for each tile of a choice.
  # Session 19 ran it with the default then the choice (its columns: fivar_fa3 = the choice, 128x128_192x64 = 192x64)
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout ${BENCH_S:-420} python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens ${SEQLENS:-4096,8192,16384} \
    --flex-causal 1 --variants softcap_sliding_window --triton-seqlens 0 --cta-tiles 128x128 '128x128,192x64|128x128' \
    --rounds ${ROUNDS:-5} --json "$OUT/bench_window_tiles.json" 2>&1 | quiet | tee "$OUT/bench_window_tiles.log" \
    | grep -v "^CheckResult\|passed" | tail -5
  timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py -k "wave_rule" 2>&1 \
    | tee "$OUT/gpu_tests_window_tiles.log" | tail -3 ;;
pipes)  # Nsight Compute on FA3 soft-cap (fivar's default, its exp2 split off, stock with and without the cap): pipe
  # utilisation and warp stalls per kernel (#3's "why"), S=${SEQLEN:-8192}, non-causal unless CAUSAL=1; WINDOW=1024
  # for the soft-capped window; CONTENDERS=a,b to profile fewer. Cold, one configuration builds for ~150 s and
  # each ncu run takes ~15 s: keep the default BENCH_S (session 15 cut two configurations at 290 + 230 s)
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout ${BENCH_S:-540} python3 benchmarks/profile_fa3_pipes.py --seqlen ${SEQLEN:-8192} ${CAUSAL:+--causal} \
    --window ${WINDOW:-0} ${CONTENDERS:+--contenders $CONTENDERS} --out "$OUT" 2>&1 | quiet \
    | tee -a "$OUT/profile_fa3_pipes.log" | grep -v "^CheckResult\|passed" | tail -8 ;;
mainjob)  # the README's main job, as a new user types it, in a scratch project: new-variant, build (what auto runs,
  # in parallel), check every entry point, the scaffolded tests, then a bundled variant and the cache's view of it all
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  repo=$PWD; proj=$(mktemp -d); cd "$proj"
  { python3 -m fivar new-variant softcap_alibi && python3 -m fivar show softcap_alibi --explain \
    && (time python3 -m fivar build softcap_alibi softcap --prewarm) \
    && timeout 200 python3 -m fivar check softcap_alibi && timeout 150 python3 -m fivar check softcap \
    && timeout 150 python3 -m pytest -q -p no:cacheprovider tests/variants \
    && python3 -m fivar cache ls && python3 -m fivar cache stats; echo "mainjob rc=$?"; } 2>&1 | quiet \
    | tee "$OUT/mainjob.log" | grep -v "^│ \|^┃\|━\|─" | tail -40
  cd "$repo" ;;
clibench)  # `fivar bench` as a user types it: the soft-capped window, causal, vs stock FA3 and Flex, at the issue's
  # lengths and window (1024; the variant's example is 128), with its JSON and plot
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout ${LIMIT:-560} python3 -m fivar bench ${VARIANT:-softcap_sliding_window} --vs stock --vs flex --causal \
    ${PARAMS:---param window=1024} --seqlens 4096,8192,16384 --rounds 5 --json "$OUT/clibench.json" \
    --plot "$OUT/clibench.png" 2>&1 | quiet \
    | tee "$OUT/clibench.log" | tail -20 ;;
hdims)  # the bounded softmax (fivar's FA3 default) vs the running max at head dims 64 and 256 (chosen at 128), soft-cap,
  # S=8192, vs stock FA3 and Flex, non-causal and causal; every module built first, in one parallel ninja
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --hdims --stock) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm_hdims.log"
  for hd in ${HDIMS:-256 64}; do
    timeout ${BENCH_S:-160} python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens 8192 --flex-causal 0,1 \
      --variants softcap --triton-seqlens 0 --running-max --head-dim $hd --json "$OUT/bench_hd$hd.json" 2>&1 | quiet \
      | tee "$OUT/bench_hd$hd.log" | grep -v "^CheckResult\|passed" | tail -3
  done ;;
extremes)  # the exp2-split extremes on both FA3 softmax forms (bounded, running max): modules, then their GPU tests
  (time python3 benchmarks/prewarm_gpu.py --exp2-extremes) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm_extremes.log"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py -k "exp2_split_extremes" \
    2>&1 | tee "$OUT/gpu_tests_extremes.log" | tail -6 ;;
batch)  # batch prefill, ragged and planned (`fivar bench --op batch-prefill`): soft-cap vs stock
  # BatchPrefillWithRaggedKVCacheWrapper (FA3 on Hopper; exp2 split and FlashInfer's tiles), non-causal then causal
  for c in "" --causal; do
    timeout 270 python3 -m fivar bench ${VARIANTS:-softcap} --op batch-prefill --batch ${BATCH:-8} \
      --seqlens ${SEQLENS:-2048,4096} --vs stock $c --json "$OUT/bench_batch${c:+_causal}.json" 2>&1 | quiet | tail -12
  done ;;
additions)  # session 11's GPU tests (bundled variants' FA2/FA3 sources did not change): the signed logits factors on
  # FA2, FA3 and Triton, the twin's per-program values, and every alibi twin test (its casts are now tl.cast)
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  (time python3 benchmarks/prewarm_gpu.py --test-variants) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm_additions.log"
  export FIVAR_TRITON_AUTOTUNE=0
  { timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py -k signed_logits_factors
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_triton.py -k "alibi or per_program"
  } 2>&1 | tee "$OUT/gpu_tests_additions.log" | grep "passed\|failed\|Error" | tail -12 ;;
fusiontests)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_fusions.py 2>&1 \
    | tee "$OUT/gpu_tests_fusions.log" | tail -4 ;;
attention)
  timeout 560 python3 benchmarks/bench_fa3.py --parts softcap,flex --softcap-seqlens 16384 --flex-seqlens 8192 \
    --flex-causal 0,1 --triton-seqlens 8192 --json "$OUT/bench_fa3.json" 2>&1 | quiet | tee "$OUT/bench_fa3.log" \
    | grep -v "^CheckResult\|passed" | tail -40 ;;
triton)  # the Triton twin vs Flex (and FA3), non-causal or causal (CAUSAL=1): each about 5 min
  timeout 570 python3 benchmarks/bench_fa3.py --parts flex --flex-seqlens 8192 --flex-causal ${CAUSAL:-0} ${VARIANTS:+--variants $VARIANTS} \
    --triton-seqlens 8192 --json "$OUT/bench_triton_flex_c${CAUSAL:-0}.json" 2>&1 | quiet \
    | tee "$OUT/bench_triton_flex_c${CAUSAL:-0}.log" | grep -v "^CheckResult\|passed" | tail -12 ;;
membound)
  timeout 250 python3 benchmarks/bench_fusions.py --json "$OUT/bench_fusions.json" 2>&1 | quiet \
    | tee "$OUT/bench_fusions.log" | tail -22
  timeout 250 python3 benchmarks/bench_triton_ops.py --json "$OUT/bench_triton_ops.json" 2>&1 | quiet \
    | tee "$OUT/bench_triton_ops.log" | tail -16 ;;
pinned)  # KV tiles pinned at compile time and <cuda/pipeline> left out (session 13), call 1 of 2: one module's cold
  # compile pinned and not, whole and per CTA tile, against FlashInfer's gen_customize (2 alternating rounds), prewarms
  # of 8 pinned and not; then the FA2 modules of every bundled variant (for `pinned-tests`)
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout 330 python3 benchmarks/bench_compile.py --repeat 2 --hits 20000 \
    --fivar-configs default,session12,cta-tiles,unpinned,keep-headers --prewarm-configs default,session12 \
    --json "$OUT/bench_compile_pinned.json" 2>&1 | quiet | tee "$OUT/bench_compile_pinned.log" | tail -24
  (time timeout 200 python3 benchmarks/prewarm_gpu.py --triton) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log" ;;
standin)  # <cooperative_groups.h> left out of FA2 prefill units (session 14), call 1 of 2: one module's cold compile
  # by default and as in session 13, against FlashInfer's gen_customize (2 alternating rounds), prewarms of 8 each way;
  # nvcc's phases per unit both ways; then the FA2 modules of every bundled variant (for `pinned-tests`)
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout 300 python3 benchmarks/bench_compile.py --repeat 2 --hits 20000 \
    --fivar-configs default,session13,keep-headers --prewarm-configs default,session13 \
    --json "$OUT/bench_compile_standin.json" 2>&1 | quiet | tee "$OUT/bench_compile_standin.log" | tail -24
  timeout 120 python3 benchmarks/nvcc_phases.py softcap --configs default,session13 --rounds 2 \
    --json "$OUT/nvcc_phases_standin.json" 2>&1 | quiet | tee "$OUT/nvcc_phases_standin.log" | tail -6
  (time timeout 150 python3 benchmarks/prewarm_gpu.py --triton) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log" ;;
passes)  # nvcc's host and device passes side by side (session 14), one call: one module's cold compile by default,
  # with the passes in turn, and as in session 13, against FlashInfer's gen_customize as shipped and with
  # FLASHINFER_NVCC_THREADS=2 (3 alternating rounds); prewarms of 8; nvcc's phases per unit, FA2 and an FA3 kernel unit
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout 330 python3 benchmarks/bench_compile.py --repeat 3 --hits 20000 --flashinfer-nvcc-threads 2 \
    --fivar-configs default,serial-passes,session13 --prewarm-configs default,session13 \
    --json "$OUT/bench_compile_passes.json" 2>&1 | quiet | tee "$OUT/bench_compile_passes.log" | tail -26
  timeout 100 python3 benchmarks/nvcc_phases.py softcap --configs default,serial-passes --rounds 2 \
    --json "$OUT/nvcc_phases_passes_fa2.json" 2>&1 | quiet | tee "$OUT/nvcc_phases_passes_fa2.log" | tail -6
  timeout 140 python3 benchmarks/nvcc_phases.py softcap --target fa3 --configs default,serial-passes --rounds 1 \
    --units single_prefill_sm90_kernel_mask_0.cu,single_prefill_sm90_jit_binding.cu \
    --json "$OUT/nvcc_phases_passes_fa3.json" 2>&1 | quiet | tee "$OUT/nvcc_phases_passes_fa3.log" | tail -4 ;;
passes-again)  # `passes` on another machine (hosts differ by more than the changes do): the cold compiles again,
  # no prewarm, then nvcc's phases for an FA3 kernel unit with its passes side by side and in turn
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout 300 python3 benchmarks/bench_compile.py --repeat 3 --hits 20000 --flashinfer-nvcc-threads 2 \
    --fivar-configs default,serial-passes,session13 --prewarm-count 0 \
    --json "$OUT/bench_compile_passes_again.json" 2>&1 | quiet | tee "$OUT/bench_compile_passes_again.log" | tail -22
  timeout 240 python3 benchmarks/nvcc_phases.py softcap --target fa3 --configs default,serial-passes --rounds 1 \
    --units single_prefill_sm90_kernel_mask_0.cu \
    --json "$OUT/nvcc_phases_passes_fa3.json" 2>&1 | quiet | tee "$OUT/nvcc_phases_passes_fa3.log" | tail -4 ;;
prewarm-jobs)  # prewarm of 8 modules at ninja -j 16, 24 and 32 on 16 cores (session 14): does running more units than
  # cores at once fill the cores that the units' serial phases leave idle?
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  for j in 16 24 32 16 24 32; do
    timeout 100 python3 benchmarks/bench_compile.py --skip-flashinfer --hits 1000 --jobs $j \
      --json "$OUT/bench_prewarm_jobs$j.json" 2>&1 | quiet | grep "prewarm 8\|ideal" | sed "s/^/-j $j /"
    cp "$OUT/bench_prewarm_jobs$j.json" "$OUT/bench_prewarm_jobs${j}_$(date +%s).json"
  done ;;
pinned-tests)  # call 2 of 2, on the warm machine: the FA2 and decode GPU tests on pinned modules, the refusal of a
  # module pinned for another GPU, and FA2 soft-cap speed against stock FA2
  FIVAR_TRITON_AUTOTUNE=0 timeout 430 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    -k "(fa2 or decode or pinned) and not fa3" 2>&1 | tee "$OUT/gpu_tests_fa2.log" | tail -4
  timeout 120 python3 benchmarks/bench_softcap_fa2.py --seqlens 512,8192 \
    --json "$OUT/bench_softcap_fa2_pinned.json" 2>&1 | quiet | tee "$OUT/bench_softcap_fa2_pinned.log" | tail -11 ;;
nvsplit)  # nvcc --split-compile on FA2 units (session 12), in one call: (1) one module's cold compile with and
  # without it, and with the CTA-tile split, against FlashInfer's gen_customize (2 alternating rounds), prewarms
  # of 8 with and without; (2) the FA2 modules of every bundled variant, then the FA2 and decode GPU tests;
  # (3) FA2 speed with and without it, small tiles included
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
  timeout 200 python3 benchmarks/bench_compile.py --repeat 2 --hits 20000 \
    --fivar-configs default,no-nvcc-split,cta-tiles --prewarm-configs default,no-nvcc-split \
    --json "$OUT/bench_compile_nvsplit.json" 2>&1 | quiet | tee "$OUT/bench_compile_nvsplit.log" | tail -22
  (time timeout 130 python3 benchmarks/prewarm_gpu.py --triton) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  FIVAR_TRITON_AUTOTUNE=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    -k "(fa2 or decode) and not fa3" 2>&1 | tee "$OUT/gpu_tests_fa2.log" | tail -4
  timeout 120 python3 benchmarks/bench_softcap_fa2.py --nvcc-split-ab --seqlens 16,64,512,8192 \
    --json "$OUT/bench_softcap_fa2_nvsplit.json" 2>&1 | quiet | tee "$OUT/bench_softcap_fa2_nvsplit.log" | tail -11 ;;
fa2-tests)  # after nvsplit (session 12): every FA2 and decode GPU test, then the Triton GPU tests (against FA2)
  (time timeout 130 python3 benchmarks/prewarm_gpu.py --triton) 2>&1 | quiet | tail -4 | tee "$OUT/prewarm.log"
  export FIVAR_TRITON_AUTOTUNE=0
  timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py \
    -k "(fa2 or decode) and not fa3" 2>&1 | tee "$OUT/gpu_tests_fa2.log" | tail -4
  timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_triton.py 2>&1 \
    | tee "$OUT/gpu_tests_triton.log" | tail -4 ;;
compile)
  timeout 500 python3 benchmarks/bench_compile.py --json "$OUT/bench_compile.json" 2>&1 | quiet \
    | tee "$OUT/bench_compile.log" | tail -25 ;;
esac
