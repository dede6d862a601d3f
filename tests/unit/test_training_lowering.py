"""Seeded random variants for the training lowering (fivar.spec.optimize, training=True): logits with learnable
per-head params and a learnable table inside terms of the distance, a score transform beside them, and sometimes a
mask of the distance. Each one trains through the Triton twin (Triton's interpreter, float16) with the position
tables the training lowering makes (logits, derivatives, mask) and its gradients are checked against float64
autograd of the torch reference, which evaluates the user's own function; the lowering must have tabulated
something, so the mechanism under test runs."""
import linecache
import random

import pytest
import torch

import fivar
from fivar import AttentionVariant, Tensor
from fivar.config import override
from fivar.testing import check_gradients

DTYPE = torch.float16
HEADS, TABLE = 2, 6
SEEDS = range(8)


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _distance(r: random.Random) -> str:
    return r.choice(["abs(ki - qi)", "maximum(qi - ki, 0)", "abs(ki - qi) // 3", "minimum(abs(ki - qi), 9)"])


def _term(r: random.Random, depth: int) -> str:
    """A float term of the distance and the head: what the lowering may tabulate."""
    if depth <= 0 or r.random() < 0.25:
        return r.choice([f"float({_distance(r)})", "p.w[h]", "p.u[h]", f"{r.uniform(0.2, 1.5):.2f}",
                         f"p.t[minimum({_distance(r)}, {TABLE - 1}), h]"])
    t = lambda: _term(r, depth - 1)  # noqa: E731
    return r.choice([
        lambda: f"({t()} + {t()})", lambda: f"({t()} * {t()})", lambda: f"log(1.0 + abs({t()}))",
        lambda: f"exp(clamp({t()}, -3.0, 1.0))", lambda: f"tanh({t()})",
        lambda: f"((abs(clamp({t()}, -3.0, 3.0)) + 0.5) ** clamp(p.u[h], 0.25, 1.75))",
        lambda: f"p.t[minimum(int(log(float({_distance(r)}) + 1.0) * 2.0), {TABLE - 1}), h]",
        lambda: f"({t()} if {_distance(r)} < {r.randint(1, 6)} else {t()})",
        lambda: f"({t()} / (1.0 + abs({t()})))",  # a division by a variable: a table, its quotient rule too
    ])()


def _variant(seed: int) -> AttentionVariant:
    r = random.Random(seed)
    # a score scaled by a term of the distance: d logits / d q.k is sm_scale times a table's value
    score = r.choice(["score", "2.0 * tanh(score / 2.0)", "score * 0.75",
                      "score * (1.0 + tanh(float(abs(ki - qi)) / 8.0))"])
    # the last term is always one the lowering tabulates (a log of the distance, a learnable factor)
    body = f"{score} - clamp({_term(r, 3)} + p.w[h] * log(1.0 + float({_distance(r)})), -4.0, 4.0)"
    src = f"def logits_{seed}(score, b, h, kh, qi, ki, p):\n    return {body}\n"
    if r.random() < 0.5:
        src += (f"def mask_{seed}(b, h, kh, qi, ki, p):\n"
                f"    return qi - ki < {r.randint(2, 6)} or (qi - ki) % {r.randint(2, 5)} == {r.randint(0, 1)}\n")
    name = f"<training_lowering_{seed}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    scope = {n: getattr(fivar, n) for n in ("tanh", "exp", "log", "clamp", "minimum", "maximum")}
    exec(compile(src, name, "exec"), scope)
    mask = scope.get(f"mask_{seed}")
    return AttentionVariant(name=f"trained_{seed}", logits=scope[f"logits_{seed}"], mask=mask, params={
        "w": Tensor("float32", ("qo_head",), learnable=True), "u": Tensor("float32", ("qo_head",), learnable=True),
        "t": Tensor("float32", ("bucket", "qo_head"), learnable=True)})


@pytest.mark.parametrize("seed", SEEDS)
def test_random_variant_trains_with_the_training_lowerings_tables(seed):
    v = _variant(seed)
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.rand(HEADS, generator=gen) + 0.1, "u": torch.rand(HEADS, generator=gen) + 0.2,
              "t": torch.randn(TABLE, HEADS, generator=gen)}
    qo_lens, kv_lens = [29, 40], [35, 40]  # off the 16-wide tiles; a request with more keys than queries
    q = torch.randn(sum(qo_lens), HEADS, 16, generator=gen).to(DTYPE)
    k, vv = (torch.randn(sum(kv_lens), 1, 16, generator=gen).to(DTYPE) for _ in range(2))
    with override(position_tables="costly"):
        with override(training=True):
            tables = v.lowered.position_tables
        r = check_gradients(v, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=True, params=params, dtype=DTYPE)
    assert tables, "the draw's log of the distance is a term the lowering tabulates"
    assert r.passed, ("".join(linecache.getlines(f"<training_lowering_{seed}>")), r)


def _guarded_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    # a modulo by the distance, guarded by `or` where the distance is 0: never tabulated (a table holds every
    # distance, 0 too), evaluated per pair as the user wrote it
    return q_idx - kv_idx == 0 or 12 % (q_idx - kv_idx) == 0 or q_idx - kv_idx < 3


GUARDED = AttentionVariant(name="guarded_modulo", mask=_guarded_mask)


def test_a_mask_dividing_by_the_distance_is_evaluated_per_pair():
    with override(position_tables="costly"):
        with override(training=True):
            assert not GUARDED.lowered.position_tables
        q = torch.randn(45, HEADS, 16).to(DTYPE)
        k, vv = (torch.randn(45, 1, 16).to(DTYPE) for _ in range(2))
        r = check_gradients(GUARDED, q, k, vv, qo_lens=[45], kv_lens=[45], causal=True, params={}, dtype=DTYPE)
    assert r.passed, r
