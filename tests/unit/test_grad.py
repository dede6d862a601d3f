"""Property test of fivar.spec.grad: random logits functions of the grammar (the forward property test's
generator), their derivative IR evaluated by the torch reference evaluator, against torch.autograd through the
reference evaluator itself, in float64:

* d(logit)/d(score) on the parsed program;
* d(true logit)/d(q.k) on the lowered program the kernels inline (folded score scale, hoisted invariants,
  the output factor split off into the softmax scale): `output_scale * D_qk(lowered) == sm_scale * dlogit/dscore`;
* d(logit)/d(table) scattered through each load's clamped index, against autograd's gradient of the table.

Mutations (a wrong rule swapped into the rule tables) must make the check fail.
"""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fivar
from fivar.codegen.torch_ref import TorchEvaluator, eval_scalar
from fivar.spec import grad, ir, optimize
from test_codegen_property import TABLE_LEN, gen_float, make_variant

N = 64  # points per expression
F64 = torch.float64


def _env(r: random.Random, sm_scale: float):
    g = torch.Generator().manual_seed(r.randrange(2**31))
    raw = torch.randn(N, generator=g, dtype=F64) * 3
    ints = lambda lo, hi: torch.randint(lo, hi, (N,), generator=g)  # noqa: E731
    qo_len = 40
    return {"score": raw * sm_scale, "raw": raw, "sm_scale": sm_scale, "batch": ints(0, 4), "qo_head": ints(0, 16),
            "kv_head": ints(0, 4), "q_idx": ints(0, qo_len), "kv_idx": ints(0, 60)}


def _regular_points(variant, env, params) -> torch.Tensor:
    """Points where the function is finite and no sqrt sits at 0 (a finite value with an infinite slope, where
    autograd's 0 or nan depends on the order of its ops)."""
    ev = TorchEvaluator(env, params, F64)
    ok = torch.isfinite(ev.run(variant.ir.logits).expand(N))
    for root in variant.ir.logits.exprs():
        for e in ir.walk(root):
            if isinstance(e, ir.Call) and e.fn == "sqrt":
                ok &= (ev.eval(e.args[0]) != 0).expand(N)
    return ok


def _subset(env, keep):
    return {k: (x[keep] if isinstance(x, torch.Tensor) and x.dim() else x) for k, x in env.items()}


def _autograd(variant, env, params):
    score = env["score"].clone().requires_grad_(True)
    table = params["t"].clone().requires_grad_(True)
    out = TorchEvaluator({**env, "score": score}, {**params, "t": table}, F64).run(variant.ir.logits)
    out = out.expand_as(score)
    total = out.sum() + 0.0 * score.sum() + 0.0 * table.sum()  # a function of neither still has a graph
    d_score, d_table = torch.autograd.grad(total, [score, table])
    return out.detach(), d_score, d_table


def _symbolic(variant, env, params):
    """(d/dscore of the parsed program, d(true logit)/dqk of the lowered one, d/dtable) from the derivative IR."""
    prog = variant.ir.logits
    n = env["score"].shape
    d_score = TorchEvaluator(env, params, F64).run(grad.derivative(prog, grad.WRT_SCORE)).expand(n)
    low = optimize.lower(variant.ir, softmax=True)
    ev = TorchEvaluator(env, params, F64, hoisted=low.hoisted)
    d_qk = ev.run(grad.derivative(low.logits, grad.WRT_QK)).expand(n)
    if low.output_scale is not None:
        d_qk = d_qk * eval_scalar(low.output_scale, params, env["sm_scale"], low.hoisted)
    d_table = torch.zeros_like(params["t"])
    for load in grad.learnable_loads(prog, variant.params, names={"t"}):
        ev = TorchEvaluator(env, params, F64)
        d = ev.run(grad.derivative(prog, load)).expand(n)
        (index,) = load.indices
        d_table.index_add_(0, ev.eval(index).expand(n).clamp(0, TABLE_LEN - 1).long(), d)
    return d_score, d_qk, d_table


def _close(a, b):
    """Equal within float64 rounding; non-finite values must match (a singular point on both sides)."""
    finite = torch.isfinite(a) & torch.isfinite(b)
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((torch.isclose(a, b, rtol=1e-7, atol=1e-9) & finite) | both_nan | (a == b)).all())


def _check_expressions(seed: int, n_expr: int, must_contain: str | None = None):
    """[] when every generated expression's derivatives agree with autograd, else descriptions of those that don't."""
    r = random.Random(seed)
    ns = {name: getattr(fivar, name) for name in fivar.__all__}
    exprs = []
    while len(exprs) < n_expr:
        e = gen_float(r, r.randint(1, 4))
        if must_contain is None or must_contain in e:
            exprs.append(e)
    failures = []
    for i, text in enumerate(exprs):
        v = make_variant(i, text, ns)
        sm_scale = r.choice([1.0, 0.125, 0.0883883])
        params = {"a": r.uniform(-2, 2), "n": r.randint(-3, 9), "t": torch.randn(TABLE_LEN, dtype=F64)}
        env = _env(r, sm_scale)
        env = _subset(env, _regular_points(v, env, params))
        _, ref_score, ref_table = _autograd(v, env, params)
        d_score, d_qk, d_table = _symbolic(v, env, params)
        if not _close(d_score, ref_score):
            failures.append(f"d/dscore of `{text}`")
        if not _close(d_qk, ref_score * sm_scale):
            failures.append(f"lowered d/dqk of `{text}`")
        if not torch.allclose(d_table, ref_table, rtol=1e-7, atol=1e-9):
            failures.append(f"d/dtable of `{text}`")
    return failures


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_derivatives_match_autograd(seed):
    failures = _check_expressions(seed, 25)
    assert not failures, failures


# --- every bundled logits function, and the no-softmax weight ----------------------------------------------------
@pytest.mark.parametrize("name", ["softcap", "alibi", "sigmoid", "relative_bias", "softcap_sliding_window"])
def test_bundled_variants(name):
    v = fivar.load(name)
    assert v.ir.logits is not None
    prog = grad.derivative(v.ir.logits, grad.WRT_SCORE)
    env = _env(random.Random(name), 0.125)
    params = {"softcap": 7.5, "bias": 0.3, "max_distance": 6, "window": 5}
    tables = {"slopes": torch.rand(16, dtype=F64), "bias": torch.randn(16, 13, dtype=F64)}
    params.update({k: t for k, t in tables.items() if k in v.tensor_params})
    score = env["score"].clone().requires_grad_(True)
    out = TorchEvaluator({**env, "score": score}, params, F64).run(v.ir.logits)
    (want,) = torch.autograd.grad(out.sum(), [score])
    got = TorchEvaluator(env, params, F64).run(prog).expand(N)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)


def test_derivative_of_integer_and_bool_parts_is_zero():
    """Indices, casts of ints, and floor are piecewise constant: their derivatives fold to the constant 0."""
    ns = {name: getattr(fivar, name) for name in fivar.__all__}
    v = make_variant(900, "float(qi - ki) * 0.5 + floor(p.a) + p.t[ki % 3]", ns)
    assert grad.is_zero(grad.derivative(v.ir.logits, grad.WRT_SCORE))
    (load,) = grad.learnable_loads(v.ir.logits, v.params, names={"t"})
    assert grad.derivative(v.ir.logits, load).result == grad.ONE


# --- mutations: a wrong rule must fail the property ----------------------------------------------------------
MUTATIONS = {
    "tanh": ("CALL_RULES", "tanh", lambda a, d: grad.mul(grad.add(grad.ONE, grad.mul(grad.call("tanh", a[0]),
                                                                                      grad.call("tanh", a[0]))), d[0])),
    "sigmoid": ("CALL_RULES", "sigmoid", lambda a, d: grad.mul(grad.call("sigmoid", a[0]), d[0])),
    "minimum": ("CALL_RULES", "minimum", lambda a, d: grad._tie_split(a[0], a[1], d[0], d[1], "gt")),
    "exp2": ("CALL_RULES", "exp2", lambda a, d: grad.mul(grad.call("exp2", a[0]), d[0])),
    "/": ("BINARY_RULES", "div", lambda a, b, da, db: grad.div(grad.sub(da, db), b)),
    "*": ("BINARY_RULES", "mul", lambda a, b, da, db: grad.mul(da, b)),
}


@pytest.mark.parametrize("construct", sorted(MUTATIONS))
def test_a_wrong_rule_is_caught(construct, monkeypatch):
    table, key, wrong = MUTATIONS[construct]
    assert not _check_expressions(7, 6, must_contain=construct)  # the right rule passes on these
    monkeypatch.setitem(getattr(grad, table), key, wrong)
    assert _check_expressions(7, 6, must_contain=construct), f"a wrong `{construct}` rule went unnoticed"


def test_a_wrong_select_or_load_rule_is_caught(monkeypatch):
    orig = grad._Differentiator.d

    def swapped_select(self, e):
        if isinstance(e, ir.Select) and e.type == ir.F32:
            return grad.select(e.cond, self.d(e.b), self.d(e.a))
        return orig(self, e)

    assert not _check_expressions(3, 6, must_contain="where(")
    monkeypatch.setattr(grad._Differentiator, "d", swapped_select)
    assert _check_expressions(3, 6, must_contain="where(")
    monkeypatch.setattr(grad._Differentiator, "d", orig)

    def constant_load(self, e):  # a table read treated as a constant
        if isinstance(e, ir.Load):
            return grad.ZERO
        return orig(self, e)

    assert not _check_expressions(5, 6, must_contain="p.t[")
    monkeypatch.setattr(grad._Differentiator, "d", constant_load)
    failures = [f for f in _check_expressions(5, 6, must_contain="p.t[") if "dtable" in f]
    assert failures, "a load rule dropping the table's gradient went unnoticed"


def test_param_gradient_reference_at_the_kernels_correction_term():
    """reference_gradients(o_used=...) gives a learnable param's gradient with the softmax backward's correction term
    rowsum(o_used * do) in place of the exact one, checked against a hand-written float64 ALiBi backward."""
    import math

    import fivar
    from fivar.bench.train import learnable_copy
    from fivar.testing import reference_gradients
    v = learnable_copy(fivar.load("alibi"))
    torch.manual_seed(3)
    n, h, d = 24, 2, 16
    q, k, vv, do = (torch.randn(n, h, d, dtype=torch.float64) for _ in range(4))
    slopes = torch.rand(h) * 0.2  # float32, as declared
    o_ref, exact = reference_gradients(v, q, k, vv, do, qo_lens=[n], kv_lens=[n], causal=False,
                                       params={"slopes": slopes})
    o_used = o_ref + 1e-2 * torch.randn_like(o_ref)  # a kernel's rounded forward output
    _, got = reference_gradients(v, q, k, vv, do, qo_lens=[n], kv_lens=[n], causal=False, params={"slopes": slopes},
                                 o_used=o_used)
    dist = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).double()  # kv_idx - q_idx
    logits = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) + slopes.double()[:, None, None] * dist
    p = torch.softmax(logits, -1)
    dp = torch.einsum("qhd,khd->hqk", do, vv)
    delta = (o_used * do).sum(-1).T[:, :, None]  # [h, q, 1]: rowsum(o_used * do)
    want = (p * (dp - delta) * dist).sum((1, 2))
    torch.testing.assert_close(got["slopes"].double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(exact["slopes"].double(), want, rtol=1e-3, atol=1e-3)  # the shift is really there
