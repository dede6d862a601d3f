"""Position-only logits terms as per-call tables (fivar.spec.positions, fivar.runtime.position_tables): which terms
the pass takes, that a table read equals the term it replaces, and the Triton twin with tables against the
reference (which never uses them)."""
import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fivar import AttentionVariant, Scalar, Tensor, clamp, exp, log, maximum, minimum, sigmoid, sqrt, tanh, where
from fivar.codegen import fa2, fa3
from fivar.codegen.torch_ref import TorchEvaluator
from fivar.codegen.triton import render_attention
from fivar.config import override
from fivar.errors import FivarError
from fivar.runtime.explain import mask_skipping
from fivar.runtime.params import BoundParams
from fivar.runtime.position_tables import table_values
from fivar.spec.positions import TABLE_PAD, table_offset
from fivar.spec import ir
from fivar.spec.ir import F32, I32
from fivar.spec.positions import tabulate
from fivar.testing import check_batch_prefill, check_decode, check_single_prefill

ROOT = Path(__file__).resolve().parents[2]


def _zoo(name):
    spec = importlib.util.spec_from_file_location(f"zoo_{name}", ROOT / "benchmarks" / "zoo" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.variant


PARAMS = {"bias": Tensor("float32", ("qo_head", "n")), "slopes": Tensor("float32", ("qo_head",)),
          "pair": Tensor("float32", ("n", "n")), "idx": Tensor("int32", ("n",)), "r": Scalar(int, default=8),
          "c": Scalar(float, default=0.5), "per_batch": Tensor("float32", ("batch", "n"))}


def _variant(fn):
    return AttentionVariant(name="pos_" + fn.__name__, logits=fn, params=PARAMS)


# --- detection -----------------------------------------------------------------------------------------------
def t5(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    rel = kv_idx - q_idx
    n = abs(rel)
    far = 8 + int(log(float(maximum(n, 1)) / 8.0) / log(16.0) * 8.0)
    return score + params.bias[qo_head, where(rel > 0, 16, 0) + where(n < 8, n, minimum(far, 15))]


def learned_clamped(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.bias[qo_head, clamp(q_idx - kv_idx, 0, params.r)]


def gather_chain(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.bias[kv_head, params.idx[clamp(kv_idx - q_idx, -params.r, params.r) + params.r]]


def per_head_decay(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    d = float(kv_idx - q_idx)
    return score - params.slopes[qo_head] * sqrt(abs(d) + 1.0) + tanh(d * params.c)


def softcap_times_position(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return tanh(score * 0.1) * exp(-abs(float(q_idx - kv_idx)) * params.c)


def alibi(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.slopes[qo_head] * float(kv_idx - q_idx)


def reads_q_alone(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + log(float(q_idx + 1)) + params.bias[qo_head, clamp(kv_idx - q_idx, 0, 4) + q_idx % 2]


def reads_kv_alone(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + sigmoid(float(kv_idx) * params.c)


def reads_score(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + tanh(score * float(kv_idx - q_idx))


def reads_batch(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.per_batch[batch, clamp(kv_idx - q_idx, 0, 9)] * log(2.0 + float(batch))


def per_pair_tensor(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + exp(params.pair[q_idx, kv_idx])


def position_free(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + exp(params.slopes[qo_head])


def saturating_distance(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    d = abs(float(kv_idx - q_idx))
    return score - params.slopes[qo_head] * d / (1.0 + params.c * d) + float(kv_idx - q_idx) / 64.0


def divides_by_score(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score / (1.0 + abs(score)) + float(kv_idx - q_idx) / 8.0


# (function, tables in "costly" mode, tables in "all" mode)
CASES = [(t5, 1, 1), (learned_clamped, 0, 1), (gather_chain, 1, 1), (per_head_decay, 2, 2),
         (softcap_times_position, 1, 1), (alibi, 0, 1), (reads_q_alone, 0, 0), (reads_kv_alone, 0, 0),
         (reads_score, 0, 0), (reads_batch, 0, 0), (per_pair_tensor, 0, 0), (position_free, 0, 0),
         # a division by a variable is costly (a reciprocal beside the softmax's exponential), by a constant not
         (saturating_distance, 1, 2), (divides_by_score, 0, 1)]


@pytest.mark.parametrize("fn,costly,all_", CASES, ids=[c[0].__name__ for c in CASES])
def test_which_terms_become_tables(fn, costly, all_):
    v = _variant(fn)
    for mode, want in (("costly", costly), ("all", all_), ("off", 0)):
        program, tables, offset = tabulate(v.ir.logits, mode, tuple(v.params))
        assert len(tables) == want, (mode, [ir.format_expr(t.term.result) for t in tables])
        reads = {n.param for n in ir.walk(program.result) if isinstance(n, ir.Load)}
        assert {t.name for t in tables} <= reads  # every table is read, none is dead
        for t in tables:  # what a table replaced reads no per-pair position, score or batch
            names = {n.name for e in t.term.exprs() for n in ir.walk(e) if isinstance(n, ir.Index)}
            assert "batch" not in names and not any(isinstance(n, (ir.Score, ir.RawScore))
                                                    for e in t.term.exprs() for n in ir.walk(e))


def test_mutated_distance_is_not_position_only():
    """Each mutation of `kv_idx - q_idx` into something that is not the distance stops the table."""
    base = _variant(t5).ir.logits
    assert tabulate(base, "costly")[1]
    rel = ir.Binary(I32, "sub", ir.Index(I32, "kv_idx"), ir.Index(I32, "q_idx"))
    for mutant in (ir.Binary(I32, "add", ir.Index(I32, "kv_idx"), ir.Index(I32, "q_idx")),
                   ir.Binary(I32, "sub", ir.Index(I32, "kv_idx"), ir.Index(I32, "batch")),
                   ir.Binary(I32, "sub", ir.Index(I32, "kv_idx"), ir.Const(I32, 3)),
                   ir.Binary(I32, "sub", ir.Index(I32, "q_idx"), ir.Index(I32, "q_idx"))):
        lets = [(n, ir.rewrite(e, lambda x, m=mutant: m if x == rel else None)) for n, e in base.lets]
        assert tabulate(ir.Program(lets, base.result), "costly")[1] == ()


def test_synthesized_names_avoid_the_variants_own():
    params = {**PARAMS, "fv_pos_table0": Tensor("float32", ("n",)), "fv_pos_offset": Scalar(int, default=1)}
    v = AttentionVariant(name="pos_names", logits=t5, params=params)
    with override(position_tables="costly"):
        low = v.lowered
        assert [t.name for t in low.position_tables] == ["fv_pos_table1"]
        assert set(low.params) == {"fv_pos_table1", "fv_pos_offset0"}


def test_config_modes_and_refusal(monkeypatch):
    v = _variant(alibi)
    assert not v.lowered.position_tables  # the default: slope * distance stays inline
    with override(position_tables="all"):
        assert v.lowered.position_tables
    monkeypatch.setenv("FIVAR_POSITION_TABLES", "always")
    with pytest.raises(FivarError, match="FIVAR_POSITION_TABLES"):
        v.lowered


# --- the table read equals the term ----------------------------------------------------------------------
def _per_element_vs_table(program, params, hq=3, hkv=1, qo_len=7, kv_len=11, mode="all"):
    """(the program evaluated per element, the tabulated program reading its tables) over one request's pairs."""
    new, tables, offset = tabulate(program, mode, tuple(params))
    length = max(qo_len, kv_len)
    bound = BoundParams({k: v for k, v in params.items() if not isinstance(v, torch.Tensor)},
                        {k: v for k, v in params.items() if isinstance(v, torch.Tensor)}, hq, hkv, "cpu")
    qo_head = torch.arange(hq, dtype=torch.int32)[:, None, None]
    env = {"qo_head": qo_head, "kv_head": qo_head // (hq // hkv), "batch": torch.zeros(1, 1, 1, dtype=torch.int32),
           "q_idx": (torch.arange(qo_len, dtype=torch.int32) + kv_len - qo_len)[None, :, None],
           "kv_idx": torch.arange(kv_len, dtype=torch.int32)[None, None, :],
           "score": torch.randn(hq, qo_len, kv_len), "sm_scale": 1.0}
    want = TorchEvaluator(env, params, torch.float32, "cpu").run(program)
    extra = {t.name: table_values(None, t, bound, length) for t in tables}
    if offset is not None:
        extra[offset] = table_offset(length)
    got = TorchEvaluator(env, {**params, **extra}, torch.float32, "cpu").run(new)
    return want, got, tables


def _random_params(seed, hq=3):
    g = torch.Generator().manual_seed(seed)
    return {"bias": torch.randn(hq, 9, generator=g), "slopes": torch.rand(hq, generator=g) + 0.1,
            "pair": torch.randn(4, 4, generator=g), "idx": torch.randint(0, 9, (9,), generator=g, dtype=torch.int32),
            "r": 4, "c": 0.3, "per_batch": torch.randn(1, 4, generator=g)}


@pytest.mark.parametrize("fn", [t5, learned_clamped, gather_chain, per_head_decay, softcap_times_position, alibi])
def test_table_equals_the_term_on_the_zoo_shapes(fn):
    for hq, hkv, qo_len, kv_len in ((3, 1, 7, 11), (4, 2, 1, 19), (2, 2, 13, 5)):
        want, got, tables = _per_element_vs_table(_variant(fn).ir.logits, _random_params(hq * 7 + kv_len, hq),
                                                  hq, hkv, qo_len, kv_len)
        assert tables
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_wrong_offset_is_caught():
    """The comparison above fails when the table is read one column off."""
    new, tables, offset = tabulate(_variant(t5).ir.logits, "costly")
    params = _random_params(1)
    bound = BoundParams({"r": 4, "c": 0.3}, {k: v for k, v in params.items() if isinstance(v, torch.Tensor)}, 3, 1,
                        "cpu")
    env = {"qo_head": torch.arange(3, dtype=torch.int32)[:, None, None], "q_idx": torch.arange(20)[None, :, None],
           "kv_idx": torch.arange(20)[None, None, :], "score": torch.zeros(3, 20, 20), "sm_scale": 1.0}
    env["kv_head"] = env["qo_head"] // 3
    want = TorchEvaluator(env, params, torch.float32, "cpu").run(_variant(t5).ir.logits)
    table = table_values(None, tables[0], bound, 20)
    got = TorchEvaluator(env, {**params, tables[0].name: table, offset: table_offset(20) + 1}, torch.float32,
                         "cpu").run(new)
    assert not torch.allclose(got, want)


def _leaf(draw):
    dist = ir.Binary(I32, "sub", *[ir.Index(I32, n) for n in draw(st.permutations(["kv_idx", "q_idx"]))])
    choice = draw(st.sampled_from(["dist", "clamped", "head", "scalar", "const"]))
    if choice == "dist":
        return ir.Cast(F32, dist)
    if choice == "clamped":
        lo, hi = draw(st.integers(-6, 0)), draw(st.integers(0, 6))
        idx = ir.Call(I32, "minimum", (ir.Call(I32, "maximum", (dist, ir.Const(I32, lo))), ir.Const(I32, hi)))
        return ir.Load(F32, "bias", (ir.Index(I32, draw(st.sampled_from(["qo_head", "kv_head"]))),
                                     ir.Binary(I32, "add", idx, ir.Const(I32, 4))))
    if choice == "head":
        return ir.Load(F32, "slopes", (ir.Index(I32, "qo_head"),))
    if choice == "scalar":
        return ir.ScalarParam(F32, "c")
    return ir.Const(F32, draw(st.floats(-3, 3, allow_nan=False)))


@st.composite
def position_exprs(draw, depth=3):
    if depth == 0 or draw(st.booleans()) and depth < 3:
        return _leaf(draw)
    kind = draw(st.sampled_from(["bin", "fn", "select", "floor_int"]))
    a = draw(position_exprs(depth=depth - 1))
    if kind == "bin":
        b = draw(position_exprs(depth=depth - 1))
        return ir.Binary(F32, draw(st.sampled_from(["add", "sub", "mul"])), a, b)
    if kind == "fn":
        fn = draw(st.sampled_from(["tanh", "sigmoid", "exp", "sqrt", "log"]))
        arg = ir.Call(F32, "abs", (a,)) if fn in ("sqrt", "log") else ir.Call(F32, "tanh", (a,)) if fn == "exp" else a
        return ir.Call(F32, fn, (arg,))
    if kind == "select":
        b = draw(position_exprs(depth=depth - 1))
        return ir.Select(F32, ir.Binary("bool", "gt", a, ir.Const(F32, 0.0)), a, b)
    return ir.Cast(F32, ir.Cast(I32, ir.Call(F32, "floor", (a,))))


@settings(max_examples=60, deadline=None)
@given(term=position_exprs(), seed=st.integers(0, 2**16), shape=st.sampled_from([(3, 1, 7, 11), (4, 2, 1, 9),
                                                                                    (2, 2, 12, 6)]))
def test_random_position_terms_tabulate_exactly(term, seed, shape):
    """score + term, the term made of the distance, the heads, params and costly functions: the table path gives
    the per-element values within float32 tolerance (the same float32 ops, on other operands' broadcast)."""
    program = ir.Program([], ir.Binary(F32, "add", ir.Score(F32), term))
    want, got, tables = _per_element_vs_table(program, _random_params(seed, shape[0]), *shape)
    reads_distance = any(isinstance(n, ir.Index) and n.name == "kv_idx" for n in ir.walk(term))
    assert bool(tables) == reads_distance
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


# --- end to end on the Triton twin (interpreter) ----------------------------------------------------------
def _with_tables(v, mode):
    with override(position_tables=mode):
        assert v.lowered.position_tables, v.name
        assert "fv_pos_table0" in render_attention(v)


@pytest.mark.parametrize("name,mode", [("t5_buckets", "costly"), ("learned_relative_table", "all")])
def test_triton_with_tables_matches_the_reference(name, mode):
    v = _zoo(name)
    _with_tables(v, mode)
    kw = dict(device="cpu", dtype=torch.float16, backend="triton", head_dim=16)
    with override(position_tables=mode):
        results = [check_single_prefill(v, qo_len=lq, kv_len=lk, causal=c, num_qo_heads=4, num_kv_heads=2, **kw)
                   for lq, lk, c in ((37, 53, False), (37, 53, True), (1, 20, False))]
        results.append(check_batch_prefill(v, qo_lens=[5, 1, 17], kv_lens=[19, 7, 17], paged=False, causal=True,
                                           num_qo_heads=4, num_kv_heads=1, **kw))
        results.append(check_batch_prefill(v, qo_lens=[3, 9], kv_lens=[30, 9], paged=False, causal=False,
                                           num_qo_heads=2, num_kv_heads=2, **kw))
        results.append(check_decode(v, kv_lens=[1, 9, 40], page_size=4, num_qo_heads=4, num_kv_heads=2, **kw))
    for r in results:
        assert r.passed, r


def test_explain_says_what_happens():
    v = _zoo("t5_buckets")
    line = mask_skipping(v)[-1]
    assert "fv_pos_table0" in line and "once per call" in line
    assert "none tabulated" in mask_skipping(_variant(alibi))[-1]


# --- the CUDA structs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["t5_buckets"])
def test_fa2_and_fa3_structs_gather_the_table(name):
    v = _zoo(name)
    fa2_text = fa2.variant_decl(v).source
    fa3_text = fa3.variant_decl(v).source
    for text in (fa2_text, fa3_text):
        assert "fvp_fv_pos_table0" in text and "fvp_fv_pos_offset" in text
        assert "fivar::log" not in text  # the buckets' log is in the table, not per element
    with override(position_tables="off"):
        assert "fivar::log" in fa2.variant_decl(v).source
    # the table holds every distance a kernel reads: no clamp on its read, while a user's table keeps its clamp
    for text in (fa2_text, fa3_text):
        read = text[text.index("fvp_fv_pos_table0["):].split(";")[0]
        assert "clamp_index" not in read, read
    learned = fa3.variant_decl(_zoo("learned_relative_table")).source
    read = learned[learned.index("fvp_bias["):].split(";")[0]
    # the user's clamp(q - kv, 0, max_distance) and the bounds clamp as one: the head clamped, the distance once
    assert read.count("clamp_index") == 1 and "fvsize1_bias - 1 < fvp_max_distance" in read, read


def test_one_clamp_equals_the_users_then_the_bounds():
    """min(max(x, 0), max(min(hi, size - 1), 0)), the emitted single clamp, equals the bounds clamp of the user's
    clamp to [0, hi] for every x, hi and size (hi below 0 or past the table included)."""
    from fivar.codegen.cuda import _clamped_from_zero
    from fivar.spec import ir
    x, hi = ir.Index(ir.I32, "kv_idx"), ir.ScalarParam(ir.I32, "r")
    zero = ir.Const(ir.I32, 0)
    for inner in (ir.Call(ir.I32, "maximum", (x, zero)), ir.Call(ir.I32, "maximum", (zero, x))):
        for outer in (ir.Call(ir.I32, "minimum", (inner, hi)), ir.Call(ir.I32, "minimum", (hi, inner))):
            assert _clamped_from_zero(outer) == (x, hi)
    assert _clamped_from_zero(ir.Call(ir.I32, "minimum", (ir.Call(ir.I32, "maximum", (x, ir.Const(ir.I32, 1))),
                                                            hi))) is None  # from 1: not this rule
    assert _clamped_from_zero(ir.Call(ir.I32, "minimum", (ir.Call(ir.I32, "maximum", (x, zero)), x))) is None
    g = torch.Generator().manual_seed(3)
    xs, his = torch.randint(-50, 50, (4000,), generator=g), torch.randint(-10, 60, (4000,), generator=g)
    sizes = torch.randint(1, 40, (4000,), generator=g)
    want = torch.minimum(torch.maximum(xs, torch.zeros_like(xs)), his).clamp(min=0)
    want = torch.minimum(want, sizes - 1)
    bound = torch.where(sizes - 1 < his, sizes - 1, his).clamp(min=0)
    got = torch.minimum(xs.clamp(min=0), bound)
    assert torch.equal(got, want)


def test_tables_reach_past_the_call_by_the_pad():
    """Every distance a kernel's tile padding can read (up to TABLE_PAD past the call's runs, either side) is a
    column of the table holding the term there: the structs read it unclamped."""
    new, tables, offset = tabulate(_variant(t5).ir.logits, "costly")
    params = _random_params(2)
    bound = BoundParams({"r": 4, "c": 0.3}, {k: v for k, v in params.items() if isinstance(v, torch.Tensor)}, 3, 1,
                        "cpu")
    length = 9
    table = table_values(None, tables[0], bound, length)
    d = torch.arange(-(length - 1 + TABLE_PAD), length + TABLE_PAD)
    assert table.shape[1] == d.numel() and TABLE_PAD >= 256  # the widest FA3 tile, with room
    env = {"qo_head": torch.arange(3, dtype=torch.int32)[:, None], "q_idx": torch.zeros(1, 1, dtype=torch.int32),
           "kv_idx": d.to(torch.int32)[None, :], "sm_scale": 1.0}
    env["kv_head"] = env["qo_head"] // 3
    want = TorchEvaluator(env, params, torch.float32, "cpu").run(tables[0].term).expand_as(table)
    torch.testing.assert_close(table[:, table_offset(length) + d], want)


NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


@pytest.mark.nvcc
@pytest.mark.skipif(not (os.path.exists(NVCC) or shutil.which("nvcc")), reason="no nvcc")
def test_fa2_module_with_a_table_compiles_for_sm90a():
    from fivar.jit.build import build_many, gen_module
    v = _zoo("t5_buckets")
    assert "fvp_fv_pos_table0" in fa2.variant_decl(v).source
    m = gen_module(v, op="single_prefill", target="fa2", dtype="bf16", head_dim=128)
    build_many([m])
    assert m.library_path.exists()


@pytest.mark.parametrize("name,has", [("t5_buckets", True), ("alibi_softcap", True), ("learned_relative_table", True),
                                      ("gemma2_local", False), ("sigmoid_head_bias", False),
                                      ("packed_documents", False)])
def test_position_terms_are_found_whatever_they_cost(name, has):
    """has_position_term (the benchmark's cue to time plain attention as a yardstick) finds a term of the head and
    the distance in any form, cheap ones included (ALiBi's slope times the distance), and nothing in a soft-cap, a
    per-head bias or a mask-only variant."""
    from fivar.registry import load_file
    from fivar.spec.positions import has_position_term
    zoo = Path(__file__).resolve().parents[2] / "benchmarks" / "zoo"
    v = load_file(zoo / f"{name}.py")
    assert has_position_term(v.ir.logits) is has


def test_table_reads_share_one_distance_clamp_and_the_gluon_logits_skip_the_tile_test():
    """Every table's distance column is clamped by the same expression (twice the offset: the table's last column),
    so a kernel reading several tables computes it once; the Triton functions keep a table's gather behind the tile
    test (a branch never taken, which keeps the pipeliner from staging the gather), the Gluon kernels' logits read it
    plainly."""
    from fivar.codegen.triton_bwd import render_training
    v = _variant(saturating_distance)
    with override(position_tables="all"):
        text = render_training(v)
    clamp = "tl.minimum(tl.maximum(((kv_idx - q_idx) + fvp_fv_pos_offset), 0), 2 * fvp_fv_pos_offset)"
    body = lambda name: text.split(f"def {name}(")[1].split("):\n", 1)[1].split("\n\n\n")[0]  # noqa: E731
    assert "fvsize1_fv_pos_table" not in body("variant_logits") + body("gl_variant_logits")
    assert body("variant_logits").count(clamp) >= 2 and "if (" in body("variant_logits")
    assert body("gl_variant_logits").count(clamp) == 2 and "if (" not in body("gl_variant_logits")
