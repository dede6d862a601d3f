"""Build costs: a cold build of fivar's single-prefill module of `softcap` (FA2, and FA3 on Hopper) against
FlashInfer's own module of the same op built in the same run (FA3: FlashInfer's stock soft-cap single-prefill module),
and the cache hits after it (in process, and a fresh process reading the disk cache). Each case runs
fivar.bench.compile_time in its own process with a fresh FlashInfer workspace and fivar cache, so both builds are cold.
Rows: wall seconds with the host's cores (`s`, ninja at fivar's default job count), CPU seconds (`cpu_s`) and the
longest nvcc unit (`unit_s`, which bounds the wall time however many cores there are).

Then, for two variants that are not bundled (benchmarks/compile/: a mask and a logits-only transform, as a new user
writes them), fivar's cold start against FlexAttention's: a cold `fivar build` of each (`fivar build`, wall and CPU
seconds, each module's own seconds in the detail), a cold first `v.prefill` (seconds to the first result, which the
Triton twin gives while the modules build, and until the modules backend="auto" picks are in use), and Flex's first
call (torch.compile of flex_attention with the variant's score_mod/mask_mod, block mask included); ratios against
Flex's first call. And a cold first training step of each (`v.attention` forward and backward: the generated Triton
backward compiled cold, the forward the Triton twin's while the FA3 modules build) against Flex's (its forward and
backward compiled). The first calls need a GPU: without one those rows are left out."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..compile_time import FIRST_CALL
from ..runner import Case, Measurement, Prepared

VARIANT = "softcap"
#: Cold builds of each module, each first in every other round (medians): neither gains from going second.
REPEAT = 2


def measure(target: str, timeout_s: float = 1800) -> list[Measurement]:
    import fivar
    with tempfile.TemporaryDirectory(prefix="fivar-compile-suite-") as tmp:
        out = Path(tmp) / "res.json"
        pkg_root = str(Path(fivar.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")]))}
        p = subprocess.run([sys.executable, "-m", "fivar.bench.compile_time", "--variant", VARIANT, "--target", target,
                            "--repeat", str(REPEAT), "--json", str(out)], env=env, capture_output=True, text=True,
                           timeout=timeout_s)
        if p.returncode or not out.exists():
            err = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
            return [Measurement("fivar", "s", None, "error", detail={"error": err[0][:400]})]
        res = json.loads(out.read_text())
    units = {"fivar": res["fivar_units"], "flashinfer": res.get("flashinfer_units")}
    rows = []
    for who in ("fivar", "flashinfer"):
        if f"{who}_cold_s" not in res:
            continue
        label = f"{units[who]} nvcc units" + (f", {res.get('flashinfer_uri')}" if who == "flashinfer" else "")
        detail = {"jobs": res["jobs"], "cores": res["cores"], "nvcc": res["nvcc"], "arch": res["arch"]}
        rows.append(Measurement(who, "s", res[f"{who}_cold_s"], label=label, detail=detail))
        rows.append(Measurement(who, "cpu_s", res[f"{who}_cold_cpu_s"], label=label, detail=detail))
        if f"{who}_longest_unit_s" in res:  # the wall time's floor on a host with a core per unit
            rows.append(Measurement(who, "unit_s", res[f"{who}_longest_unit_s"], label=label,
                                    detail={**detail, "unit": res[f"{who}_longest_unit"],
                                            "units": res.get(f"{who}_unit_s", {})}))
    rows.append(Measurement("fivar", "hit_us", res["in_process_hit_us"], label=res["in_process_hit_what"]))
    rows.append(Measurement("fivar", "hit_ms", res["fresh_process_disk_hit_ms"], label="fresh process, disk cache",
                            detail={"import_s": res["fresh_process"]["import_s"]}))
    return rows


#: the variants of the cold-start cases, files under benchmarks/compile/
COLD_VARIANTS = ("local_global", "biased_softcap")
COLD_DTYPE, COLD_HEAD_DIM = "bf16", 128


def variants_dir() -> Path:
    from ..runner import repo_root
    root = repo_root()
    return (root if root else Path.cwd()) / "benchmarks" / "compile"


def _child(mode: str, file: str, timeout_s: float) -> dict:
    """`python -m fivar.bench.compile_time --mode MODE --file FILE` in a process of its own (fresh caches): its
    report, or {"error": its last line}."""
    import fivar
    with tempfile.TemporaryDirectory(prefix="fivar-compile-suite-") as tmp:
        out = Path(tmp) / "res.json"
        pkg_root = str(Path(fivar.__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")]))}
        try:
            p = subprocess.run([sys.executable, "-m", "fivar.bench.compile_time", "--mode", mode, "--file", file,
                                "--dtype", COLD_DTYPE, "--head-dim", str(COLD_HEAD_DIM), "--json", str(out)],
                               env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"{mode}: no result within {timeout_s:.0f} s"}
        if p.returncode or not out.exists():
            err = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"error": f"{mode}: {err[0][:400]}"}
        return json.loads(out.read_text())


def cold_start_rows(build: dict, first: dict, flex: dict) -> list[Measurement]:
    """Rows of one variant's cold build, cold first prefill and Flex first call (a report with "skipped": no rows;
    with "error": one error row for that contender)."""
    rows = []
    if "error" in build:
        rows.append(Measurement("fivar build", "s", None, "error", detail={"error": build["error"]}))
    else:
        label = f"{build['modules']} modules ({'+'.join(build['targets'])}), fivar build"
        detail = {"modules": build["modules"], "module_s": build["module_s"], "jobs": build["jobs"],
                  "cores": build["cores"], "arch": build["arch"], "nvcc": build["nvcc"]}
        rows.append(Measurement("fivar build", "s", build["build_s"], label=label, detail=detail))
        rows.append(Measurement("fivar build", "cpu_s", build["build_cpu_s"], label=label, detail=detail))
    if "error" in first:
        rows.append(Measurement("fivar first call", "s", None, "error", detail={"error": first["error"]}))
    elif "skipped" not in first:
        detail = {"ran_on": first["first_ran"], "max_diff": first["max_diff"], "shape": first["shape"]}
        rows.append(Measurement("fivar first call", "s", first["first_result_s"],
                                label=f"first result ({first['first_ran']}), cold cache", detail=detail))
        rows.append(Measurement(f"fivar {first['target']} in use", "s", first["in_use_s"],
                                label=f"until a call runs on {first['target']} ({first['modules']} modules)",
                                detail={"build_done_s": first["build_done_s"], "shape": first["shape"]}))
    if "error" in flex:
        rows.append(Measurement("flex", "s", None, "error", detail={"error": flex["error"]}))
    elif "skipped" not in flex:
        rows.append(Measurement("flex", "s", flex["first_call_s"], label="first call: torch.compile + block mask",
                                detail={"block_mask_s": flex["block_mask_s"], "second_call_ms": flex["second_call_ms"],
                                        "shape": flex["shape"]}))
    return rows


def measure_cold_start(name: str, timeout_s: float = 3600) -> list[Measurement]:
    import torch
    file = str(variants_dir() / f"{name}.py")
    build = _child("build", file, timeout_s)
    gpu = torch.cuda.is_available()  # the first calls run kernels: without a GPU they have no rows
    skip = {"skipped": "no CUDA GPU"}
    first = _child("first-prefill", file, timeout_s) if gpu else skip
    flex = _child("flex", file, timeout_s) if gpu else skip
    return cold_start_rows(build, first, flex)


def cold_train_rows(first: dict, flex: dict) -> list[Measurement]:
    """Rows of one variant's cold first training step (forward and backward) and Flex's (a report with "skipped":
    no rows; with "error": one error row for that contender)."""
    rows = []
    for contender, report, label in (("fivar first step", first, "forward + backward, cold caches"),
                                     ("flex", flex, "forward + backward: torch.compile + block mask")):
        if "error" in report:
            rows.append(Measurement(contender, "s", None, "error", detail={"error": report["error"]}))
        elif "skipped" not in report:
            rows.append(Measurement(contender, "s", report["first_step_s"], label=label,
                                    detail={"second_step_ms": report["second_step_ms"], "shape": report["shape"]}))
    return rows


def measure_cold_train(name: str, timeout_s: float = 3600) -> list[Measurement]:
    import torch
    if not torch.cuda.is_available():  # a training step runs kernels
        return []
    file = str(variants_dir() / f"{name}.py")
    return cold_train_rows(_child("first-train", file, timeout_s), _child("flex-train", file, timeout_s))


def cases(quick: bool = False) -> list:
    from ...jit.targets import FLASHINFER_TARGETS
    out = []
    for target in FLASHINFER_TARGETS:
        out.append(Case("compile", f"{VARIANT} {target} cold build + hits", "build",
                        {"variant": VARIANT, "target": target, "op": "single_prefill", "dtype": "bf16", "head_dim": 128},
                        lambda t=target: Prepared(measure=lambda: measure(t)), baseline="flashinfer"))
    for name in COLD_VARIANTS:
        out.append(Case("compile", f"{name} cold build + first call vs Flex", "cold_start",
                        {"variant": name, "file": f"benchmarks/compile/{name}.py", "dtype": COLD_DTYPE,
                         "head_dim": COLD_HEAD_DIM, **FIRST_CALL},
                        lambda n=name: Prepared(measure=lambda: measure_cold_start(n)), baseline="flex"))
        out.append(Case("compile", f"{name} cold first training step vs Flex", "cold_train",
                        {"variant": name, "file": f"benchmarks/compile/{name}.py", "dtype": COLD_DTYPE,
                         "head_dim": COLD_HEAD_DIM, **FIRST_CALL},
                        lambda n=name: Prepared(measure=lambda: measure_cold_train(n)), baseline="flex"))
    return out
