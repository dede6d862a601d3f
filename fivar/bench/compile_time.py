"""Build and cache costs of one variant module, fivar against FlashInfer's own module of the same op, built one
after the other in this process into a fresh FlashInfer workspace and a fresh fivar cache, after a warm-up (warm_up:
neither pays for a cold file cache), each first in every other round (`--repeat`):

1. cold build of the fivar module (FA2 or FA3 single prefill), wall and CPU seconds, and its longest unit (from
   ninja's log: on a host with a core per unit, the module's wall time is about its longest unit plus the link);
2. cold build of FlashInfer's module of the same op, the same way: on FA2 its `gen_customize_single_prefill_module`
   with fivar's variant declaration (every mask mode instantiated, where fivar instantiates those the variant can
   use), on FA3 its stock soft-cap module (`gen_single_prefill_module(backend="fa3", use_logits_soft_cap=True)`:
   what a soft-capped FA3 single prefill runs in FlashInfer); the same ninja job count, include and link paths;
3. in-process hit: `load()` of a loaded module (microseconds), or with `--no-load` a `build()` disk check;
4. fresh-process disk hit: a new Python finds the module in the disk cache (milliseconds, import excluded);
5. optionally, a prewarm of N other modules in one parallel ninja against CPU seconds / cores.

Other modes, each a fresh process of its own with a variant file (`--file`): `--mode build`, a cold `fivar build` of
it (the modules backend="auto" runs on the arch: on Hopper FA3 prefill and FA2 decode); `--mode first-prefill`, a
cold first `v.prefill` (the Triton twin answers while the modules build; GPU); `--mode flex`, FlexAttention's first
call of it (torch.compile and the block mask; GPU). The `compile` suite compares the three.

    python -m fivar.bench.compile_time --variant softcap --target fa2 [--json FILE]
    FLASHINFER_CUDA_ARCH_LIST=9.0a python -m fivar.bench.compile_time --no-load     # no GPU: compile only

The workspace is chosen before FlashInfer is imported (it fixes its folders then), so run this as its own process:
`fivar bench NAME --compile` and the `compile` suite do.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUNDLED = ("alibi", "document_mask", "relative_bias", "sigmoid", "sliding_window", "softcap", "softcap_sliding_window")

FRESH_PROCESS = r'''
import json, sys, time
t0 = time.perf_counter()
import fivar
from fivar.jit.build import gen_module
t1 = time.perf_counter()
name, target, dtype, hd, load = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
m = gen_module(fivar.load(name), op="single_prefill", target=target, dtype=dtype, head_dim=hd)
t2 = time.perf_counter()
kind = None
if load:
    m.load()
else:
    kind = m.build()
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "gen_module_s": t2 - t1, "hit_s": t3 - t2, "kind": kind}))
'''


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def flashinfer_spec(v, target: str, fivar_uri: str, dtype: str, head_dim: int):
    """FlashInfer's own JitSpec for the single-prefill op of `v` (see the module docstring)."""
    from flashinfer.jit.attention.modules import gen_customize_single_prefill_module, gen_single_prefill_module

    from ..jit import build as jb
    from ..jit import toolchain
    from ..jit.targets import FA3, target_of
    stub = toolchain.link_flags()  # only on a machine without libcuda (a CPU box)
    if stub:
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = " ".join(stub)
    dt = jb.DTYPES[dtype]
    if target_of(target) is FA3:  # FlashInfer's stock soft-cap module (above); FA2's takes fivar's declaration
        spec = gen_single_prefill_module("fa3", dt, dt, dt, head_dim, head_dim, 0, False, True, False)
        # the headers a minimal toolkit lacks (curand_kernel.h), found where fivar's modules find them
        spec.extra_include_dirs = [*(spec.extra_include_dirs or []), *map(Path, toolchain.extra_include_paths())] or None
        return spec
    from flashinfer.jit import env as jit_env

    from ..codegen import fa2
    from ..paths import csrc_dir
    decl = fa2.variant_decl(v)
    tn, tt, sn, st = decl.additional
    uri = f"flashinfer_ref_{fivar_uri}"
    gen = jit_env.FLASHINFER_GEN_SRC_DIR / uri
    gen.mkdir(parents=True, exist_ok=True)
    header = (csrc_dir() / "fivar_ops.cuh").read_text()  # the declaration's helper header (rewritten only when it
    if not (gen / "fivar_ops.cuh").exists() or (gen / "fivar_ops.cuh").read_text() != header:  # differs: ninja
        (gen / "fivar_ops.cuh").write_text(header)  # rebuilds on a newer mtime)
    return gen_customize_single_prefill_module("fa2", uri, dt, dt, dt, head_dim, head_dim, list(tn), list(tt),
                                               list(sn), list(st), fa2.struct_name(v), decl.source)


def _timed(build) -> tuple[float, float]:
    c0, t0 = child_cpu(), time.perf_counter()
    build()
    return time.perf_counter() - t0, child_cpu() - c0


def warm_up(specs) -> float:
    """Before any timed build: one nvcc run per module over its first kernel unit, preprocessing only (reads every
    header it includes), and a compile of an empty kernel with the same command (loads cudafe++, cicc, ptxas and the
    host compiler). Otherwise the module built first pays for a cold file cache that the second finds warm."""
    import re
    import shlex
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="fivar-warm-up-"))
    empty = work / "fivar_warm_up.cu"
    empty.write_text("__global__ void fivar_warm_up() {}\n")
    for spec in specs:
        cmds = [e["command"] for e in spec.get_compile_commands() if "kernel" in Path(e["file"]).name]
        if not cmds:
            continue
        cmd = re.sub(r"\s-o\s+\S+", "", cmds[0])
        subprocess.run(shlex.split(cmd) + ["-E", "-o", os.devnull], capture_output=True)
        src = re.search(r"-c (\S+\.cu)\b", cmd).group(1)
        subprocess.run(shlex.split(cmd.replace(src, str(empty))) + ["-o", str(work / "fivar_warm_up.o")],
                       capture_output=True)
    shutil.rmtree(work, ignore_errors=True)
    return time.perf_counter() - t0


def unit_seconds(build_dir: Path) -> dict[str, float]:
    """Seconds per nvcc unit (object file) of the last ninja run in `build_dir` (a module built on its own: FlashInfer
    runs ninja there, so its log is the module's), from ninja's log: start and end in ms, then mtime and output."""
    try:
        text = (Path(build_dir) / ".ninja_log").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 4 and parts[0].isdigit() and parts[1].isdigit() and parts[3].endswith(".o"):
            out[Path(parts[3]).name] = (int(parts[1]) - int(parts[0])) / 1000.0
    return out


def measure(variant: str = "softcap", target: str = "fa2", dtype: str = "bf16", head_dim: int = 128,
            load: bool = True, with_flashinfer: bool = True, repeat: int = 1, hits: int = 10000,
            prewarm_count: int = 0, log=print) -> dict:
    """Every measurement of the module docstring, as a dict. Call in a process whose FlashInfer workspace and fivar
    cache are fresh (`main` makes them)."""
    import torch

    import fivar
    from ..jit import prewarm, toolchain
    from ..jit.build import build_many, gen_module
    jobs, jobs_why = prewarm.configure_jobs(None)
    v = fivar.load(variant)
    m = gen_module(v, op="single_prefill", target=target, dtype=dtype, head_dim=head_dim)
    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu-only",
           "arch": toolchain.arch_tag(), "flashinfer": toolchain.flashinfer_version(), "nvcc": toolchain.nvcc_version(),
           "torch": torch.__version__, "cores": toolchain.cpu_count(), "jobs": jobs, "jobs_why": jobs_why, "load": load,
           "variant": variant, "target": target, "dtype": dtype, "head_dim": head_dim, "uri": m.uri,
           "fivar_units": sum(n.endswith(".cu") for n in m.sources)}
    fi = flashinfer_spec(v, target, m.uri, dtype, head_dim) if with_flashinfer else None
    if fi is not None:
        res["flashinfer_uri"] = fi.name
        res["flashinfer_units"] = len(fi.sources)
    runs = {"fivar": [], "flashinfer": []}
    units: dict[str, list[dict[str, float]]] = {"fivar": [], "flashinfer": []}
    res["warm_up_s"] = warm_up([m.jit_spec(), *([fi] if fi is not None else [])])

    def build_fivar():
        kind = []
        runs["fivar"].append(_timed(lambda: kind.append(m.build())))
        if kind[0] != "cold":
            raise RuntimeError(f"the fivar module was a {kind[0]} hit in a fresh cache: {m.uri}")
        units["fivar"].append(unit_seconds(m.build_dir))

    def build_flashinfer():
        runs["flashinfer"].append(_timed(lambda: fi.build(need_lock=True)))
        units["flashinfer"].append(unit_seconds(fi.build_dir))

    for i in range(max(1, repeat)):
        if i:  # cold again: drop build outputs, keep the generated sources
            shutil.rmtree(m.build_dir, ignore_errors=True)
            if fi is not None:
                shutil.rmtree(fi.build_dir, ignore_errors=True)
        order = [("fivar", build_fivar)] + ([("FlashInfer", build_flashinfer)] if fi is not None else [])
        for who, build in order[::-1] if i % 2 else order:  # each goes first in every other round
            build()
            key = who.lower()
            log(f"{who} {target} cold build: {runs[key][-1][0]:.1f} s, {runs[key][-1][1]:.1f} CPU-s, longest unit "
                f"{max(units[key][-1].values(), default=0):.1f} s")
    for who, rs in runs.items():
        if rs:
            res[f"{who}_cold_s"] = statistics.median(r[0] for r in rs)
            res[f"{who}_cold_cpu_s"] = statistics.median(r[1] for r in rs)
        longest = [max(u.items(), key=lambda kv: kv[1]) for u in units[who] if u]
        if longest:
            res[f"{who}_longest_unit_s"] = statistics.median(s for _, s in longest)
            res[f"{who}_longest_unit"] = longest[-1][0]
            res[f"{who}_unit_s"] = units[who][-1]
    res["cold_runs"] = runs
    if load:
        t0 = time.perf_counter()
        m.load()
        res["first_load_ms"] = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        for _ in range(hits):
            m.load()
        res["in_process_hit_us"] = (time.perf_counter() - t0) / hits * 1e6
        res["in_process_hit_what"] = "load() of a loaded module (memory hit)"
    else:
        n = max(1, hits // 100)
        t0 = time.perf_counter()
        for _ in range(n):
            m.build()
        res["in_process_hit_us"] = (time.perf_counter() - t0) / n * 1e6
        res["in_process_hit_what"] = "build() of a built, unloaded module (manifest check)"
    pkg_root = str(Path(fivar.__file__).resolve().parents[1])  # the same fivar as this process, checkout or wheel
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, variant, target, dtype, str(head_dim),
                          "1" if load else "0"], env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the fresh process failed:\n{out.stderr[-3000:]}")
    fp = json.loads(out.stdout.strip().splitlines()[-1])
    if fp["kind"] not in (None, "disk"):  # None: load() returned (a cold build would have been far slower)
        raise RuntimeError(f"the fresh process did not hit the disk cache: {fp}")
    res["fresh_process"] = {**fp, "process_wall_s": time.perf_counter() - t0}
    res["fresh_process_disk_hit_ms"] = fp["hit_s"] * 1e3
    log(f"hits: in process {res['in_process_hit_us']:.2f} us, fresh process {res['fresh_process_disk_hit_ms']:.1f} ms")
    if prewarm_count > 0:
        other = "fp16" if dtype == "bf16" else "bf16"
        mods = [gen_module(fivar.load(n), op="single_prefill", dtype=other, head_dim=head_dim)
                for n in BUNDLED][:prewarm_count]
        c0, t0 = child_cpu(), time.perf_counter()
        build_many(mods, parallel=True)
        wall, cpu = time.perf_counter() - t0, child_cpu() - c0
        res["prewarm"] = {"n": len(mods), "wall_s": wall, "cpu_s": cpu, "ideal_s": cpu / res["cores"],
                          "efficiency": cpu / res["cores"] / wall}
        log(f"prewarm {len(mods)}: {wall:.1f} s, {cpu:.1f} CPU-s (ideal {cpu / res['cores']:.1f} s)")
    from ..jit import records
    records.flush()
    return res


#: the first-call shape: one request, GQA 32/8 heads (the attention suite's prefill shape, shorter)
FIRST_CALL = {"seqlen": 4096, "num_qo_heads": 32, "num_kv_heads": 8}


def _no_gpu(what: str) -> dict | None:
    import torch
    return None if torch.cuda.is_available() else {"skipped": f"{what} needs a CUDA GPU (none visible)"}


def measure_build_set(variant_file: str, dtype: str = "bf16", head_dim: int = 128, log=print) -> dict:
    """A cold `fivar build NAME` of one variant file: the modules backend="auto" runs on the arch being built for
    (fivar.runtime.build_set.build_modules, `fivar build`'s default ops), in one parallel ninja; wall and CPU seconds, and
    each module's own seconds inside that ninja. Call in a process with a fresh cache (`main` makes one)."""
    import fivar
    from ..runtime.build_set import DEFAULT_OPS, build_modules
    from ..jit import prewarm, toolchain
    from ..jit.build import build_many
    v = fivar.load(variant_file)
    mods = list({m.uri: m for m in build_modules([v], ["auto"], DEFAULT_OPS, [dtype], [head_dim])}.values())
    jobs, jobs_why = prewarm.configure_jobs(None)
    c0, t0 = child_cpu(), time.perf_counter()
    results = build_many(mods, parallel=True)
    wall, cpu = time.perf_counter() - t0, child_cpu() - c0
    warm = [m.uri for m, (kind, _) in zip(mods, results) if kind != "cold"]
    if warm:
        raise RuntimeError(f"module(s) already built in a fresh cache: {', '.join(warm)}")
    log(f"fivar build {v.name}: {len(mods)} module(s), {wall:.1f} s, {cpu:.1f} CPU-s")
    return {"variant": v.name, "file": str(variant_file), "modules": len(mods), "build_s": wall, "build_cpu_s": cpu,
            "module_s": {m.uri: s for m, (_, s) in zip(mods, results)}, "targets": sorted({m.target for m in mods}),
            "jobs": jobs, "jobs_why": jobs_why, "cores": toolchain.cpu_count(), "arch": toolchain.arch_tag(),
            "nvcc": toolchain.nvcc_version(), "dtype": dtype, "head_dim": head_dim}


def _first_call_inputs(v, dtype: str, head_dim: int):
    """q, k, v of FIRST_CALL's shape, the variant's example params (its defaults where it has none), and causal:
    a logits-only variant runs causal, a mask carries its own."""
    import torch
    from ..jit.build import DTYPES
    n, hq, hkv = FIRST_CALL["seqlen"], FIRST_CALL["num_qo_heads"], FIRST_CALL["num_kv_heads"]
    dt = DTYPES[dtype]
    q, k, vv = (torch.randn(n, h, head_dim, device="cuda", dtype=dt) for h in (hq, hkv, hkv))
    params = v.example(hq, hkv, 1, n, "cuda") if getattr(v, "example", None) else {}
    return q, k, vv, params, v.ir.mask is None


def measure_first_prefill(variant_file: str, dtype: str = "bf16", head_dim: int = 128, log=print) -> dict:
    """A cold first `v.prefill` with backend "auto" (fivar.runtime.cold_start): the seconds to its first result (the
    Triton twin, compiled cold, runs it while the modules build in the background) and until a call runs on the
    modules auto picks (FA3 on Hopper). Needs a GPU; a fresh fivar cache, FlashInfer workspace and Triton cache."""
    skipped = _no_gpu("a first call")
    if skipped:
        return skipped
    import torch

    import fivar
    from .. import config
    from ..runtime import cold_start
    from ..runtime.forms import choose_target
    v = fivar.load(variant_file)
    q, k, vv, params, causal = _first_call_inputs(v, dtype, head_dim)
    target = choose_target(v, "auto", "single_prefill", q.device)[0]
    with config.override(cold_start="triton"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first = v.prefill(q, k, vv, causal=causal, **params)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        on_twin = cold_start.runs_triton(v, "single_prefill", target, "auto", q, params, causal=causal)  # the twin ran
        cold_start.wait_for_builds()
        ready_s = time.perf_counter() - t0
        out = v.prefill(q, k, vv, causal=causal, **params)
        torch.cuda.synchronize()
        in_use_s = time.perf_counter() - t0
        if cold_start.runs_triton(v, "single_prefill", target, "auto", q, params, causal=causal):
            raise RuntimeError(f"the {target} modules were not in use after their build")
    mods = cold_start.call_modules(v, "single_prefill", target, q, cold_start.softmax_form(v, q, params), causal)
    missing = [m.uri for m in mods if not m.manifest_ok()]
    if missing:
        raise RuntimeError(f"the background build left {', '.join(missing)} unbuilt")
    diff = (first.float() - out.float()).abs().max().item()  # the twin's answer against the module's
    log(f"fivar first prefill {v.name}: first result {first_s:.1f} s ({'Triton twin' if on_twin else target}), "
        f"{target} in use {in_use_s:.1f} s")
    return {"variant": v.name, "target": target, "first_result_s": first_s, "first_ran": "triton" if on_twin else
            target, "build_done_s": ready_s, "in_use_s": in_use_s, "modules": len(mods), "max_diff": diff,
            "shape": dict(FIRST_CALL, head_dim=head_dim, dtype=dtype, causal=causal)}


def measure_flex_first_call(variant_file: str, dtype: str = "bf16", head_dim: int = 128, log=print) -> dict:
    """FlexAttention's first forward call of the variant (fivar.flex: its score_mod/mask_mod, torch.compile of
    flex_attention), block mask creation included, with a fresh Inductor and Triton cache; and the second call."""
    skipped = _no_gpu("FlexAttention's first call")
    if skipped:
        return skipped
    import torch

    import fivar
    from ..flex import flex_attention_fn
    v = fivar.load(variant_file)
    q, k, vv, params, causal = _first_call_inputs(v, dtype, head_dim)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run = flex_attention_fn(v, params, q, k, vv, causal=causal)  # builds the block mask
    torch.cuda.synchronize()
    mask_s = time.perf_counter() - t0
    run()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    log(f"flex first call {v.name}: {first_s:.1f} s (block mask {mask_s:.2f} s)")
    return {"variant": v.name, "first_call_s": first_s, "block_mask_s": mask_s,
            "second_call_ms": (time.perf_counter() - t1) * 1e3, "torch": torch.__version__,
            "shape": dict(FIRST_CALL, head_dim=head_dim, dtype=dtype, causal=causal)}


def _first_train_step(variant_file: str, dtype: str, head_dim: int, log, who: str, forward_of) -> dict:
    """Seconds of a cold first training step (forward and backward; `forward_of(v, params, q, k, v, causal)` makes
    the step's forward, timed with it) and milliseconds of the second, on FIRST_CALL's shape."""
    skipped = _no_gpu(f"{who}'s first training step")
    if skipped:
        return skipped
    import torch

    import fivar
    v = fivar.load(variant_file)
    q, k, vv, params, causal = _first_call_inputs(v, dtype, head_dim)
    q, k, vv = (t.requires_grad_() for t in (q, k, vv))
    do = torch.randn_like(q)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    forward = forward_of(v, params, q, k, vv, causal)

    def step():
        forward().backward(do)
        torch.cuda.synchronize()
    step()
    first_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    step()
    log(f"{who} first training step {v.name}: {first_s:.1f} s")
    return {"variant": v.name, "first_step_s": first_s, "second_step_ms": (time.perf_counter() - t1) * 1e3,
            "torch": torch.__version__, "shape": dict(FIRST_CALL, head_dim=head_dim, dtype=dtype, causal=causal)}


def measure_first_train_step(variant_file: str, dtype: str = "bf16", head_dim: int = 128, log=print) -> dict:
    """A cold first training step of the variant: `v.attention` forward and backward (the generated Triton backward
    compiled cold; the forward auto's, the Triton twin while its FA3 modules build), and the second step."""
    return _first_train_step(variant_file, dtype, head_dim, log, "fivar", lambda v, params, q, k, vv, causal: (
        lambda: v.attention(q, k, vv, causal=causal, **params)))


def measure_flex_first_train_step(variant_file: str, dtype: str = "bf16", head_dim: int = 128, log=print) -> dict:
    """FlexAttention's first training step of the variant: its forward and backward compiled by torch.compile,
    block mask creation included, fresh caches; and the second step."""
    from ..flex import flex_attention_fn
    return _first_train_step(variant_file, dtype, head_dim, log, "flex", lambda v, params, q, k, vv, causal:
                             flex_attention_fn(v, params, q, k, vv, causal=causal))  # builds the block mask


MODES = {"build": measure_build_set, "first-prefill": measure_first_prefill, "flex": measure_flex_first_call,
         "first-train": measure_first_train_step, "flex-train": measure_flex_first_train_step}


def _write_json(res: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(res, indent=1))
        print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fivar.bench.compile_time", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="softcap", help="a logits-only variant makes FlashInfer's own path like "
                    "for like")
    ap.add_argument("--target", default="fa2", choices=["fa2", "fa3"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-load", action="store_true", help="compile only (no GPU): hits are build() checks")
    ap.add_argument("--skip-flashinfer", action="store_true", help="skip FlashInfer's module")
    ap.add_argument("--repeat", type=int, default=1, help="cold builds of each, each first in every other round "
                    "(medians reported)")
    ap.add_argument("--prewarm-count", type=int, default=0, help="modules in a parallel prewarm (0: none)")
    ap.add_argument("--hits", type=int, default=10000, help="in-process hit iterations")
    ap.add_argument("--mode", default="module", choices=["module", *MODES], help="module: the measurements above; "
                    "build: a cold `fivar build` of --file; first-prefill: a cold first v.prefill of --file (GPU); "
                    "flex: FlexAttention's first call of --file (GPU)")
    ap.add_argument("--file", default=None, help="the variant file (or name) of --mode build/first-prefill/flex")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temporary workspace and cache")
    args = ap.parse_args(argv)
    if "flashinfer" in sys.modules:
        raise SystemExit("compile_time must choose FlashInfer's workspace before FlashInfer is imported: run it as "
                         "its own process (python -m fivar.bench.compile_time)")
    base = tempfile.mkdtemp(prefix="fivar-compile-time-")
    os.environ["FLASHINFER_WORKSPACE_BASE"] = os.path.join(base, "ws")
    os.environ["FIVAR_CACHE_DIR"] = os.path.join(base, "fivar")
    # cold compiles of Triton kernels (the twin) and of Inductor's (Flex) too
    os.environ["TRITON_CACHE_DIR"] = os.path.join(base, "triton")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, "inductor")
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    try:
        if args.mode != "module":
            if not args.file:
                ap.error(f"--mode {args.mode} needs --file")
            res = MODES[args.mode](args.file, args.dtype, args.head_dim, log=lambda s: print(s, flush=True))
            if "skipped" in res:
                print(res["skipped"], file=sys.stderr)
            _write_json(res, args.json_path)
            return 0
        import torch
        load = not args.no_load
        if load and not torch.cuda.is_available():
            print("no GPU visible: pass --no-load to compile only", file=sys.stderr)
            return 2
        res = measure(args.variant, args.target, args.dtype, args.head_dim, load=load,
                      with_flashinfer=not args.skip_flashinfer, repeat=args.repeat, hits=args.hits,
                      prewarm_count=args.prewarm_count, log=lambda s: print(s, flush=True))
        if "flashinfer_cold_s" in res:
            print(f"cold build fivar/FlashInfer on {res['cores']} cores, {res['jobs']} jobs: "
                  f"{res['fivar_cold_s'] / res['flashinfer_cold_s']:.2f} ({res['fivar_units']} vs "
                  f"{res['flashinfer_units']} nvcc units)")
        if "flashinfer_longest_unit_s" in res and "fivar_longest_unit_s" in res:
            print(f"longest unit fivar/FlashInfer: {res['fivar_longest_unit_s']:.1f} s ({res['fivar_longest_unit']}) / "
                  f"{res['flashinfer_longest_unit_s']:.1f} s ({res['flashinfer_longest_unit']}) = "
                  f"{res['fivar_longest_unit_s'] / res['flashinfer_longest_unit_s']:.2f}")
        _write_json(res, args.json_path)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
