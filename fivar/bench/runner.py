"""The benchmark runner: named suites of cases, built in one parallel pass, every contender checked against its
reference before anything is timed, tidy JSON-lines rows appended to one results file per GPU model.

A case is cheap to list (no tensors, no GPU): `prepare()` allocates its inputs and contenders when it runs, and
`modules()` names the fivar modules it needs, so one parallel ninja builds every case's modules up front.

Row format (one measurement a row; `benchmarks/README.md` has the table): the machine and versions (gpu, driver,
flashinfer, torch, triton, fivar, commit, date, run), what ran (suite, case, op, shape, contender, label), the
number (metric, value, unit direction in `LOWER_IS_BETTER`), `ratio` against the case's `baseline` contender timed
in the same run (> 1: better than the baseline, whatever the metric), and `check`: pass, fail (did not match the
reference, never timed) or error (did not build or run; `detail` says why).
"""
from __future__ import annotations

import contextvars
import datetime
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

from .. import config
from ..testing import CheckResult
from .contenders import Contender
from .harness import Row, evaluate

#: metrics where a smaller value is better; every other metric is a rate or a share (larger is better)
LOWER_IS_BETTER = {"ms", "s", "cpu_s", "unit_s", "us", "hit_us", "hit_ms"}
ROW_FIELDS = ("gpu", "driver", "flashinfer", "torch", "triton", "fivar", "commit", "date", "run", "suite", "case",
              "op", "shape", "contender", "label", "metric", "value", "ratio", "baseline", "check", "detail")
CHECKS = ("pass", "fail", "error")


@dataclass
class Measurement:
    """A number measured without the timing loop (build seconds, cache-hit latency)."""
    contender: str
    metric: str
    value: float | None
    check: str = "pass"
    label: str = ""
    detail: dict = field(default_factory=dict)


@dataclass
class Prepared:
    """A case ready to run: contenders and their check (timed by the runner), or `measure` (measures itself)."""
    contenders: list[Contender] = field(default_factory=list)
    check: Callable[[Contender], CheckResult] | None = None
    flops: float = 0.0  # useful work: tflops_useful = flops / time
    nbytes: float = 0.0  # minimal bytes moved: tbps_useful = nbytes / time
    measure: Callable[[], list[Measurement]] | None = None
    memory_bound: bool | None = None  # judged by % of copy (else % of matmul); default: when there is no flops count
    detail: dict = field(default_factory=dict)  # facts of the case every row's detail carries (a mask's kept share)

    @property
    def judged_by_copy(self) -> bool:
        return not self.flops if self.memory_bound is None else self.memory_bound


@dataclass
class Case:
    suite: str
    name: str
    op: str
    shape: dict
    prepare: Callable[[], Prepared]
    #: the contender ratios are taken against; a tuple: the first of them that ran (a fallback for a baseline that
    #: cannot run some cases)
    baseline: str | tuple[str, ...] | None = None
    modules: Callable[[], list] = list  # fivar modules to build before the run (one parallel ninja)
    #: runs the case's stock FlashInfer contenders once at a tiny shape, so that FlashInfer JIT-builds their modules
    #: in the prebuild (in threads, side by side) rather than one after another inside the timed run
    warm_stock: Callable[[], None] | None = None


@dataclass
class Options:
    rounds: int = 5
    warmup_ms: float = 100.0
    rep_ms: float = 300.0
    device: str = "cuda"
    quick: bool = False
    clocks: object = None  # a gpu_clocks.ClockTrace: each timed row's detail gets the clock it ran at

    @classmethod
    def make(cls, rounds: int | None = None, quick: bool = False, device: str = "cuda") -> "Options":
        if quick:  # a smoke run: the same cases at fewer shapes (the suites' choice), shorter timing
            return cls(rounds=rounds or 2, warmup_ms=25.0, rep_ms=100.0, device=device, quick=True)
        return cls(rounds=rounds or 5, device=device)


# ---------------------------------------------------------------------------------------------------- rows

def ratio(metric: str, value: float | None, baseline_value: float | None) -> float | None:
    """How many times better than the baseline (> 1: better), for either direction of metric."""
    if value is None or baseline_value is None or value <= 0 or baseline_value <= 0:
        return None
    return baseline_value / value if metric in LOWER_IS_BETTER else value / baseline_value


def add_ratios(rows: list[dict], baseline: str | tuple[str, ...] | None) -> list[dict]:
    """Set each row's ratio against the `baseline` contender's row of the same metric (same case, same run); a
    tuple of contenders: the first with a passing row."""
    if isinstance(baseline, tuple):
        ran = {r["contender"] for r in rows if r["check"] == "pass"}
        baseline = next((b for b in baseline if b in ran), baseline[0] if baseline else None)
    base = {r["metric"]: r["value"] for r in rows if r["contender"] == baseline and r["check"] == "pass"}
    for r in rows:
        r["baseline"] = baseline
        r["ratio"] = ratio(r["metric"], r["value"], base.get(r["metric"])) if r["check"] == "pass" else None
    return rows


def timed_rows(rows: list[Row], prepared: Prepared, ceilings: dict | None) -> list[dict]:
    """Tidy rows (contender, metric, value, check, detail) of harness rows: ms, and the throughputs the case's
    work defines; a contender that failed its check or raised gets one row with no value."""
    out = []
    for r in rows:
        base = {"contender": r.contender, "label": r.label}
        if r.status != "ok":
            check = "fail" if r.status == "failed" else "error"
            out.append({**base, "metric": "ms", "value": None, "check": check, "detail": _clean(r.check)})
            continue
        detail = {"rel_err": r.check.get("rel_err"), "max_err": r.check.get("max_err")}
        out.append({**base, "metric": "ms", "value": r.median_ms, "check": "pass",
                    "detail": {**detail, "spread_ms": list(r.spread_ms), "samples": len(r.samples_ms)}})
        if prepared.flops:
            out.append({**base, "metric": "tflops_useful", "value": prepared.flops / r.median_ms / 1e9, "check": "pass",
                        "detail": detail})
            if ceilings and not prepared.judged_by_copy:
                out.append({**base, "metric": "pct_of_matmul", "check": "pass", "detail": detail,
                            "value": 100 * prepared.flops / r.median_ms / 1e9 / ceilings["bf16_matmul_tflops"]})
        if prepared.nbytes:
            out.append({**base, "metric": "tbps_useful", "value": prepared.nbytes / r.median_ms / 1e9, "check": "pass",
                        "detail": detail})
            if ceilings and prepared.judged_by_copy:
                out.append({**base, "metric": "pct_of_copy", "check": "pass", "detail": detail,
                            "value": 100 * prepared.nbytes / r.median_ms / 1e9 / ceilings["copy_tb_per_s"]})
    return out


def _clean(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()}


def run_case(case: Case, opts: Options, timer=None, ceilings: dict | None = None) -> list[dict]:
    """Rows of one case (without the environment fields). Never raises: a case that cannot be prepared gives one
    error row naming what failed, a contender that raises an error row of its own."""
    spans: dict[str, list] = {}  # contender -> wall-clock spans of its samples (for the clock trace)
    import torch
    # the same inputs on every run of the case (random document lengths, tables): runs compare across commits
    torch.manual_seed(zlib.crc32(case.name.encode()))
    try:
        prepared = case.prepare()
        if prepared.measure is not None:
            rows = [{"contender": m.contender, "label": m.label, "metric": m.metric, "value": m.value,
                     "check": m.check, "detail": m.detail} for m in prepared.measure()]
        else:
            if timer is None:
                from .timing import time_interleaved
                timer = partial(time_interleaved, rounds=opts.rounds, warmup_ms=opts.warmup_ms, rep_ms=opts.rep_ms,
                                device=opts.device,
                                on_sample=lambda n, prev, t0, t1, ms: spans.setdefault(n, []).append((t0, t1)))
            got = evaluate(prepared.contenders, prepared.check, flops=prepared.flops, nbytes=prepared.nbytes,
                           seqlen=case.shape.get("seqlen", 0), rounds=opts.rounds, device=opts.device,
                           ceilings=None, timer=timer)
            rows = timed_rows(got, prepared, ceilings)
        for r in rows:
            r["detail"] = {**prepared.detail, **r["detail"]}
    except Exception as e:  # the case itself (inputs, plans, a wrapper) failed: say so and go on
        rows = [{"contender": "*", "label": "", "metric": "ms", "value": None, "check": "error",
                 "detail": {"error": f"{type(e).__name__}: {e}"[:400],
                            "where": traceback.format_exc(limit=-3)[-800:]}}]
    for r in rows:
        r.update(suite=case.suite, case=case.name, op=case.op, shape=case.shape)
        if opts.clocks is not None and r["metric"] == "ms" and r["contender"] in spans:
            seen = [opts.clocks.during(t0, t1) for t0, t1 in spans[r["contender"]]]
            seen = [x for x in seen if x["n"]]
            if seen:  # the SM clock and board power while this contender was timed
                r["detail"]["mhz"] = sorted(x["mhz"] for x in seen)[len(seen) // 2]
                r["detail"]["watts"] = sorted(x["watts"] for x in seen)[len(seen) // 2]
    return add_ratios(rows, case.baseline)


def summary(case: Case, rows: list[dict]) -> str:
    """One log line per case: each contender's headline number, its ratio, or why it has none."""
    parts = []
    for r in rows:
        if r["metric"] not in ("ms", "s", "hit_us", "hit_ms"):
            continue
        if r["check"] != "pass":
            why = r["detail"].get("error") or f"rel err {r['detail'].get('rel_err')}"
            parts.append(f"{r['contender']} {r['check'].upper()} ({str(why)[:80]})")
        else:
            x = f" {r['ratio']:.2f}x" if r["ratio"] is not None and r["contender"] != r["baseline"] else ""
            parts.append(f"{r['contender']} {r['value']:.4g} {r['metric']}{x}")
    return f"[{case.suite}] {case.name}: " + ", ".join(parts)


# ------------------------------------------------------------------------------------------- environment

def gpu_slug(name: str) -> str:
    """results file stem of a GPU name: its model ("NVIDIA H100 80GB HBM3" -> h100), else the whole name."""
    words = re.sub(r"[^a-z0-9]+", " ", name.lower()).split()
    words = [w for w in words if w not in ("nvidia", "tesla")]
    for w in words:
        if re.fullmatch(r"[a-z]{1,3}\d{2,4}[a-z]?", w):
            return w
    return "-".join(words) or "unknown"


def repo_root() -> Path | None:
    """The checkout fivar runs from (None from an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "benchmarks").is_dir() and (root / "fivar").is_dir() else None


def default_results_dir() -> Path:
    root = repo_root()
    return (root if root else Path.cwd()) / "benchmarks" / "results"


def _git_commit() -> str | None:
    root = repo_root()
    if root is None:
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if dirty else "")) or None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        return out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict:
    """The fields every row of this run carries."""
    import torch

    import fivar
    versions = {}
    for mod in ("flashinfer", "triton"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = None
    now = datetime.datetime.now(datetime.timezone.utc)
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "driver": _driver(),
            "flashinfer": versions["flashinfer"], "torch": torch.__version__, "triton": versions["triton"],
            "fivar": fivar.__version__, "commit": _git_commit(), "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "run": now.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"}


# ----------------------------------------------------------------------------------------------- the run

def select(cases: list[Case], filters: list[str] | None) -> list[Case]:
    """Cases whose name matches any filter: a glob (`softcap*8192*`) or a substring."""
    if not filters:
        return cases
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, f) or f in c.name for f in filters)]


def prebuild(cases: list[Case], log=print) -> None:
    """Every fivar module the cases need, cold ones in one parallel ninja (as `fivar build --prewarm`), then their
    stock FlashInfer modules (warm_stock). A module that fails here fails again, named, in the contender that calls
    it: that contender's row says error."""
    from ..jit.build import build_many
    from ..jit.prewarm import configure_jobs
    modules = {}
    for c in cases:
        try:
            for m in c.modules():
                modules[m.uri] = m
        except Exception as e:
            log(f"[{c.suite}] {c.name}: cannot list its modules ({type(e).__name__}: {e}); they build on first call")
    t0 = time.perf_counter()
    try:
        todo = [m for m in modules.values() if not m.manifest_ok()]
        jobs, why = configure_jobs(None)
        if todo:
            log(f"build: {len(todo)} of {len(modules)} module(s), {jobs} nvcc job(s) ({why})")
            build_many(todo, parallel=True)
        else:
            log(f"build: all {len(modules)} module(s) up to date")
    except Exception as e:
        log(f"build: {type(e).__name__}: {str(e)[:300]}; the contenders that need it report the error")
    warm_stock(cases, log)
    log(f"build: {time.perf_counter() - t0:.0f} s")


def warm_stock(cases: list[Case], log=print) -> None:
    """The cases' stock FlashInfer modules, built side by side: each case's `warm_stock` in a thread of its own
    (FlashInfer's JIT builds a module under its own file lock, so different modules build at once). A case whose
    warm-up fails is logged; its contender then builds, or reports the error, in the run."""
    from concurrent.futures import ThreadPoolExecutor
    warm = [c for c in cases if c.warm_stock is not None]
    if not warm:
        return
    t0 = time.perf_counter()

    def one(c: Case):
        try:
            c.warm_stock()
        except Exception as e:  # noqa: BLE001 - reported, and again by the contender in the run
            log(f"[{c.suite}] {c.name}: stock warm-up: {type(e).__name__}: {str(e)[:200]}")
    # each in a copy of this thread's context (a new thread starts from an empty one): --contender holds there
    runs = [(contextvars.copy_context(), c) for c in warm]
    with ThreadPoolExecutor(min(16, len(warm))) as pool:
        list(pool.map(lambda r: r[0].run(one, r[1]), runs))
    log(f"build: stock FlashInfer modules of {len(warm)} case(s) warm, {time.perf_counter() - t0:.0f} s")


def run(cases: list[Case], opts: Options, results_dir: Path | None = None, build: bool = True, log=print,
        timer=None, env: dict | None = None) -> list[dict]:
    """Run the cases in order, appending each case's rows to `<results_dir>/<gpu-slug>.jsonl` as it finishes
    (a run cut short keeps what it measured). Returns every row."""
    with config.override(cold_start="wait"):  # a default call times its modules, never the Triton twin meanwhile
        return _run(cases, opts, results_dir, build, log, timer, env)


def _run(cases: list[Case], opts: Options, results_dir: Path | None, build: bool, log, timer, env: dict | None):
    env = env or environment()
    results_dir = Path(results_dir or default_results_dir())
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{gpu_slug(env['gpu'])}.jsonl"
    log(f"{len(cases)} case(s) on {env['gpu']} (driver {env['driver']}, FlashInfer {env['flashinfer']}, torch "
        f"{env['torch']}, commit {env['commit']}) -> {path}")
    if build:
        prebuild(cases, log)
    ceilings = None
    if opts.device != "cpu" and any(c.suite != "compile" for c in cases):
        try:
            from . import ceilings as ceil_mod
            ceilings = ceil_mod.get()
        except Exception as e:
            log(f"ceilings: {type(e).__name__}: {e} (no % of copy / matmul rows)")
    everything = []
    for i, case in enumerate(cases):
        rows = [{**env, **r} for r in run_case(case, opts, timer=timer, ceilings=ceilings)]
        rows = [{k: r.get(k) for k in ROW_FIELDS} for r in rows]
        with path.open("a") as f:
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
        log(summary(case, rows))
        everything += rows
        if opts.device != "cpu":
            import torch
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except RuntimeError as e:  # a kernel fault is sticky: the process's CUDA context is gone
                left = [c.name for c in cases[i + 1:]]
                log(f"CUDA error after [{case.suite}] {case.name} ({str(e).splitlines()[0][:160]}): this process "
                    f"cannot run more GPU work; {len(left)} case(s) not run: {', '.join(left) or '-'} (run them "
                    "with --case, each in its own process)")
                break
    log(f"wrote {len(everything)} row(s) to {path}")
    return everything


def validate_row(row: dict) -> None:
    """Raise ValueError unless `row` is a results row: every field, a known check, a value only when checked."""
    missing = [k for k in ROW_FIELDS if k not in row]
    if missing:
        raise ValueError(f"results row lacks {missing}")
    if row["check"] not in CHECKS:
        raise ValueError(f"check must be one of {CHECKS}, got {row['check']!r}")
    if row["check"] != "pass" and (row["value"] is not None or row["ratio"] is not None):
        raise ValueError(f"{row['contender']}: a contender that did not pass its check has no value")
    if row["check"] == "pass" and not (isinstance(row["value"], (int, float)) and row["value"] >= 0):
        raise ValueError(f"{row['contender']}: a passing row needs a value")


def main(argv=None) -> int:
    import argparse

    from .suites import SUITES, cases_of
    ap = argparse.ArgumentParser(prog="python -m fivar.bench", description="Run benchmark suites; append rows to "
                                 "benchmarks/results/<gpu>.jsonl (render: python -m fivar.bench.render).")
    ap.add_argument("--suite", action="append", choices=sorted(SUITES), help="a suite to run (repeatable)")
    ap.add_argument("--case", action="append", metavar="FILTER", help="only cases matching (glob or substring; "
                    "repeatable)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; --quick 2)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes and rounds: a smoke run")
    ap.add_argument("--results", type=Path, default=None, help=f"results folder (default {default_results_dir()})")
    ap.add_argument("--list", action="store_true", help="list the cases and exit (no GPU needed)")
    ap.add_argument("--contender", action="append", metavar="PATTERN", help="only contenders matching (glob; "
                    "repeatable): the others are never built or timed")
    ap.add_argument("--no-build", action="store_true", help="skip the parallel prebuild (modules build on first call)")
    ap.add_argument("--build-only", action="store_true", help="only the parallel prebuild (a cold build can be split "
                    "over several shorter commands: an interrupted one resumes where it stopped)")
    ap.add_argument("--clock-trace", action="store_true", help="sample the SM clock and board power (nvidia-smi) and "
                    "put the median of each timed contender's samples in its row's detail")
    args = ap.parse_args(argv)
    if not args.suite:
        ap.error(f"name at least one --suite ({', '.join(sorted(SUITES))})")
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be at least 1")
    cases = select([c for s in args.suite for c in cases_of(s, quick=args.quick)], args.case)
    from .contenders import SELECTED
    # set for this run only: a caller that runs main again (or a test) gets every contender unless it names some
    token = SELECTED.set(frozenset(args.contender) if args.contender else None)
    try:
        return _run_cases(args, cases, ap)
    finally:
        SELECTED.reset(token)


def _run_cases(args, cases: list[Case], ap) -> int:
    if args.list:
        for c in cases:
            print(f"{c.suite}\t{c.name}\tbaseline={c.baseline}")
        return 0
    if not cases:
        ap.error("no case matches --case " + " ".join(args.case or []))
    import torch
    if not torch.cuda.is_available():
        print("python -m fivar.bench times kernels: it needs a CUDA GPU (--list works anywhere)", file=sys.stderr)
        return 1
    if args.build_only:
        prebuild(cases, log=lambda s: print(s, flush=True))
        return 0
    opts = Options.make(args.rounds, args.quick)
    log = lambda s: print(s, flush=True)  # noqa: E731
    if not args.clock_trace:
        run(cases, opts, args.results, build=not args.no_build, log=log)
        return 0
    from .gpu_clocks import ClockTrace, cuda_device_ids
    with ClockTrace(gpus=cuda_device_ids()) as trace:
        if trace.error:
            log(f"clock trace: {trace.error}")
        opts.clocks = trace
        run(cases, opts, args.results, build=not args.no_build, log=log)
    return 0
