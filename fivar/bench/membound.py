"""Helpers for memory-bound benchmarks (norm/RoPE): a measured copy ceiling, a correctness gate, result rows."""
from __future__ import annotations

import torch

from .timing import time_interleaved


def copy_bandwidth(nbytes: int = 1 << 30) -> tuple[float, float]:
    """(GB/s, ms) of a device-to-device copy, bytes read + written, timed like the contenders."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    t = time_interleaved({"copy": lambda: b.copy_(a)}, rounds=3)["copy"]
    return 2 * nbytes / (t.median * 1e-3) / 1e9, t.median


def close(name: str, got, ref, tol: float = 2e-2):
    """A CheckResult of `got` (a tensor or a tuple of them) against `ref`: relative Frobenius error below `tol`."""
    from ..testing import CheckResult
    if isinstance(got, (tuple, list)):
        got, ref = torch.cat([g.double().flatten() for g in got]), torch.cat([r.double().flatten() for r in ref])
    got, ref = got.double(), ref.double().to(got.device)
    if not torch.isfinite(got).all():
        return CheckResult(name, "norm/rope", float("inf"), float("inf"), False)
    rel = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
    return CheckResult(name, "norm/rope", rel, float((got - ref).abs().max()), rel < tol)


def check_close(name: str, got, ref, tol: float = 2e-2) -> float:
    """Relative Frobenius error; exits (nothing gets timed) if it is not below `tol`."""
    rel = close(name, got, ref, tol).rel_err
    if not rel < tol:
        raise SystemExit(f"{name}: rel err {rel:.3e} >= {tol}: not timing a wrong kernel")
    return rel


def bandwidth_row(case: str, timings: dict, bytes_moved: float, copy_gbs: float, **extra) -> dict:
    """One result row: per contender median, spread, GB/s and % of the copy ceiling."""
    r = dict(case=case, bytes_moved=bytes_moved, **extra)
    for k, t in timings.items():
        r[f"{k}_ms"] = t.median
        r[f"{k}_spread_ms"] = t.spread
        r[f"{k}_GBps"] = bytes_moved / (t.median * 1e-3) / 1e9
        r[f"{k}_pct_copy"] = 100 * r[f"{k}_GBps"] / copy_gbs
    return r
