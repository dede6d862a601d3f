"""The Triton emitter's tile bounds (TritonEmitter.interval, behind a gather's one-element test and the backward's
`fv_grad_tile`): for an index of q_idx and kv_idx, [lo, hi] over a tile's query and key ranges must hold every pair's
value, and be one value where the index cannot vary (a bucket of far distances). Checked by evaluating the bound
expressions on random tiles against every pair, the pair's own value being the bound of a one-pair tile."""
import math
import random

import pytest

from fivar import AttentionVariant, Tensor, abs as fv_abs, log, maximum, minimum, sqrt, where
from fivar.codegen.triton import TritonEmitter
from fivar.config import override


def _t5(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    n = maximum(q_idx - kv_idx, 0)
    far = 16 + int(log(float(maximum(n, 1)) / 16.0) / log(128.0 / 16.0) * 16.0)
    return score + params.table[where(n < 16, n, minimum(far, 31)), qo_head]


def _two_sided(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    d = kv_idx - q_idx
    far = 8 + int(sqrt(float(fv_abs(d))) / -2.0 * -3.0)
    return score + params.table[where(d > -8, where(d < 8, d + 8, minimum(far + 8, 31)), maximum(23 - far, 0)), qo_head]


def _mixed(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.table[minimum(fv_abs(q_idx - 2 * kv_idx), 31), qo_head]


def _buckets(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.table[minimum(maximum(q_idx - kv_idx, 0) // 24, 3) + maximum((kv_idx - q_idx) // -40, -2) + 2,
                                qo_head]


CASES = {"t5": _t5, "two_sided": _two_sided, "mixed": _mixed, "buckets": _buckets}
TL = type("tl", (), {"minimum": staticmethod(min), "maximum": staticmethod(max), "abs": staticmethod(abs),
                     "where": staticmethod(lambda c, a, b: a if c else b), "log": staticmethod(
                         lambda x: math.log(x) if x > 0 else (float("-inf") if x == 0 else float("nan"))),
                     "sqrt": staticmethod(lambda x: math.sqrt(x) if x >= 0 else float("nan")),
                     "cast": staticmethod(lambda x, t: t(x)), "int32": lambda x: int(x) if x == x and abs(x) < 2**31
                     else (0 if x != x else (2**31 - 1 if x > 0 else -2**31)), "float32": float})


def _bounds(fn):
    v = AttentionVariant(name="tile_bounds", logits=fn, params={"table": Tensor("float32", ("bucket", "qo_head"))})
    with override(position_tables="off"):
        emit = TritonEmitter(v)
        emit.let_exprs = dict(emit.lowered.logits.lets)
        load = next(n for n in emit.walk_lets(emit.lowered.logits.result) if getattr(n, "param", "") == "table")
        ranges = emit.tile_ranges(load)
        hoisted = {emit.hoisted_names[h]: emit.fold(e) for h, e in emit.lowered.hoisted.items()}  # log(128 / 16)
    assert ranges is not None, "the index is bounded over a tile"
    code = [compile(x, "<bound>", "eval") for x in ranges[0]]
    env = {"tl": TL, "_fv_nan_to": lambda x, b: x if x == x else b, "float": float, "_py_floordiv": lambda a, b: a // b,
           **hoisted}
    return lambda q_lo, q_hi, kv_lo, kv_hi: tuple(
        eval(c, env, {"fv_q_lo": q_lo, "fv_q_hi": q_hi, "fv_kv_lo": kv_lo, "fv_kv_hi": kv_hi})  # noqa: S307
        for c in code)


@pytest.mark.parametrize("name", sorted(CASES))
def test_tile_bounds_hold_every_pair(name):
    bounds = _bounds(CASES[name])
    rng = random.Random(name)
    one_value = 0
    for _ in range(120):
        q_lo, kv_lo = rng.randrange(0, 3000), rng.randrange(0, 3000)
        if rng.random() < 0.5:  # near the diagonal, where the buckets change
            kv_lo = max(0, q_lo + rng.randrange(-200, 40))
        q_hi, kv_hi = q_lo + rng.choice([0, 1, 7, 15]), kv_lo + rng.choice([0, 1, 7, 15])
        lo, hi = bounds(q_lo, q_hi, kv_lo, kv_hi)
        values = {bounds(q, q, kv, kv)[0] for q in range(q_lo, q_hi + 1) for kv in range(kv_lo, kv_hi + 1)}
        assert all(lo <= x <= hi for x in values), (name, (q_lo, q_hi, kv_lo, kv_hi), (lo, hi), sorted(values))
        one_value += lo == hi
    assert one_value > 0  # far tiles are found to read one element (not only a loose hull)


def test_one_pair_bounds_are_the_pairs_value():
    """The degenerate tile's bound is the index itself (what the containment test above relies on): T5's buckets."""
    bounds = _bounds(_t5)
    for d in (0, 1, 15, 16, 17, 40, 127, 128, 129, 5000):
        n = max(d, 0)
        expect = n if n < 16 else min(16 + int(math.log(max(n, 1) / 16.0) / math.log(8.0) * 16.0), 31)
        assert bounds(d, d, 0, 0) == (expect, expect)
