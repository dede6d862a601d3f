"""Build and cache costs, in one run, into a fresh FlashInfer workspace and a fresh fivar cache.

Measures:
  1. cold compile of one variant module through fivar (`FivarModule.build()`), wall and CPU seconds;
  2. the same variant declaration through FlashInfer's own path,
     `flashinfer.jit.attention.modules.gen_customize_single_prefill_module(...).build()` (distinct URI),
     which instantiates every mask mode where fivar instantiates only the ones the variant can use.
     Like for like: same variant, dtype and head dim, same nvcc flags and ninja job count, both timed from
     sources already generated to the library on disk (no dlopen in either), one after the other in this
     process. With --repeat N the two alternate N times (build outputs deleted in between, so every run is
     cold) and the medians are reported: on a shared machine one run of each can land on different load;
  3. in-process hit latency (`module.load()` once loaded: the per-attention-call path), in microseconds;
  4. fresh-process disk hit: a new Python imports fivar and calls `module.load()` (ms, import excluded and
     included);
  5. prewarm of N (default 8) uncached variant modules in one parallel ninja (`build_many`), against the ideal
     `CPU seconds of that build / cores` (perfect parallelism) and, with --singles, `sum(single cold) / cores`
     (each compiled alone into another fresh workspace).

  python benchmarks/bench_compile.py --json benchmarks/results/bench_compile_h200.json      # GPU host
  FLASHINFER_CUDA_ARCH_LIST=9.0a python benchmarks/bench_compile.py --no-load --prewarm-count 0 \
      --variant softcap --dtype fp16 --head-dim 64                                         # CPU sanity check

--no-load compiles only (no GPU needed): hits are then `build()` disk checks instead of loads.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLED = ["alibi", "document_mask", "relative_bias", "sigmoid", "sliding_window", "softcap",
           "softcap_sliding_window"]


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def fresh_dirs(tag: str) -> tuple[str, str]:
    base = tempfile.mkdtemp(prefix=f"fivar-bench-{tag}-")
    return os.path.join(base, "ws"), os.path.join(base, "fivar")


FRESH_PROCESS = r'''
import json, sys, time
t0 = time.perf_counter()
import fivar
from fivar.jit.build import gen_module
t1 = time.perf_counter()
name, dtype, hd, load, opts = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", json.loads(sys.argv[5])
m = gen_module(fivar.load(name), op="single_prefill", dtype=dtype, head_dim=hd, **opts)
t2 = time.perf_counter()
kind = None
if load:
    m.load()
else:
    kind = m.build()
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "gen_module_s": t2 - t1, "hit_s": t3 - t2, "kind": kind}))
'''

SINGLE_COLD = r'''
import json, sys, time
import fivar
from fivar.jit.build import gen_module
m = gen_module(fivar.load(sys.argv[1]), op="single_prefill", dtype=sys.argv[2], head_dim=int(sys.argv[3]),
               **json.loads(sys.argv[4]))
t0 = time.perf_counter(); kind = m.build(); print(json.dumps({"kind": kind, "s": time.perf_counter() - t0}))
'''


#: gen_module options of the fivar builds --fivar-configs can compare (each renders another URI).
#: Every option spelled out, so that no environment setting (FIVAR_SPLIT_CTA_TILES, FIVAR_NVCC_SPLIT_COMPILE) makes two
#: of them the same module; "default" is fivar's default.
def _config(cta_tiles=False, nvcc_split=True, pin=True, skip_headers=True, parallel_passes=True):
    return {"split_cta_tiles": cta_tiles, "nvcc_split_compile": nvcc_split, "pin_kv_tiles": pin,
            "skip_unused_headers": skip_headers, "nvcc_parallel_passes": parallel_passes}


FIVAR_CONFIGS = {"default": _config(),
                 "unpinned": _config(pin=False),
                 "keep-headers": _config(skip_headers=False),
                 "serial-passes": _config(parallel_passes=False),
                 # the defaults of earlier sessions
                 "session12": _config(pin=False, skip_headers=False, parallel_passes=False),
                 "session13": _config(skip_headers=["cuda/pipeline"], parallel_passes=False),
                 "no-nvcc-split": _config(nvcc_split=False),
                 "cta-tiles": _config(cta_tiles=True),
                 "cta-tiles-session12": _config(cta_tiles=True, pin=False, skip_headers=False, parallel_passes=False),
                 "cta-tiles-no-nvcc-split": _config(cta_tiles=True, nvcc_split=False)}


def flashinfer_customize_spec(v, fivar_uri: str, dtype: str, head_dim: int):
    """FlashInfer's own JitSpec for fivar's FA2 variant declaration of `v` (single prefill): its
    `gen_customize_single_prefill_module` path, every mask mode instantiated, URI `flashinfer_ref_<fivar uri>`."""
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.attention.modules import gen_customize_single_prefill_module

    from fivar.codegen import fa2
    from fivar.jit import build as jb
    from fivar.jit import toolchain
    from fivar.paths import csrc_dir
    decl = fa2.variant_decl(v)
    tn, tt, sn, st = decl.additional
    uri = f"flashinfer_ref_{fivar_uri}"
    gen = jit_env.FLASHINFER_GEN_SRC_DIR / uri
    gen.mkdir(parents=True, exist_ok=True)
    header = (csrc_dir() / "fivar_ops.cuh").read_text()  # the decl's helper header; rewritten only when it
    if not (gen / "fivar_ops.cuh").exists() or (gen / "fivar_ops.cuh").read_text() != header:  # differs (ninja
        (gen / "fivar_ops.cuh").write_text(header)  # would rebuild on a newer mtime)
    stub = toolchain.link_flags()  # only on a machine without libcuda (a CPU box)
    if stub:
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = " ".join(stub)
    dt = jb.DTYPES[dtype]
    return gen_customize_single_prefill_module(
        "fa2", uri, dt, dt, dt, head_dim, head_dim, list(tn), list(tt), list(sn), list(st),
        fa2.struct_name(v), decl.source)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="softcap", help="variant for the single-module measurements "
                    "(logits-only, so FlashInfer's generic path is a like-for-like comparison)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-load", action="store_true", help="compile only (no GPU): hits are build() checks")
    ap.add_argument("--skip-flashinfer", action="store_true", help="skip FlashInfer's gen_customize path")
    ap.add_argument("--flashinfer-nvcc-threads", type=int, default=0, help="also time FlashInfer's path with "
                    "FLASHINFER_NVCC_THREADS=N (its own switch for nvcc's --threads; default 1)")
    ap.add_argument("--fivar-configs", default="default", help="comma-separated fivar builds of the same module, "
                    f"each timed cold in turn (first: the headline): {', '.join(FIVAR_CONFIGS)}")
    ap.add_argument("--repeat", type=int, default=1, help="cold compiles of each (alternating fivar and "
                    "FlashInfer, outputs deleted in between); medians are reported")
    ap.add_argument("--prewarm-count", type=int, default=8, help="modules in the prewarm (0: skip)")
    ap.add_argument("--prewarm-configs", default=None, help="fivar configs to prewarm, each in turn (default: the "
                    "first of --fivar-configs)")
    ap.add_argument("--singles", action="store_true", help="also compile each prewarm module alone, for "
                    "sum(single cold)/cores (N more compiles)")
    ap.add_argument("--jobs", type=int, default=None, help="ninja jobs (default: fivar's min(cores, mem/3GiB))")
    ap.add_argument("--hits", type=int, default=100000, help="in-process hit iterations")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temporary workspaces")
    args = ap.parse_args()

    ws, fc = fresh_dirs("main")
    if not args.keep:  # also when a step fails or the run is interrupted
        atexit.register(shutil.rmtree, os.path.dirname(ws), True)
    os.environ["FLASHINFER_WORKSPACE_BASE"] = ws  # before flashinfer is imported: it fixes its dirs then
    os.environ["FIVAR_CACHE_DIR"] = fc
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    sys.path.insert(0, str(REPO))
    import torch

    import fivar
    from fivar.jit import prewarm, toolchain
    from fivar.jit.build import build_many, gen_module
    jobs, jobs_why = prewarm.configure_jobs(args.jobs)
    cores = prewarm.cpu_count()
    load = not args.no_load
    if load and not torch.cuda.is_available():
        print("no GPU visible: use --no-load to compile only", file=sys.stderr)
        return 2
    res: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-only",
                 "arch": None, "flashinfer": toolchain.flashinfer_version(), "nvcc": toolchain.nvcc_version(),
                 "torch": torch.__version__, "cores": cores, "jobs": jobs, "jobs_why": jobs_why, "load": load,
                 "variant": args.variant, "dtype": args.dtype, "head_dim": args.head_dim}
    v = fivar.load(args.variant)
    configs = [c.strip() for c in args.fivar_configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in FIVAR_CONFIGS]
    if unknown or not configs:
        ap.error(f"--fivar-configs: unknown {unknown} (have {', '.join(FIVAR_CONFIGS)})")
    if len(set(configs)) != len(configs):
        ap.error("--fivar-configs: a config is named twice")
    fivar_mods = {c: gen_module(v, op="single_prefill", dtype=args.dtype, head_dim=args.head_dim,
                                **FIVAR_CONFIGS[c]) for c in configs}
    same = [(a, b) for i, a in enumerate(configs) for b in configs[i + 1:] if fivar_mods[a].uri == fivar_mods[b].uri]
    if same:  # e.g. an nvcc without --split-compile: both would be one module, the second a disk hit
        ap.error(f"--fivar-configs: {same[0][0]} and {same[0][1]} render the same module here ({fivar_mods[same[0][0]].uri})")
    m = fivar_mods[configs[0]]
    res["arch"] = toolchain.arch_tag()
    res["uri"] = m.uri
    res["fivar_configs"] = {c: {"uri": x.uri, "units": sum(n.endswith(".cu") for n in x.sources),
                                "cuda_cflags": x.cuda_cflags} for c, x in fivar_mods.items()}

    # 1./2. cold compiles: fivar (each config), then FlashInfer's own path for the same variant declaration
    fi_spec = None
    if not args.skip_flashinfer:
        fi_spec = flashinfer_customize_spec(v, m.uri, args.dtype, args.head_dim)
        res["flashinfer_units"] = len(fi_spec.sources)
    fi_threads = f"flashinfer-threads{args.flashinfer_nvcc_threads}"
    fi_threads_spec = None
    if fi_spec is not None and args.flashinfer_nvcc_threads > 1:
        os.environ["FLASHINFER_NVCC_THREADS"] = str(args.flashinfer_nvcc_threads)  # read when the spec is made
        fi_threads_spec = flashinfer_customize_spec(v, f"t{args.flashinfer_nvcc_threads}_{m.uri}", args.dtype,
                                                    args.head_dim)
        del os.environ["FLASHINFER_NVCC_THREADS"]
    res["fivar_units"] = sum(n.endswith(".cu") for n in m.sources)
    runs: dict[str, list] = {"fivar": [], "flashinfer": [], **{c: [] for c in configs[1:]},
                             **({fi_threads: []} if fi_threads_spec else {})}
    for i in range(max(1, args.repeat)):
        if i:  # make the next run cold again: drop build outputs, keep the generated sources
            for x in fivar_mods.values():
                shutil.rmtree(x.build_dir, ignore_errors=True)
            for spec in (fi_spec, fi_threads_spec):
                if spec is not None:
                    shutil.rmtree(spec.build_dir, ignore_errors=True)
        for c, x in fivar_mods.items():
            load0 = os.getloadavg()[0]
            c0, t0 = child_cpu(), time.perf_counter()
            kind = x.build()
            key = "fivar" if x is m else c
            runs[key].append((time.perf_counter() - t0, child_cpu() - c0, load0))
            assert kind == "cold", kind
            print(f"fivar [{c}] cold compile: {runs[key][-1][0]:.1f} s, {runs[key][-1][1]:.1f} CPU-s "
                  f"(load before {load0:.2f})", flush=True)
        if fi_spec is not None:
            load0 = os.getloadavg()[0]
            c0, t0 = child_cpu(), time.perf_counter()
            fi_spec.build(need_lock=True)
            runs["flashinfer"].append((time.perf_counter() - t0, child_cpu() - c0, load0))
            print(f"FlashInfer gen_customize cold compile: {runs['flashinfer'][-1][0]:.1f} s, "
                  f"{runs['flashinfer'][-1][1]:.1f} CPU-s (load before {load0:.2f})", flush=True)
        if fi_threads_spec is not None:
            c0, t0 = child_cpu(), time.perf_counter()
            fi_threads_spec.build(need_lock=True)
            runs[fi_threads].append((time.perf_counter() - t0, child_cpu() - c0, os.getloadavg()[0]))
            print(f"FlashInfer gen_customize, FLASHINFER_NVCC_THREADS={args.flashinfer_nvcc_threads}, cold compile: "
                  f"{runs[fi_threads][-1][0]:.1f} s, {runs[fi_threads][-1][1]:.1f} CPU-s", flush=True)
    res["cold_runs"] = runs
    res["fivar_cold_s"], res["fivar_cold_cpu_s"] = median(runs["fivar"], 0), median(runs["fivar"], 1)
    for c in configs:
        rows = runs["fivar" if c == configs[0] else c]
        res["fivar_configs"][c].update(cold_s=median(rows, 0), cold_cpu_s=median(rows, 1))
    if runs["flashinfer"]:
        res["flashinfer_cold_s"] = median(runs["flashinfer"], 0)
        res["flashinfer_cold_cpu_s"] = median(runs["flashinfer"], 1)
        res["cold_ratio_fivar_over_flashinfer"] = res["fivar_cold_s"] / res["flashinfer_cold_s"]
        for c in configs:
            r = res["fivar_configs"][c]
            r["ratio_over_flashinfer"] = r["cold_s"] / res["flashinfer_cold_s"]
            print(f"cold compile ratio fivar [{c}]/FlashInfer: {r['ratio_over_flashinfer']:.2f}", flush=True)
        if runs.get(fi_threads):
            res[fi_threads] = {"cold_s": median(runs[fi_threads], 0), "cold_cpu_s": median(runs[fi_threads], 1),
                               "fivar_over_it": res["fivar_cold_s"] / median(runs[fi_threads], 0)}
            print(f"cold compile ratio fivar/FlashInfer with FLASHINFER_NVCC_THREADS={args.flashinfer_nvcc_threads}: "
                  f"{res[fi_threads]['fivar_over_it']:.2f}", flush=True)
    if load and fi_spec is not None:
        fi_spec.build_and_load()  # untimed: the reference module is loadable too

    # 3. in-process hits
    if load:
        t0 = time.perf_counter()
        m.load()
        res["first_load_ms"] = (time.perf_counter() - t0) * 1e3
        n = args.hits
        t0 = time.perf_counter()
        for _ in range(n):
            m.load()
        res["in_process_hit_us"] = (time.perf_counter() - t0) / n * 1e6
        res["in_process_hit_what"] = "load() of a loaded module (memory hit)"
    else:
        n = max(1, args.hits // 100)
        t0 = time.perf_counter()
        for _ in range(n):
            m.build()
        res["in_process_hit_us"] = (time.perf_counter() - t0) / n * 1e6
        res["in_process_hit_what"] = "build() of a built, unloaded module (manifest check + record)"
    print(f"in-process hit: {res['in_process_hit_us']:.2f} us", flush=True)

    # 4. a fresh process hitting the disk cache
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, args.variant, args.dtype, str(args.head_dim),
                          "1" if load else "0", json.dumps(FIVAR_CONFIGS[configs[0]])], env=env, capture_output=True,
                         text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"the fresh process failed:\n{out.stderr[-3000:]}")
    fp = json.loads(out.stdout.strip().splitlines()[-1])
    assert fp["kind"] in (None, "disk"), f"the fresh process did not hit the disk cache: {fp}"  # None: load()
    res["fresh_process"] = {**fp, "process_wall_s": wall}
    res["fresh_process_disk_hit_ms"] = fp["hit_s"] * 1e3
    print(f"fresh-process disk hit: {res['fresh_process_disk_hit_ms']:.1f} ms (+{fp['gen_module_s']:.2f} s "
          f"gen_module, +{fp['import_s']:.2f} s import)", flush=True)

    # 5. prewarm
    if args.prewarm_count > 0:
        specs = [(n, "fp16" if args.dtype == "bf16" else "bf16", args.head_dim) for n in BUNDLED] + \
                [(args.variant, args.dtype, 64 if args.head_dim != 64 else 128)]
        specs = specs[:args.prewarm_count]
        pconfigs = [c.strip() for c in (args.prewarm_configs or configs[0]).split(",") if c.strip()]
        if any(c not in FIVAR_CONFIGS for c in pconfigs) or len(set(pconfigs)) != len(pconfigs):
            ap.error(f"--prewarm-configs: {pconfigs}: each of {', '.join(FIVAR_CONFIGS)}, at most once")
        res["prewarm_by_config"] = {}
        for c in pconfigs:  # each config renders other URIs: every prewarm here is cold
            mods = [gen_module(fivar.load(n), op="single_prefill", dtype=d, head_dim=h, **FIVAR_CONFIGS[c])
                    for n, d, h in specs]
            c0, t0 = child_cpu(), time.perf_counter()
            results = build_many(mods, parallel=True)
            wall, cpu = time.perf_counter() - t0, child_cpu() - c0
            assert all(k == "cold" for k, _ in results), results
            res["prewarm_by_config"][c] = {"modules": [x.uri for x in mods], "n": len(mods), "wall_s": wall,
                                           "cpu_s": cpu, "ideal_cpu_over_cores_s": cpu / cores,
                                           "efficiency": (cpu / cores) / wall, "config": c}
            print(f"prewarm {len(mods)} [{c}]: {wall:.1f} s, {cpu:.1f} CPU-s (ideal {cpu / cores:.1f} s)", flush=True)
        res["prewarm"] = res["prewarm_by_config"][pconfigs[0]]
        if args.singles:
            singles = []
            for n, d, h in specs:
                sws, sfc = fresh_dirs("single")
                if not args.keep:
                    atexit.register(shutil.rmtree, os.path.dirname(sws), True)
                senv = {**env, "FLASHINFER_WORKSPACE_BASE": sws, "FIVAR_CACHE_DIR": sfc}
                o = subprocess.run([sys.executable, "-c", SINGLE_COLD, n, d, str(h),
                                    json.dumps(FIVAR_CONFIGS[pconfigs[0]])], env=senv,
                                   capture_output=True, text=True, check=True)
                singles.append(json.loads(o.stdout.strip().splitlines()[-1])["s"])
                if not args.keep:
                    shutil.rmtree(os.path.dirname(sws), ignore_errors=True)
            res["prewarm"]["single_cold_s"] = singles
            res["prewarm"]["ideal_sum_single_over_cores_s"] = sum(singles) / cores

    from fivar.jit import records
    records.flush()
    print_table(res)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(res, indent=1))
        print(f"wrote {args.json_path}")
    if not args.keep:
        shutil.rmtree(os.path.dirname(ws), ignore_errors=True)
    return 0


def median(rows: list, col: int) -> float:
    vals = sorted(r[col] for r in rows)
    n = len(vals)
    return vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2


def print_table(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table("measurement", "value", title=f"fivar build/cache costs on {res['device']} "
              f"(arch {res['arch']}, {res['cores']} cores, {res['jobs']} jobs; FlashInfer {res['flashinfer']}, "
              f"nvcc {res['nvcc']})")
    t.add_row(f"cold compile, fivar {next(iter(res['fivar_configs']))} ({res['fivar_units']} nvcc units)",
              f"{res['fivar_cold_s']:.1f} s wall, {res['fivar_cold_cpu_s']:.1f} s CPU")
    if "flashinfer_cold_s" in res:
        t.add_row(f"cold compile, FlashInfer gen_customize ({res['flashinfer_units']} units)",
                  f"{res['flashinfer_cold_s']:.1f} s wall, {res['flashinfer_cold_cpu_s']:.1f} s CPU "
                  f"({res['flashinfer_cold_s'] / res['fivar_cold_s']:.2f}x fivar; fivar/FlashInfer "
                  f"{res['cold_ratio_fivar_over_flashinfer']:.2f})")
    for c, r in list(res["fivar_configs"].items())[1:]:
        extra = f"; fivar/FlashInfer {r['ratio_over_flashinfer']:.2f}" if "ratio_over_flashinfer" in r else ""
        t.add_row(f"cold compile, fivar {c} ({r['units']} units)",
                  f"{r['cold_s']:.1f} s wall, {r['cold_cpu_s']:.1f} s CPU{extra}")
    for key, r in res.items():
        if key.startswith("flashinfer-threads"):
            t.add_row(f"cold compile, FlashInfer gen_customize with FLASHINFER_NVCC_THREADS={key[18:]}",
                      f"{r['cold_s']:.1f} s wall, {r['cold_cpu_s']:.1f} s CPU; fivar/it {r['fivar_over_it']:.2f}")
    if len(res["cold_runs"]["fivar"]) > 1:
        t.add_row("  cold runs (wall s: fivar | FlashInfer)",
                  " ".join(f"{r[0]:.1f}" for r in res["cold_runs"]["fivar"]) + " | " +
                  " ".join(f"{r[0]:.1f}" for r in res["cold_runs"]["flashinfer"]))
    t.add_row(f"in-process hit ({res['in_process_hit_what']})", f"{res['in_process_hit_us']:.2f} us")
    if "first_load_ms" in res:
        t.add_row("first load in process (dlopen)", f"{res['first_load_ms']:.1f} ms")
    fp = res["fresh_process"]
    t.add_row("fresh-process disk hit (load() or build() after gen_module)",
              f"{res['fresh_process_disk_hit_ms']:.1f} ms (+ gen_module {fp['gen_module_s'] * 1e3:.0f} ms, "
              f"import {fp['import_s'] * 1e3:.0f} ms; process {fp['process_wall_s']:.2f} s)")
    if "prewarm" in res:
        p = res["prewarm"]
        for c, q in res["prewarm_by_config"].items():
            t.add_row(f"prewarm {q['n']} modules (one ninja), {c}", f"{q['wall_s']:.1f} s wall, {q['cpu_s']:.1f} s CPU "
                      f"(efficiency {100 * q['efficiency']:.0f}%)")
        t.add_row("  ideal: CPU s / cores", f"{p['ideal_cpu_over_cores_s']:.1f} s "
                  f"(parallel efficiency {100 * p['efficiency']:.0f}%)")
        if "ideal_sum_single_over_cores_s" in p:
            t.add_row("  ideal: sum(single cold) / cores", f"{p['ideal_sum_single_over_cores_s']:.1f} s")
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
