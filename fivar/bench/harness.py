"""`fivar bench`: correctness first, then interleaved (or, with `sustained`, back-to-back) timing, then numbers
against measured ceilings.

A contender whose output does not match its reference is reported as failed and never timed; one that
raises is reported as an error. Every figure is a median over rounds with its spread, and every ratio is
taken between contenders timed in the same run.
"""
from __future__ import annotations

import math
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..testing import CheckResult, compare
from .contenders import Contender, Problem, contenders, make_problem, plain
from .timing import attention_flops, decode_kv_bytes, time_interleaved, time_sustained
from .work import attention_bytes, kept_fraction

SCHEMA = "fivar.bench/1"
CHECK_ROWS = 256  # query rows checked against the reference (the full reference would not fit)


@dataclass
class Row:
    seqlen: int
    contender: str
    label: str
    status: str  # ok | failed | error
    check: dict = field(default_factory=dict)
    samples_ms: list = field(default_factory=list)
    median_ms: float | None = None
    spread_ms: tuple | None = None
    tflops: float | None = None
    tb_per_s: float | None = None
    pct_of_matmul: float | None = None
    pct_of_copy: float | None = None
    ratio_vs: dict = field(default_factory=dict)


def evaluate(contenders_: list[Contender], check: Callable[[Contender], CheckResult], *, flops: float,
             nbytes: float, seqlen: int, rounds: int, device: str, ceilings: dict | None,
             sustained_s: float = 0.0, timer=None) -> list[Row]:
    """Check every contender, then time the ones that passed: interleaved rounds, or with `sustained_s` each alone
    for that long after 1 s untimed (timing.time_sustained); `timer(fns)` -> {name: Timing} replaces both."""
    rows, timed = [], {}
    for c in contenders_:
        try:
            r = check(c)
        except Exception as e:  # a contender that cannot run is reported, not hidden
            rows.append(Row(seqlen, c.name, c.label, "error", {"error": f"{type(e).__name__}: {e}"[:400]}))
            continue
        row = Row(seqlen, c.name, c.label, "ok" if r.passed else "failed",
                  {"rel_err": r.rel_err, "max_err": r.max_err, "passed": r.passed, "case": r.case})
        rows.append(row)
        if r.passed:
            timed[c.name] = c.fn
    if not timed:
        timings = {}
    elif timer is not None:
        timings = timer(timed)
    elif sustained_s:
        timings = time_sustained(timed, sustained_s, device=device)
    else:
        timings = time_interleaved(timed, rounds=rounds, device=device)
    for row in rows:
        t = timings.get(row.contender)
        if t is None:
            continue
        row.samples_ms, row.median_ms, row.spread_ms = t.samples_ms, t.median, t.spread
        row.tflops = flops / t.median / 1e9
        row.tb_per_s = nbytes / t.median / 1e9
        if ceilings:
            row.pct_of_matmul = 100 * row.tflops / ceilings["bf16_matmul_tflops"]
            row.pct_of_copy = 100 * row.tb_per_s / ceilings["copy_tb_per_s"]
    for row in rows:
        if row.median_ms is not None:
            row.ratio_vs = {o.contender: o.median_ms / row.median_ms for o in rows
                            if o.median_ms is not None and o is not row}
    return rows


def _checker(variant, p: Problem):
    t = p.tensors

    def check(c: Contender) -> CheckResult:
        if c.reference is not None:  # a yardstick computing a function of its own
            ref_variant, params, causal = c.reference
        else:
            ref_variant = variant if c.checks_variant else plain(variant)
            params, causal = (p.params if c.checks_variant else {}), p.causal
        out = c.fn()
        if p.op == "prefill":
            n = min(CHECK_ROWS, p.seqlen)
            ref = ref_variant.reference(t["q"][-n:], t["k"], t["v"], causal=causal, **params)
            return compare(variant.name, f"{c.name} last {n} rows", out[-n:], ref, p.dtype)
        if p.op == "batch-prefill":
            b, n = p.batch - 1, min(CHECK_ROWS, p.seqlen)
            s = slice(b * p.seqlen, (b + 1) * p.seqlen)
            ref = ref_variant.reference(t["q"][s][-n:], t["k"][s], t["v"][s], causal=causal, batch_idx=b,
                                        batch_size=p.batch, **params)
            return compare(variant.name, f"{c.name} request {b}, last {n} rows", out[s][-n:], ref, p.dtype)
        outs, refs = [], []
        for b in range(min(4, p.batch)):
            s = slice(b * p.seqlen, (b + 1) * p.seqlen)
            refs.append(ref_variant.reference(t["q"][b:b + 1], t["k"][s], t["v"][s], batch_idx=b, batch_size=p.batch,
                                              **params))
            outs.append(out[b:b + 1])
        return compare(variant.name, f"{c.name} first {len(outs)} requests", torch.cat(outs), torch.cat(refs), p.dtype)
    return check


def work(variant, p: Problem) -> tuple[float, float]:
    if p.op == "decode":
        flops = attention_flops(1, p.seqlen, p.num_qo_heads, p.head_dim, False, batch=p.batch)
        return flops, decode_kv_bytes([p.seqlen] * p.batch, p.num_kv_heads, p.head_dim,
                                      (p.kv_dtype or p.dtype).itemsize)
    flops = attention_flops(p.seqlen, p.seqlen, p.num_qo_heads, p.head_dim, p.causal, batch=p.batch)
    flops *= kept_fraction(variant, p.params, qo_len=p.seqlen, kv_len=p.seqlen, num_qo_heads=p.num_qo_heads,
                           num_kv_heads=p.num_kv_heads, causal=p.causal, device=p.device, batch_size=p.batch)
    nbytes = attention_bytes(p.seqlen, p.seqlen, p.num_qo_heads, p.num_kv_heads, p.head_dim, p.dtype.itemsize,
                             p.batch)
    return flops, nbytes


def run(variant, *, op="prefill", seqlens=(1024, 4096, 8192), batch=1, heads=(32, 32), head_dim=128,
        dtype=torch.bfloat16, causal=False, vs=("stock", "triton", "flex"), rounds=4, device="cuda",
        ceilings: dict | None = None, progress=print, params: dict | None = None, sustained_s: float = 0.0) -> dict:
    """Check, then time, every contender at each length; `params` sets scalar params (else the variant's
    example values); `sustained_s` > 0 times each contender alone for that long in place of `rounds`."""
    import flashinfer

    import fivar
    rows: list[Row] = []
    for S in seqlens:
        p = make_problem(variant, op, S, batch, heads, head_dim, dtype, causal, device, params=params)
        flops, nbytes = work(variant, p)
        got = evaluate(contenders(variant, p, list(vs)), _checker(variant, p), flops=flops, nbytes=nbytes,
                       seqlen=S, rounds=rounds, device=device, ceilings=ceilings, sustained_s=sustained_s)
        rows += got
        progress(f"S={S}: " + ", ".join(f"{r.contender} {r.tflops:.0f} TF/s" if r.tflops else f"{r.contender} {r.status}"
                                         for r in got))
        del p
        torch.cuda.empty_cache()
    return {
        "schema": SCHEMA, "variant": variant.name, "op": op, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name(device), "host": platform.node(),
        "versions": {"fivar": fivar.__version__, "flashinfer": flashinfer.__version__, "torch": torch.__version__},
        "config": {"seqlens": list(seqlens), "batch": batch, "heads": list(heads), "head_dim": head_dim,
                   "dtype": str(dtype).removeprefix("torch."), "causal": causal, "vs": list(vs), "rounds": rounds,
                   "sustained_s": sustained_s, "params": dict(params or {})},
        "ceilings": ceilings, "results": [asdict(r) for r in rows],
    }


REQUIRED = {"schema", "variant", "op", "gpu", "versions", "config", "ceilings", "results"}
ROW_FIELDS = set(Row.__dataclass_fields__)


def validate(report: dict) -> None:
    """Raise ValueError if `report` is not a fivar.bench/1 document."""
    missing = REQUIRED - set(report)
    if missing or report["schema"] != SCHEMA:
        raise ValueError(f"not a {SCHEMA} report (missing {sorted(missing)})")
    for r in report["results"]:
        if set(r) != ROW_FIELDS:
            raise ValueError(f"result row has fields {sorted(r)}, expected {sorted(ROW_FIELDS)}")
        if r["status"] == "ok" and not (r["median_ms"] and r["samples_ms"] and math.isfinite(r["tflops"])):
            raise ValueError("an ok row needs samples, a median and a throughput")
        if r["status"] != "ok" and r["samples_ms"]:
            raise ValueError("a failed contender must not have been timed")
