"""The front end: what a variant function becomes in the IR, with types."""
import math

import pytest

from fivar import AttentionVariant, Scalar, Tensor, clamp, maximum, tanh, where
from fivar.spec import ir
from fivar.spec.ir import BOOL, F32, I32

OFFSET = 3
RATIO = 0.5


def _logits_ir(fn, **params):
    return AttentionVariant(name="t", logits=fn, params=params).ir.logits


def test_score_and_params_types():
    def logits(score, b, h, kvh, qi, ki, p):
        return p.cap * tanh(score / p.cap)
    prog = _logits_ir(logits, cap=Scalar(float))
    assert prog.result.type == F32
    assert isinstance(prog.result, ir.Binary) and prog.result.op == "mul"
    assert isinstance(prog.result.b, ir.Call) and prog.result.b.fn == "tanh"


def test_int_arithmetic_stays_int_and_division_is_float():
    def logits(score, b, h, kvh, qi, ki, p):
        d = ki - qi
        half = d // 2
        frac = d / 2
        return score + float(half) + frac
    prog = _logits_ir(logits)
    types = dict((n, e.type) for n, e in prog.lets)
    assert types == {"d": I32, "half": I32, "frac": F32}


def test_mixed_int_float_promotes():
    def logits(score, b, h, kvh, qi, ki, p):
        return score + ki
    prog = _logits_ir(logits)
    assert isinstance(prog.result.b, ir.Cast) and prog.result.b.type == F32


def test_globals_and_closures_become_constants():
    def logits(score, b, h, kvh, qi, ki, p):
        return score * RATIO + (ki + OFFSET)
    prog = _logits_ir(logits)
    consts = [n.value for n in ir.walk(prog.result) if isinstance(n, ir.Const)]
    assert RATIO in consts and OFFSET in consts


def test_clamp_lowers_to_min_max_and_where_to_select():
    def logits(score, b, h, kvh, qi, ki, p):
        return where(ki > qi, score, clamp(score, -1.0, 1.0))
    prog = _logits_ir(logits)
    assert isinstance(prog.result, ir.Select)
    assert prog.result.b.fn == "minimum" and prog.result.b.args[0].fn == "maximum"


def test_reassignment_gets_fresh_names():
    def logits(score, b, h, kvh, qi, ki, p):
        x = score
        x = x * 2.0
        x = maximum(x, 0.0)
        return x
    prog = _logits_ir(logits)
    assert [n for n, _ in prog.lets] == ["x", "x_2", "x_3"]
    assert prog.result == ir.Local(F32, "x_3")


def test_chained_comparison_and_bool_ops():
    def mask(b, h, kvh, qi, ki, p):
        return 0 <= qi - ki < p.w and not (h == 3)
    prog = AttentionVariant(name="m", mask=mask, params={"w": Scalar(int)}).ir.mask
    assert prog.result.type == BOOL
    assert prog.result.op == "and"


def test_tensor_loads_take_int_indices():
    def logits(score, b, h, kvh, qi, ki, p):
        return score + p.table[h, clamp(ki - qi, -4, 4) + 4]
    prog = _logits_ir(logits, table=Tensor("float32", ("qo_head", "offset")))
    load = prog.result.b
    assert isinstance(load, ir.Load) and load.param == "table" and len(load.indices) == 2


def test_math_and_torch_spellings_are_accepted():
    import torch

    def logits(score, b, h, kvh, qi, ki, p):
        return math.tanh(score) + torch.sigmoid(score) + abs(score) + max(score, 0.0)
    prog = _logits_ir(logits)
    fns = sorted(n.fn for n in ir.walk(prog.result) if isinstance(n, ir.Call))
    assert fns == ["abs", "maximum", "sigmoid", "tanh"]


def test_docstring_and_annotations_are_fine():
    def logits(score, b, h, kvh, qi, ki, p):
        """Scaled."""
        y: float = score * 2.0
        return y
    assert _logits_ir(logits).result == ir.Local(F32, "y")


def test_int_result_of_logits_is_cast_to_float():
    def logits(score, b, h, kvh, qi, ki, p):
        return ki - qi
    prog = _logits_ir(logits)
    assert prog.result.type == F32 and isinstance(prog.result, ir.Cast)


def test_output_scale_folding_for_softcap():
    from fivar.spec import optimize

    def logits(score, b, h, kvh, qi, ki, p):
        return p.cap * tanh(score / p.cap)
    v = AttentionVariant(name="t", logits=logits, params={"cap": Scalar(float)})
    low = optimize.lower(v.ir, softmax=True)
    assert low.output_scale == ir.ScalarParam(F32, "cap")
    # tanh(qk * K) with K = sm_scale / cap computed once per block
    call = low.logits.result
    assert call.fn == "tanh" and isinstance(call.args[0].a, ir.RawScore)
    assert isinstance(call.args[0].b, ir.Hoisted)
    assert low.hoisted[call.args[0].b.name] == ir.Binary(F32, "div", ir.ScalarParam(F32, "sm_scale"),
                                                        ir.ScalarParam(F32, "cap"))


def test_no_output_folding_without_softmax():
    from fivar.spec import optimize

    def logits(score, b, h, kvh, qi, ki, p):
        return 2.0 * tanh(score)
    v = AttentionVariant(name="t", logits=logits, softmax=False)
    assert optimize.lower(v.ir, softmax=False).output_scale is None


@pytest.mark.parametrize("name", ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask",
                                  "relative_bias", "softcap_sliding_window"])
def test_bundled_variants_parse(name):
    import fivar
    v = fivar.load(name)
    assert v.ir.logits is not None or v.ir.mask is not None


def test_augmented_assignment_is_a_reassignment():
    """`x += e` (and every `op=`) means `x = x op e`, in logits and mask alike, checked on the reference against a
    dense float64 computation of the same function."""
    import torch

    def logits(score, b, h, kvh, qi, ki, p):
        d = ki - qi
        d += p.shift
        d //= 3
        d %= 7
        x = score
        x *= p.gain
        x -= 0.25 * float(d)
        x /= 2.0
        x **= 2
        return x

    def mask(b, h, kvh, qi, ki, p):
        e = qi - ki
        e += 1
        return e > 0

    v = AttentionVariant(name="aug", logits=logits, mask=mask,
                         params={"shift": Scalar(int, default=5), "gain": Scalar(float, default=1.5)})
    assert [n for n, _ in v.ir.logits.lets] == ["d", "d_2", "d_3", "d_4", "x", "x_2", "x_3", "x_4", "x_5"]
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    qo_len, kv_len, heads, dim = 9, 23, 2, 16
    q, k, val = (torch.randn(n, heads, dim, generator=g) for n in (qo_len, kv_len, kv_len))
    shift, gain = int(torch.randint(-9, 9, (), generator=g)), 0.5 + float(torch.rand((), generator=g))
    out = v.reference(q, k, val, shift=shift, gain=gain)
    qi = torch.arange(qo_len).view(-1, 1) + (kv_len - qo_len)
    ki = torch.arange(kv_len).view(1, -1)
    d = torch.remainder(torch.div(ki - qi + shift, 3, rounding_mode="floor"), 7).double()
    keep = qi - ki + 1 > 0
    for h in range(heads):
        s = (q[:, h].double() @ k[:, h].double().T) / math.sqrt(dim)
        x = ((s * gain - 0.25 * d) / 2.0) ** 2
        want = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1) @ val[:, h].double()
        torch.testing.assert_close(out[:, h].double(), want, rtol=1e-4, atol=1e-4)
