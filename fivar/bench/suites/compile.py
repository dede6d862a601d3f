"""Build costs: a cold build of fivar's single-prefill module of `softcap` (FA2, and FA3 on Hopper) against
FlashInfer's own module of the same op built in the same run (FA3: FlashInfer's stock soft-cap single-prefill module),
and the cache hits after it (in process, and a fresh process reading the disk cache). Each case runs
fivar.bench.compile_time in its own process with a fresh FlashInfer workspace and fivar cache, so both builds are cold.
Rows: wall seconds with the host's cores (`s`, ninja at fivar's default job count), CPU seconds (`cpu_s`) and the
longest nvcc unit (`unit_s`, which bounds the wall time however many cores there are)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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


def cases(quick: bool = False) -> list:
    out = []
    for target in ("fa2", "fa3"):
        out.append(Case("compile", f"{VARIANT} {target} cold build + hits", "build",
                        {"variant": VARIANT, "target": target, "op": "single_prefill", "dtype": "bf16", "head_dim": 128},
                        lambda t=target: Prepared(measure=lambda: measure(t)), baseline="flashinfer"))
    return out
