"""Every way a spec can be wrong gets a FivarSpecError naming variant, file:line:col and the construct."""
import decimal
import fractions
import inspect
import math

import numpy as np
import pytest
import torch

import fivar
from fivar import AttentionVariant, FivarSpecError, Scalar, Tensor, tanh

NOT_A_NUMBER = "hello"


def _bad_line(fn) -> int:
    lines, start = inspect.getsourcelines(fn)
    for i, line in enumerate(lines):
        if "# BAD" in line:
            return start + i
    return start


def _expect(fn, role="logits", match=None, **params):
    kw = {role: fn}
    with pytest.raises(FivarSpecError) as info:
        AttentionVariant(name="badvar", params=params, **kw).ir
    err = info.value
    text = str(err)
    assert "variant 'badvar'" in text
    assert err.filename == __file__
    assert err.line == _bad_line(fn), text
    assert f"{__file__}:{err.line}:" in text
    if match:
        assert match in text, text
    return err


def test_if_statement():
    def logits(s, b, h, kh, qi, ki, p):
        if qi > ki:  # BAD
            return s
        return s
    err = _expect(logits, match="`if` statement is not supported")
    assert "allowed:" in str(err)


def test_augmented_assignment_to_an_argument():
    def logits(s, b, h, kh, qi, ki, p):
        s += 1.0  # BAD
        return s
    _expect(logits, match="cannot assign to argument `s`")


def test_augmented_assignment_to_an_attribute():
    def logits(s, b, h, kh, qi, ki, p):
        p.cap += 1.0  # BAD
        return s
    _expect(logits, match="only `name = expr` and `name op= expr`", cap=Scalar(float))


def test_for_loop():
    def logits(s, b, h, kh, qi, ki, p):
        for _ in range(3):  # BAD
            s = s + 1.0
        return s
    _expect(logits, match="`for` loop")


def test_wrong_arity():
    def logits(s, b, h, qi, ki, p):  # BAD
        return s
    _expect(logits, match="exactly 7 positional arguments")


def test_unknown_param():
    def logits(s, b, h, kh, qi, ki, p):
        return s * p.nope  # BAD
    _expect(logits, match="unknown parameter `nope`", cap=Scalar(float))


def test_unknown_param_indexed_is_unknown_not_a_scalar():
    """A typo in an indexed tensor's name is an unknown parameter, with the declared name it is closest to."""
    def logits(s, b, h, kh, qi, ki, p):
        return s + p.slope[h]  # BAD
    _expect(logits, match="unknown parameter `slope` (did you mean `slopes`? declared: window, slopes)",
            window=Scalar(int), slopes=Tensor("float32", ("qo_head",)))

    def mask(b, h, kh, qi, ki, p):
        return qi - ki < p.windw  # BAD
    _expect(mask, role="mask", match="unknown parameter `windw` (did you mean `window`?",
            window=Scalar(int), slopes=Tensor("float32", ("qo_head",)))


def test_tensor_param_used_without_index():
    def logits(s, b, h, kh, qi, ki, p):
        return s + p.slopes  # BAD
    _expect(logits, match="must be indexed", slopes=Tensor("float32", ("qo_head",)))


def test_scalar_param_indexed():
    def logits(s, b, h, kh, qi, ki, p):
        return s + p.cap[h]  # BAD
    _expect(logits, match="cannot be indexed", cap=Scalar(float))


def test_wrong_index_count():
    def logits(s, b, h, kh, qi, ki, p):
        return s + p.t[h, ki]  # BAD
    _expect(logits, match="has 1 dimension", t=Tensor("float32", ("qo_head",)))


def test_float_used_as_index():
    def logits(s, b, h, kh, qi, ki, p):
        return s + p.t[s]  # BAD
    _expect(logits, match="must be an int", t=Tensor("float32", ("qo_head",)))


def test_bool_arithmetic():
    def logits(s, b, h, kh, qi, ki, p):
        return s + (qi > ki)  # BAD
    _expect(logits, match="arithmetic on a bool")


def test_and_on_numbers():
    def mask(b, h, kh, qi, ki, p):
        return qi and ki  # BAD
    _expect(mask, role="mask", match="`and` needs bool operands")


def test_not_on_number():
    def mask(b, h, kh, qi, ki, p):
        return not qi  # BAD
    _expect(mask, role="mask", match="`not` needs a bool")


def test_logits_returning_bool():
    def logits(s, b, h, kh, qi, ki, p):
        return qi >= ki  # BAD
    _expect(logits, match="must return a number")


def test_mask_returning_number():
    def mask(b, h, kh, qi, ki, p):
        return qi - ki  # BAD
    _expect(mask, role="mask", match="must return a bool")


def test_unknown_function():
    def logits(s, b, h, kh, qi, ki, p):
        return math.sin(s)  # BAD
    _expect(logits, match="`math.sin` is not a function fivar can compile")


def test_builtin_that_is_not_supported():
    def logits(s, b, h, kh, qi, ki, p):
        return s + len(p)  # BAD
    _expect(logits, match="`len` is not a function")


def test_undefined_name():
    def logits(s, b, h, kh, qi, ki, p):
        return s * undefined_thing  # BAD  # noqa: F821
    _expect(logits, match="name `undefined_thing` is not defined")


def test_non_numeric_global():
    def logits(s, b, h, kh, qi, ki, p):
        return s * NOT_A_NUMBER  # BAD
    _expect(logits, match="only numbers can be used")


def test_keyword_arguments():
    def logits(s, b, h, kh, qi, ki, p):
        return tanh(x=s)  # BAD
    _expect(logits, match="keyword arguments")


def test_power_of_constants_is_range_checked():
    def big_int(s, b, h, kh, qi, ki, p):
        return s + float(10 ** 40)  # BAD
    _expect(big_int, match="does not fit the kernels' 32-bit ints")

    def just_past_int32(s, b, h, kh, qi, ki, p):  # an int, whatever the float it is added to
        return s + 2 ** 31  # BAD
    _expect(just_past_int32, match="does not fit the kernels' 32-bit ints")

    def big_float(s, b, h, kh, qi, ki, p):
        return s + 10.0 ** 39  # BAD
    _expect(big_float, match="does not fit the kernels' 32-bit floats")

    def past_float64(s, b, h, kh, qi, ki, p):
        return s + 10.0 ** 400  # BAD
    _expect(past_float64, match="past float64's range")

    def zero_to_negative(s, b, h, kh, qi, ki, p):
        return s + 0.0 ** -1  # BAD
    _expect(zero_to_negative, match="0 to a negative power")

    def complex_power(s, b, h, kh, qi, ki, p):
        return s + (-8.0) ** 0.5  # BAD
    _expect(complex_power, match="not a real number")


def test_int_to_a_run_time_int_power():
    def logits(s, b, h, kh, qi, ki, p):
        return s + float(qi // 2 ** p.level)  # BAD
    _expect(logits, match="an int to an int power known only at run time", level=Scalar(int, default=2))


def test_power_of_a_bool():
    def logits(s, b, h, kh, qi, ki, p):
        return s ** (qi < ki)  # BAD
    _expect(logits, match="`**` on a bool")


def test_missing_return():
    def logits(s, b, h, kh, qi, ki, p):  # BAD
        x = s * 2.0  # noqa: F841
    _expect(logits, match="must end with a `return`")


def test_code_after_return():
    def logits(s, b, h, kh, qi, ki, p):
        return s
        s = s + 1.0  # BAD
    _expect(logits, match="code after `return`")


def test_assign_to_argument():
    def logits(s, b, h, kh, qi, ki, p):
        s = s * 2.0  # BAD
        return s
    _expect(logits, match="cannot assign to argument")


def test_mixed_branch_types():
    def logits(s, b, h, kh, qi, ki, p):
        return s if qi > ki else (qi > 0)  # BAD
    _expect(logits, match="both branches")


def test_string_constant():
    def logits(s, b, h, kh, qi, ki, p):
        return s + "x"  # BAD
    _expect(logits, match="constant 'x'")


def test_tuple_assignment():
    def logits(s, b, h, kh, qi, ki, p):
        x, y = s, s  # BAD
        return x + y
    _expect(logits, match="this assignment form")


def test_attribute_on_score():
    def logits(s, b, h, kh, qi, ki, p):
        return s.real  # BAD
    _expect(logits, match="attribute access")


def test_wrong_arity_of_function():
    def logits(s, b, h, kh, qi, ki, p):
        return tanh(s, s)  # BAD
    _expect(logits, match="tanh() takes 1 argument")


def test_lambda_is_refused():
    with pytest.raises(FivarSpecError, match="plain Python function|lambda"):
        AttentionVariant(name="badvar", logits=lambda s, b, h, kh, qi, ki, p: s).ir  # noqa: E731


@pytest.mark.parametrize("pname,why", [
    ("sm_scale", "entry points take a keyword argument"), ("causal", "entry points take"), ("dtype", "entry points"),
    ("device", "entry points"), ("q", "entry points"), ("self", "entry points"), ("batch_idx", "entry points"),
    ("lambda", "Python keyword"), ("class", "Python keyword")])
def test_param_names_fivar_itself_takes(pname, why):
    """A param is passed as a keyword of fivar's entry points and read as params.NAME in the spec: names that cannot be
    either are refused at the Scalar(...) that declares them."""
    def logits(s, b, h, kh, qi, ki, p):
        return s
    declared = Scalar(float, default=1.0)
    with pytest.raises(FivarSpecError, match=f"parameter name '{pname}' cannot be used: .*{why}") as info:
        AttentionVariant(name="badvar", logits=logits, params={pname: declared})
    assert info.value.line == declared.where["line"]


def test_every_argument_of_the_calls_is_a_refused_param_name():
    """The spec refuses params named like the calls' arguments from its own list, as the calls are added from above
    the runtime (fivar.runtime.methods): that list is every argument the class's calls take, read from them now."""
    from fivar.runtime.methods import call_kwargs
    from fivar.spec.variant import CALL_KWARGS

    def logits(s, b, h, kh, qi, ki, p):
        return s
    taken = call_kwargs(AttentionVariant)
    assert taken == CALL_KWARGS and {"causal", "kv_last_page_len", "cuda_graph", "batch_idx", "out"} <= taken
    for pname in sorted(taken):
        with pytest.raises(FivarSpecError, match=f"parameter name '{pname}' cannot be used"):
            AttentionVariant(name="badvar", logits=logits, params={pname: Scalar(float, default=1.0)})


@pytest.mark.parametrize("pname", ["o", "window_left", "lse", "kv_len", "int", "maybe_x", "fv_x", "_x", "__x", "INFINITY",
                                   "NAN", "errno", "NULL", "EOF", "M_PI", "FLT_MAX", "grid", "num_warps", "num_stages",
                                   "\u03b1"])
def test_param_names_generated_code_spells_its_own_way(pname):
    """Names of C macros, C++ keywords, FlashInfer fields and Triton launch options are fine: generated code never
    spells a user name as it is (tests/unit/test_fuzz_spec.py compiles them)."""
    def logits(s, b, h, kh, qi, ki, p):
        return s
    AttentionVariant(name="okvar", logits=logits, params={pname: Scalar(float, default=1.0)})


def test_bad_tensor_dtype():
    def logits(s, b, h, kh, qi, ki, p):
        return s
    with pytest.raises(FivarSpecError, match="dtype 'float8'"):
        AttentionVariant(name="badvar", logits=logits, params={"t": Tensor("float8", ("n",))})


def test_params_not_a_dict():
    def logits(s, b, h, kh, qi, ki, p):
        return s
    with pytest.raises(FivarSpecError, match="variant 'badvar': params must be a dict of name -> .*got list"):
        AttentionVariant(name="badvar", logits=logits, params=[Scalar(float)])


def test_neither_logits_nor_mask():
    with pytest.raises(FivarSpecError, match="needs a `logits` function") as info:
        AttentionVariant(name="badvar")  # BAD
    assert (info.value.filename, info.value.line) == (__file__, _bad_line(test_neither_logits_nor_mask))


def test_variant_file_with_syntax_error(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("from fivar import AttentionVariant\n\ndef logits(s, b, h, kh, qi, ki, p)\n    return s\n")
    with pytest.raises(FivarSpecError) as info:
        fivar.load(str(f))
    assert f"{f}:3:" in str(info.value) and "syntax error" in str(info.value)


def test_variant_file_that_raises_on_import(tmp_path):
    f = tmp_path / "raises.py"
    f.write_text("import fivar\n\nx = 1\nraise RuntimeError('boom')\n")
    with pytest.raises(FivarSpecError) as info:
        fivar.load(str(f))
    assert f"{f}:4:" in str(info.value) and "RuntimeError: boom" in str(info.value)


def test_variant_file_without_variant(tmp_path):
    f = tmp_path / "empty.py"
    f.write_text("x = 1\n")
    with pytest.raises(FivarSpecError, match="must define `variant"):
        fivar.load(str(f))


def test_unknown_variant_name_lists_what_exists():
    with pytest.raises(fivar.FivarError, match="no variant named 'nope'.*softcap"):
        fivar.load("nope")


@pytest.mark.parametrize("make,match", [
    (lambda: Scalar(int, default=2.5), "Scalar parameter 'w': default 2.5 is not an int"),
    (lambda: Scalar(float, default="30"), "Scalar parameter 'w': default '30' is not a float"),
    (lambda: Scalar(int, default=True), "Scalar parameter 'w': default True is not an int"),
    # a Fraction or Decimal printed into generated code (1/3: integer division in C++), or a numpy scalar: refused
    (lambda: Scalar(float, default=fractions.Fraction(1, 3)), "default Fraction(1, 3) is not a float (it is a Fr"),
    (lambda: Scalar(int, default=fractions.Fraction(4, 1)), "default Fraction(4, 1) is not an int"),
    (lambda: Scalar(float, default=decimal.Decimal("0.1")), "default Decimal('0.1') is not a float"),
    (lambda: Scalar(int, default=np.int64(3)), "default np.int64(3) is not an int"),
    (lambda: Scalar(float, default=10**400), "default an integer of 401 digits: an integer of 401 digits does not "
                                            "fit the kernels' 32-bit floats"),
    (lambda: Scalar(int, default=-10**400), "default a negative integer of 401 digits: a negative integer of 401 "
                                           "digits does not fit the kernels' 32-bit ints"),
    (lambda: Scalar(float, default=float("nan")), "Scalar parameter 'w': default nan: it must be finite"),
    (lambda: Scalar(float, default=-float("inf")), "Scalar parameter 'w': default -inf: it must be finite"),
    (lambda: Scalar(str), "Scalar parameter 'w': dtype must be float or int"),
    (lambda: Tensor("float8", ("qo_head",)), "Tensor parameter 'w': dtype 'float8' is not one of"),
    (lambda: Tensor("float32", (8,)), "Tensor parameter 'w': dims must be a non-empty tuple of dimension names"),
    (lambda: Tensor("float32", ("qo_head")), "dims must be a non-empty tuple of dimension names, one per "
                                             "dimension, e.g. (\"qo_head\",)"),  # a missing comma: a string
    (lambda: Tensor("float32", ()), "Tensor parameter 'w': dims must be a non-empty tuple"),
])
def test_bad_declarations_point_at_the_declaration(make, match):
    """The error names the line of the Scalar(...)/Tensor(...) call, not the logits function."""
    decl_line = inspect.getsourcelines(make)[1]
    param = make()

    def logits(s, b, h, kh, qi, ki, p):
        return s
    with pytest.raises(FivarSpecError) as info:
        AttentionVariant(name="badvar", logits=logits, params={"w": param})
    text = str(info.value)
    assert match in text and "variant 'badvar'" in text, text
    assert (info.value.filename, info.value.line) == (__file__, decl_line), text


def test_good_declarations_pass():
    for p in (Scalar(int, default=3), Scalar(float, default=2), Scalar(float, default=0.5), Scalar(int)):
        AttentionVariant(name="okvar", logits=lambda s, b, h, kh, qi, ki, p: s, params={"w": p})


# --- integer division by zero: refused where it is known (a literal, a Scalar's default or value), and reported
# by the reference with the spec's line where only the data can tell -------------------------------------------

def test_integer_division_by_literal_zero():
    def mask(b, h, kh, qi, ki, p):
        return qi // 0 == ki  # BAD
    _expect(mask, role="mask", match="integer `//` by zero")


ZERO_F = 0.0


def test_float_division_by_a_zero_written_in_the_spec():
    """A float `/`, `//` or `%` by a literal zero (through a module constant or a local too) is refused at its line, as
    Python refuses it: the reference gave NaN, the Triton twin refused the folded softmax factor without a line."""
    def logits(s, b, h, kh, qi, ki, p):
        return s / ZERO_F  # BAD
    _expect(logits, match="`s / ZERO_F`: `/` by zero")

    def logits2(s, b, h, kh, qi, ki, p):
        z = 0.0
        return s + float(ki) % z  # BAD
    _expect(logits2, match="`%` by zero")

    def logits3(s, b, h, kh, qi, ki, p):
        return s + (s // -0.0)  # BAD
    _expect(logits3, match="`//` by zero")


WIDTH = 4


def test_a_divisor_computed_from_constants_alone_is_refused_where_it_is_zero():
    """`3 - 3`, `WIDTH // 8`, `min(WIDTH, 0)`: arithmetic on constants the parser keeps as written is still a divisor
    known to be zero (the kernels would divide by it: undefined in CUDA, the reference alone refused it per call)."""
    def mask(b, h, kh, qi, ki, p):
        return qi % (3 - 3) == 0  # BAD
    _expect(mask, role="mask", match="integer `%` by zero")

    def mask2(b, h, kh, qi, ki, p):
        return qi // (WIDTH // 8) == ki  # BAD
    _expect(mask2, role="mask", match="integer `//` by zero")

    def logits(s, b, h, kh, qi, ki, p):
        return s / float(min(WIDTH, 0))  # BAD
    _expect(logits, match="`/` by zero")


def test_a_zero_divisor_through_locals_and_casts_is_refused():
    def mask(b, h, kh, qi, ki, p):
        a = 3 - 3
        c = a
        return qi // c == ki  # BAD
    _expect(mask, role="mask", match="integer `//` by zero")

    def mask2(b, h, kh, qi, ki, p):
        return qi % int(False) == 0  # BAD
    _expect(mask2, role="mask", match="integer `%` by zero")


def test_int_arithmetic_on_constants_past_int32_is_refused_where_written():
    """Ints are 32-bit in every target and the reference: `65536 * 65536` would wrap to 0 (a zero divisor), so it is
    refused as a literal past int32 is."""
    def mask(b, h, kh, qi, ki, p):
        return qi // (65536 * 65536) == ki  # BAD
    _expect(mask, role="mask", match="does not fit the kernels' 32-bit ints")


def _mask_file(tmp_path, name: str, body: str):
    f = tmp_path / f"{name}.py"
    f.write_text("from fivar import AttentionVariant\n\nINF = float('inf')\nNAN = float('nan')\n\n\n"
                 f"def mask(b, h, kh, qi, ki, p):\n{body}\n\nvariant = AttentionVariant(name='{name}', mask=mask)\n")
    return f


def test_constant_divisors_python_cannot_evaluate_give_no_traceback(tmp_path):
    """A float past float64: not known to be zero, so not refused as one, and no Python error escapes the parser (a
    clear refusal would do too)."""
    f = _mask_file(tmp_path, "odd", "    return qi // int(1e308 * 10) == ki\n")
    try:
        fivar.load(str(f)).ir
    except FivarSpecError as e:
        assert f"{f}:" in str(e), e


@pytest.mark.parametrize("expr", ["int(INF)", "int(NAN)", "int(-INF) + 1", "int(w)"])
def test_int_of_an_infinite_or_nan_constant_is_refused_where_written(tmp_path, expr):
    """int() of inf or NaN has no value: CUDA's conversion saturates (NaN to 0, a zero divisor), the reference's torch
    gives INT_MIN on x86. Refused at its line, through a local too."""
    f = _mask_file(tmp_path, "nonfinite", f"    w = -INF\n    return qi // ({expr}) == ki\n")
    with pytest.raises(FivarSpecError, match=r"int\(\) of (-?inf|nan)") as e:
        fivar.load(str(f)).ir
    assert f"{f}:9:" in str(e.value) and "\n" not in str(e.value), e.value


def test_a_long_chain_of_locals_parses_at_once(tmp_path):
    """Sixty rebindings that each double the last (`a = a + a`): every local's constant value is worked out once,
    as it is bound, not by walking back through the chain at every use (2**60 steps)."""
    f = _mask_file(tmp_path, "chain", "    a = qi\n" + "    a = a + a\n" * 60 + "    return qi // a == ki\n")
    assert fivar.load(str(f)).ir.mask is not None


def test_a_nonzero_divisor_computed_from_constants_is_fine():
    import torch
    from fivar.codegen.torch_ref import reference_attention

    def mask(b, h, kh, qi, ki, p):
        return qi // (WIDTH - 2 + WIDTH % 3) == ki // (-(-WIDTH // 3) * 1)  # (4 - 2 + 1) = 3 and 2

    v = AttentionVariant(name="okconst", mask=mask)
    q, k = torch.randn(10, 1, 8, dtype=torch.float64), torch.randn(10, 1, 8, dtype=torch.float64)
    out = reference_attention(v, q, k, k, params={}, float_dtype=torch.float64)
    idx = torch.arange(10)
    keep = (idx.view(-1, 1) // 3) == (idx.view(1, -1) // 2)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(8)
    want = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~keep, -math.inf), -1), k)
    torch.testing.assert_close(out.nan_to_num(), want.nan_to_num())


def test_float_division_by_a_nonzero_constant_is_fine():
    import torch

    def logits(s, b, h, kh, qi, ki, p):
        return s / 0.5 + float(ki) % 2.5

    v = AttentionVariant(name="okdiv", logits=logits)
    q, k = torch.randn(6, 1, 16, dtype=torch.float64), torch.randn(11, 1, 16, dtype=torch.float64)
    from fivar.codegen.torch_ref import reference_attention
    out = reference_attention(v, q, k, k, params={}, float_dtype=torch.float64)
    s = torch.einsum("qhd,khd->hqk", q, k) / 4.0 / 0.5 + torch.remainder(torch.arange(11.0), 2.5).view(1, 1, -1)
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), k))


def test_integer_modulo_by_a_scalar_whose_default_is_zero():
    def mask(b, h, kh, qi, ki, p):
        c = p.chunk
        return qi % c == ki % 7  # BAD
    _expect(mask, role="mask", match="params.chunk divides (`qi % c`) but its default is 0", chunk=Scalar(int, default=0))


def _chunked():
    def mask(b, h, kh, qi, ki, p):
        return qi // p.chunk == ki // p.chunk  # BAD
    return AttentionVariant(name="chunked", mask=mask, params={"chunk": Scalar(int)}), _bad_line(mask)


def test_a_scalar_divisor_of_zero_is_refused_per_call():
    import torch
    from fivar.codegen.torch_ref import reference_attention
    v, line = _chunked()
    q, k = torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    with pytest.raises(fivar.FivarError, match=rf"{__file__}:{line}:\d+: variant 'chunked': `qi // p.chunk`: "
                       "parameter 'chunk' is 0"):
        reference_attention(v, q, k, k, params={"chunk": 0})
    for chunk in (1, 5, -3):  # the reference keeps Python's floor division (a negative chunk is legal)
        out = reference_attention(v, q, k, k, params={"chunk": chunk}, float_dtype=torch.float64)
        idx = torch.arange(12)
        keep = (idx.view(-1, 1) // chunk) == (idx.view(1, -1) // chunk)
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / 4.0
        want = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~keep, -math.inf), -1), k.double())
        torch.testing.assert_close(out, want)


def test_a_divisor_that_is_zero_at_some_positions_names_its_line():
    import torch
    from fivar.codegen.torch_ref import reference_attention

    def mask(b, h, kh, qi, ki, p):
        return qi % (ki - qi) == 0  # BAD

    def mask_guarded(b, h, kh, qi, ki, p):
        return qi % fivar.maximum(ki - qi, 1) == 0
    q, k = torch.randn(9, 1, 8), torch.randn(9, 1, 8)
    with pytest.raises(fivar.FivarError, match=rf"{__file__}:{_bad_line(mask)}:\d+: variant 'diag': "
                       r"`qi % \(ki - qi\)`: the divisor is 0 at positions whose result is used"):
        reference_attention(AttentionVariant(name="diag", mask=mask), q, k, k)
    out = reference_attention(AttentionVariant(name="diag", mask=mask_guarded), q, k, k, float_dtype=torch.float64)
    idx = torch.arange(9)
    keep = torch.remainder(idx.view(-1, 1), (idx.view(1, -1) - idx.view(-1, 1)).clamp(min=1)) == 0
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(8)
    want = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~keep, -math.inf), -1), k.double())
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("dim,known", [("qo_heads", "qo_head"), ("kvhead", "kv_head"), ("batches", "batch")])
def test_a_tensor_dimension_that_nearly_names_a_checked_one(dim, known):
    def logits(s, b, h, kh, qi, ki, p):
        return s + p.t[h]
    declared = Tensor("float32", (dim,))
    with pytest.raises(FivarSpecError, match=f"dimension '{dim}' is close to '{known}'") as info:
        AttentionVariant(name="badvar", logits=logits, params={"t": declared})
    assert info.value.line == declared.where["line"]
    AttentionVariant(name="okvar", logits=logits, params={"t": Tensor("float32", ("heads",))})  # a free name


def test_a_division_a_condition_guards_is_accepted_where_the_kernels_never_use_it():
    """The compiled targets take one branch of a select and evaluate `and`/`or` left to right; a zero divisor on the
    side not taken, or under causal masking, is no error (a Scalar of 0 included: "0 means off")."""
    import torch
    from fivar.codegen.torch_ref import reference_attention

    def or_guard(b, h, kh, qi, ki, p):
        return ki == 0 or qi % ki == 0

    def select_guard(b, h, kh, qi, ki, p):
        return (qi % ki if ki > 0 else 0) == 0

    def off_when_zero(b, h, kh, qi, ki, p):
        return (qi // p.w == ki // p.w) if p.w > 0 else True

    def causal_only(b, h, kh, qi, ki, p):
        return qi % (qi - ki + 1) == 0  # 0 only where ki = qi + 1, which causal masking removes

    def used_anyway(b, h, kh, qi, ki, p):
        return (qi % ki == 0) or ki == 0  # BAD: the division runs first
    q, k = torch.randn(9, 1, 8), torch.randn(9, 1, 8)
    idx = torch.arange(9)
    qi, ki = idx.view(-1, 1), idx.view(1, -1)
    wants = {
        "or_guard": (or_guard, {}, False, (ki == 0) | (torch.remainder(qi, ki.clamp(min=1)) == 0)),
        "select_guard": (select_guard, {}, False, torch.where(ki > 0, torch.remainder(qi, ki.clamp(min=1)), 0) == 0),
        "off_when_zero": (off_when_zero, {"w": 0}, False, torch.ones(9, 9, dtype=torch.bool)),
        "causal_only": (causal_only, {}, True, (ki <= qi) & (torch.remainder(qi, (qi - ki + 1).clamp(min=1)) == 0)),
    }
    for name, (mask, params, causal, keep) in wants.items():
        v = AttentionVariant(name=name, mask=mask, params={"w": Scalar(int, default=0)} if params else {})
        out = reference_attention(v, q, k, k, params=params, causal=causal, float_dtype=torch.float64)
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(8)
        want = torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~keep, -math.inf), -1), k.double())
        torch.testing.assert_close(out, want, msg=name)
    with pytest.raises(fivar.FivarError, match=rf":{_bad_line(used_anyway)}:\d+: variant 'bad': `qi % ki`"):
        reference_attention(AttentionVariant(name="bad", mask=used_anyway), q, k, k)


@pytest.mark.parametrize("shapes,batch_idx,match", [
    (((4, 8, 64), (5, 2, 64), (5, 2, 32)), 0, "of one shape"),
    (((4, 8, 64), (5, 3, 64), (5, 3, 64)), 0, "a multiple of num_kv_heads"),
    (((4, 8, 64), (5, 2, 32), (5, 2, 32)), 0, "the same head_dim"),
    (((4, 64), (5, 2, 64), (5, 2, 64)), 0, r"q must be \[qo_len, num_qo_heads, head_dim\]"),
    (((4, 8, 64), (5, 2, 64), (5, 2, 64)), 3, r"batch_idx=3 must be an int in \[0, batch_size=2\)"),
    (((4, 8, 64), (5, 2, 64), (5, 2, 64)), -1, "batch_idx=-1"),
])
def test_reference_inputs_are_checked_in_fivars_terms(shapes, batch_idx, match):
    """The torch reference takes prefill's shapes; anything else is a one-line error naming the variant."""
    v = fivar.load("alibi")
    q, k, vv = (torch.randn(s) for s in shapes)
    with pytest.raises(fivar.FivarError, match=f"variant 'alibi': reference: .*{match}"):
        v.reference(q, k, vv, batch_idx=batch_idx, batch_size=2)


def test_reference_takes_any_integer_batch_idx():
    import numpy as np
    v = fivar.load("softcap")
    q, k = torch.randn(4, 8, 64), torch.randn(5, 2, 64)
    want = v.reference(q, k, k, batch_idx=1, batch_size=2, softcap=30.0)
    for idx in (np.int64(1), torch.tensor(1)):
        assert torch.equal(v.reference(q, k, k, batch_idx=idx, batch_size=2, softcap=30.0), want)
        assert torch.equal(v.reference(q, k, k, batch_idx=idx, softcap=30.0), want)  # batch_size from it
    with pytest.raises(fivar.FivarError, match="batch_idx=True"):
        v.reference(q, k, k, batch_idx=True, batch_size=2, softcap=30.0)


def test_reference_refuses_integer_tensors():
    v = fivar.load("softcap")
    q = torch.randn(4, 2, 64)
    with pytest.raises(fivar.FivarError, match="variant 'softcap': reference: k must be a floating-point"):
        v.reference(q, torch.ones(4, 2, 64, dtype=torch.int32), q, softcap=30.0)


# --- numbers: constants and defaults fit the kernels' int32 / float32 ----------------------------------------------------
BIG_INT = 10**40
BIG_FLOAT = 10.0**39


def test_int_literal_beyond_int32():
    def logits(s, b, h, kh, qi, ki, p):
        return s + float(qi + 3000000000)  # BAD
    _expect(logits, match="3000000000 does not fit the kernels' 32-bit ints")


def test_int_global_beyond_int32():
    def logits(s, b, h, kh, qi, ki, p):
        return s if qi < BIG_INT else -s  # BAD
    _expect(logits, match="does not fit the kernels' 32-bit ints")


def test_negative_int_literal_just_past_int32():
    def mask(b, h, kh, qi, ki, p):
        return ki - qi > -2147483649  # BAD
    _expect(mask, role="mask", match="-2147483649 does not fit")


def test_float_literal_beyond_float32():
    def logits(s, b, h, kh, qi, ki, p):
        return s * 1e39  # BAD
    _expect(logits, match="1e+39 does not fit the kernels' 32-bit floats")


def test_float_literal_past_float64_which_python_reads_as_inf():
    """`1e400` parses to inf before fivar sees it: a number far outside float32, not an infinity meant as one (the
    targets then agreed on NaN rows)."""
    def logits(s, b, h, kh, qi, ki, p):
        return s + 1e400  # BAD
    _expect(logits, match="constant literal is past float64's range (Python reads it as inf)")


INF = float("inf")


def test_an_infinity_named_outside_the_function_is_fine():
    def logits(s, b, h, kh, qi, ki, p):
        return s if ki <= qi else -INF
    AttentionVariant(name="inf_ok", logits=logits).ir


def test_float_global_beyond_float32():
    def logits(s, b, h, kh, qi, ki, p):
        x = s - BIG_FLOAT  # BAD
        return x
    _expect(logits, match="does not fit the kernels' 32-bit floats")


def test_constants_at_the_edges_of_the_ranges_are_fine():
    def mask(b, h, kh, qi, ki, p):
        return (qi > -2147483648) and (ki < 2147483647) and (float(qi) < 3.4e38)

    def logits(s, b, h, kh, qi, ki, p):
        return s * 3000000000 - 1e-45  # an int in a float context is a float constant
    v = AttentionVariant(name="okvar", logits=logits, mask=mask)
    assert v.ir.logits is not None and v.ir.mask is not None


@pytest.mark.parametrize("dtype,default,why", [
    (float, math.nan, "must be finite"), (float, math.inf, "must be finite"), (float, -math.inf, "must be finite"),
    (float, 1e39, "32-bit floats"), (int, 2**40, "32-bit ints"), (int, -2**31 - 1, "32-bit ints")])
def test_scalar_defaults_are_range_checked(dtype, default, why):
    def logits(s, b, h, kh, qi, ki, p):
        return s * p.x
    declared = Scalar(dtype, default=default)
    with pytest.raises(FivarSpecError, match=f"Scalar parameter 'x': default .*{why}") as info:
        AttentionVariant(name="badvar", logits=logits, params={"x": declared})
    assert info.value.line == declared.where["line"]


def test_a_float_scalar_beyond_float32_is_refused_per_call():
    def logits(s, b, h, kh, qi, ki, p):
        return s * p.x
    v = AttentionVariant(name="okvar", logits=logits, params={"x": Scalar(float, default=1.0)})
    q = torch.randn(3, 1, 8)
    with pytest.raises(fivar.FivarError, match="parameter 'x' = 1e\\+39 does not fit the kernels' 32-bit floats"):
        v.reference(q, q, q, x=1e39)
    v.reference(q, q, q, x=3.0e38)


def _load_source(tmp_path, body: str, name="deep"):
    f = tmp_path / f"{name}.py"
    f.write_text("from fivar import AttentionVariant, tanh\n\n" + body +
                 f"\nvariant = AttentionVariant(name='{name}', logits=logits)\n")
    return fivar.load(str(f))


@pytest.mark.parametrize("body", [
    "def logits(s, b, h, kh, qi, ki, p):\n    return " + "tanh(" * 150 + "s" + ")" * 150 + "\n",
    "def logits(s, b, h, kh, qi, ki, p):\n    return " + " + ".join(["s"] * 600) + "\n",
    "def logits(s, b, h, kh, qi, ki, p):\n    x = s\n" + "    x = x * 0.5 + 1.0\n" * 200 + "    return x\n",
])
def test_deep_expressions_are_spec_errors_not_recursion_errors(tmp_path, body):
    with pytest.raises(FivarSpecError, match="expression nests deeper than 100 levels|cannot parse") as info:
        _load_source(tmp_path, body).ir
    assert info.value.filename.endswith("deep.py") and info.value.line >= 3


@pytest.mark.parametrize("terms", [
    lambda n: " and ".join(f"kv_idx != {i}" for i in n),  # flat in Python, a chain of `and`s in the IR
    lambda n: "0 <= " + " <= ".join(f"kv_idx + {i}" for i in n),  # a chained comparison: the same chain
])
def test_a_long_flat_condition_is_a_spec_error_naming_its_line_not_a_recursion_error(tmp_path, terms):
    import random
    count = random.randint(1500, 2500)
    pad = random.randint(0, 5)
    f = tmp_path / "long_mask.py"
    f.write_text("from fivar import AttentionVariant\n" + "\n" * pad + "\n\ndef mask(batch, qo_head, kv_head, q_idx, "
                 f"kv_idx, params):\n    return {terms(range(count))}\n\n\n"
                 "variant = AttentionVariant(name='long_mask', mask=mask)\n")
    with pytest.raises(FivarSpecError, match="expression nests deeper than 100 levels") as info:
        fivar.load(str(f)).ir
    err = info.value
    assert err.variant == "long_mask" and err.filename == str(f) and err.line == 5 + pad
    assert "\n" not in str(err)


def test_expressions_as_deep_as_allowed_are_fine(tmp_path):
    v = _load_source(tmp_path, "def logits(s, b, h, kh, qi, ki, p):\n    return " + "tanh(" * 60 + "s" + ")" * 60 +
                     "\n")
    assert v.lowered.logits is not None


def test_undefined_name_lists_the_allowed_names():
    def logits(s, b, h, kh, qi, ki, p):
        y = s * 2.0
        return y + undefined_thing  # BAD  # noqa: F821
    err = _expect(logits, match="name `undefined_thing` is not defined")
    assert "allowed: the arguments (s, b, h, kh, qi, ki, p), locals assigned above (y)" in str(err)
    assert "tanh" in err.allowed


def test_a_local_that_shadows_a_function_is_refused():
    def logits(s, b, h, kh, qi, ki, p):
        tanh = s * 2.0  # noqa: F841
        return tanh(s)  # BAD
    _expect(logits, match="`tanh` is an argument or local of `logits` here, not a function")


def test_a_variant_name_must_be_ascii():
    def logits(s, b, h, kh, qi, ki, p):
        return s
    with pytest.raises(FivarSpecError, match="name must be an ASCII Python identifier"):
        AttentionVariant(name="caf\u00e9", logits=logits)


def test_json_nested_too_deep_is_read_as_unreadable_not_a_recursion_error(tmp_path, monkeypatch):
    """fivar's small JSON files (nvcc versions, a library's verified stamp) nested beyond what json can read are
    treated like any unreadable cache file: asked or hashed again."""
    import json
    import os
    import random

    from fivar.jit import build, toolchain
    deep = "[" * random.randint(100_000, 200_000)
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "cache"))
    toolchain._nvcc_versions_file().parent.mkdir(parents=True, exist_ok=True)
    toolchain._nvcc_versions_file().write_text(deep)
    assert toolchain._nvcc_versions() == {}
    lib = tmp_path / "lib" / "m.so"
    lib.parent.mkdir()
    lib.write_bytes(os.urandom(64))
    (lib.parent / build._VERIFIED).write_text(deep)
    build._verified.pop(str(lib), None)
    assert build.library_verified(lib, lib.stat(), build._sha256(lib))
    assert json.loads((lib.parent / build._VERIFIED).read_text())["sha256"] == build._sha256(lib)


# --- a variant's `example`: what it returns is checked against the declarations, naming the example's line --------

def _example_variant(example):
    def logits(s, b, h, kh, qi, ki, p):
        return s + p.slopes[h] * float(p.w)
    return AttentionVariant(name="exv", logits=logits, example=example,
                            params={"slopes": Tensor("float32", ("qo_head",)), "w": Scalar(int, default=2)})


@pytest.mark.parametrize("case, says", [
    ("typo", "returned unknown parameter(s) slope (declared: slopes, w)"),
    ("dtype", "returned 'slopes' as torch.float64 of shape (4,); it is declared torch.float32 with dims ('qo_head',)"),
    ("rank", "returned 'slopes' as torch.float32 of shape (1, 4); it is declared torch.float32"),
    ("missing", "returned no 'slopes', which has no default"),
    ("scalar", "returned 2.5 for 'w' (parameter 'w' is an int parameter, got 2.5)"),
    ("list", "returned a list, not a dict of params"),
])
def test_a_bad_example_is_named_with_its_line(case, says):
    import torch
    from fivar.testing import example_params

    def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):
        s = torch.rand(num_qo_heads)
        return {"typo": {"slope": s}, "dtype": {"slopes": s.double()}, "rank": {"slopes": s[None]}, "missing": {"w": 3},
                "scalar": {"slopes": s, "w": 2.5}, "list": [s]}[case]
    line = inspect.getsourcelines(example)[1]
    with pytest.raises(fivar.FivarError) as info:
        example_params(_example_variant(example), num_qo_heads=4, num_kv_heads=2, batch_size=1, max_len=8, device="cpu")
    text = str(info.value)
    assert text.startswith(f"{__file__}:{line}: variant 'exv': its example() ") and says in text, text
    assert "\n" not in text


def test_a_good_example_is_returned_as_it_is():
    import torch
    from fivar.testing import example_params
    slopes = torch.rand(4)
    got = example_params(_example_variant(lambda num_qo_heads, num_kv_heads, batch_size, max_len, device: {
        "slopes": slopes}), num_qo_heads=4, num_kv_heads=2, batch_size=1, max_len=8, device="cpu")
    assert got.keys() == {"slopes"} and got["slopes"] is slopes


def test_int_of_a_computed_float_is_not_taken_for_a_zero(tmp_path):
    """int(1.0 - 1e-16) is 0 in Python's float64 and 1 in the kernels' float32: not known, so not refused; a float
    literal's int() is known (int(0.5) is 0 everywhere) and refused."""
    f = _mask_file(tmp_path, "f32", "    return qi // int(1.0 - 1e-16) == ki\n")
    assert fivar.load(str(f)).ir.mask is not None
    f = _mask_file(tmp_path, "half", "    return qi // int(0.5) == ki\n")
    with pytest.raises(FivarSpecError, match="integer `//` by zero"):
        fivar.load(str(f)).ir


@pytest.mark.parametrize("given,says", [
    (dict(slopes=torch.rand(3)), "dimension 0 \\('qo_head'\\) must be 2, got 3"),
    (dict(slopes=torch.rand(2, 1)), "must have 1 dimension"),
    (dict(slopes=torch.rand(2).double()), "must have dtype torch.float32"),
    (dict(slopes=[1.0, 2.0]), "must be a torch.Tensor"),
    (dict(slopes=torch.rand(2), scale=float("nan")), "must be finite"),
    (dict(), "missing parameter 'slopes'"),
    (dict(slopes=torch.rand(2), slope=1.0), "unknown parameter\\(s\\) slope"),
])
def test_a_bad_param_value_names_the_line_that_declared_it(tmp_path, given, says):
    f = tmp_path / "badvalue.py"
    f.write_text("from fivar import AttentionVariant, Scalar, Tensor\n\n"
                 "def logits(s, b, h, kh, qi, ki, p):\n    return s * p.scale + p.slopes[h]\n\n"
                 "variant = AttentionVariant(name='badvalue', logits=logits, params={\n"
                 "    'slopes': Tensor('float32', ('qo_head',)),\n"
                 "    'scale': Scalar(float, default=1.0),\n"
                 "})\n")
    v = fivar.load(str(f))
    line = 8 if "scale" in given else 3 if "slope" in given else 7  # the declaration; the logits for a name not declared
    q = torch.randn(3, 2, 8)
    with pytest.raises(fivar.FivarError, match=f"^{f}:{line}: variant 'badvalue': (parameter '(slopes|scale)' )?{says}") as e:
        v.reference(q, q[:, :1], q[:, :1], **given)
    assert "\n" not in str(e.value)
