"""The Triton twin of every bundled variant, run by Triton's interpreter on the CPU, against the torch
reference at small awkward shapes (lengths off the tile size, qo_len != kv_len, GQA, ragged batches,
paged decode with several KV splits)."""
import pytest
import torch
import triton
from click.testing import CliRunner

import fivar
from fivar import AttentionVariant, Scalar, Tensor
from fivar.testing import _ragged_reference, _to_paged, compare, document_ids, example_params
from logit_factors import FACTORS

BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias",
           "softcap_sliding_window"]
DTYPE = torch.float16  # the interpreter has no bfloat16 arithmetic; fp16 is a dtype the kernels accept


@pytest.fixture(autouse=True, scope="module")
def interpret():
    """Triton picks interpreted vs compiled when a kernel is defined: set the mode for this module only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _params(variant, hq, hkv, batch, max_len):
    # Windows short enough to mask inside these small sequences.
    params = example_params(variant, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, max_len=max_len,
                            device="cpu")
    if "window" in variant.params:
        params["window"] = int(torch.randint(2, max(3, max_len // 2), (1,)))
    if "max_distance" in params:
        params["max_distance"] = 6
        params["bias"] = torch.randn(hq, 13)
    return params


def _qkv(lq, lk, hq, hkv, d):
    return (torch.randn(lq, hq, d, dtype=DTYPE), torch.randn(lk, hkv, d, dtype=DTYPE),
            torch.randn(lk, hkv, d, dtype=DTYPE))


def _check(name, case, out, ref):
    r = compare(name, case, out, ref, DTYPE)
    assert r.passed, r


SINGLE = [(5, 19, 4, 2, 16, False), (5, 19, 4, 2, 16, True), (16, 16, 2, 2, 32, True), (37, 45, 4, 1, 32, False),
          (23, 7, 2, 1, 16, True)]  # qo_len > kv_len: the first rows see no key


@pytest.mark.parametrize("lq,lk,hq,hkv,d,causal", SINGLE)
@pytest.mark.parametrize("name", BUNDLED)
def test_single_prefill(name, lq, lk, hq, hkv, d, causal):
    v = fivar.load(name)
    q, k, vv = _qkv(lq, lk, hq, hkv, d)
    params = _params(v, hq, hkv, 1, lk)
    out = v.prefill(q, k, vv, causal=causal, backend="triton", **params)
    _check(name, f"qo{lq} kv{lk} {hq}/{hkv} hd{d} causal={causal}", out, v.reference(q, k, vv, causal=causal,
                                                                                   **params))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", BUNDLED)
def test_batch_prefill_ragged(name, causal):
    v = fivar.load(name)
    qo_lens, kv_lens, hq, hkv, d = [5, 1, 17], [19, 7, 17], 4, 2, 16
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), hq, hkv, d)
    params = _params(v, hq, hkv, len(qo_lens), max(kv_lens))
    qo_indptr = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 19, 26, 43], dtype=torch.int32)
    out = v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=causal, backend="triton", **params)
    _check(name, f"ragged causal={causal}", out, _ragged_reference(v, q, k, vv, qo_lens, kv_lens, causal, params))


@pytest.mark.parametrize("name", BUNDLED)
def test_decode_paged(name):
    v = fivar.load(name)
    kv_lens, hq, hkv, d = [1, 9, 40], 4, 2, 16
    q = torch.randn(len(kv_lens), hq, d, dtype=DTYPE)
    _, k, vv = _qkv(1, sum(kv_lens), hq, hkv, d)
    params = _params(v, hq, hkv, len(kv_lens), max(kv_lens))
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=4)
    out = v.decode(q, cache, indptr, indices, last, backend="triton", **params)
    _check(name, "decode page 4", out, _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params))


def test_decode_merges_several_splits():
    """40 keys at the interpreter's 16-token minimum split: the merge step combines 3 partial results."""
    mod = fivar.jit.triton_module.load_triton_module(fivar.load("softcap"))
    assert mod.decode_splits(programs=1, max_kv_len=40, device=torch.device("cpu")) == 3



def _global_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return (params.flag[batch, kv_idx] == 1 or q_idx - kv_idx < params.w) and kv_idx <= q_idx


def _strided(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return (q_idx - kv_idx) % params.c == 0


@pytest.mark.parametrize("mask", [_global_window, _strided], ids=lambda f: f.__name__)
def test_decode_reads_only_the_pages_holding_kept_keys(mask, monkeypatch):
    """A mask keeping keys in many runs (flagged global keys and a window, every c-th key back): the twin's decode
    reads only the pages that may keep a key, through a list of them (any number of runs, over several splits),
    and matches the reference; the lists hold fewer pages than the requests."""
    from fivar.runtime import triton_attention
    v = AttentionVariant(name=f"kept_pages{mask.__name__}", mask=mask, params={
        "w": Scalar(int, default=3), "c": Scalar(int, default=9), "flag": Tensor("int32", ("batch", "position"))})
    lists = []
    listing = triton_attention.kept_page_list
    monkeypatch.setattr(triton_attention, "kept_page_list", lambda *a: lists.append(listing(*a)) or lists[-1])
    kv_lens, hq, hkv, d, page = [1, 70, 131], 4, 2, 16, 4
    q = torch.randn(len(kv_lens), hq, d, dtype=DTYPE)
    _, k, vv = _qkv(1, sum(kv_lens), hq, hkv, d)
    params = {"w": int(torch.randint(2, 6, ())), "c": int(torch.randint(9, 20, ())),
              "flag": (torch.rand(len(kv_lens), max(kv_lens)) < 0.03).to(torch.int32)}
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=page)
    out = v.decode(q, cache, indptr, indices, last, backend="triton", **params)
    _check(v.name, "decode of kept pages", out,
           _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params))
    (kept_indptr, kept_pages, longest), = lists
    assert int(kept_indptr[-1]) == kept_pages.numel() < int(indptr[-1]) and longest < max(kv_lens), (kept_pages, indptr)


def test_decode_keeps_its_page_list_between_steps_until_an_input_changes(monkeypatch):
    """The kept-page list is made once per batch layout and params (like the prefill's block maps): a second step
    with the same tensors makes none, and a write to the flags or to a request's last page makes a new one, whose
    output still matches the reference (no stale list)."""
    from fivar.runtime import triton_attention
    v = AttentionVariant(name="kept_pages_reused", mask=_global_window, params={
        "w": Scalar(int, default=3), "c": Scalar(int, default=9), "flag": Tensor("int32", ("batch", "position"))})
    made = []
    listing = triton_attention.kept_page_list
    monkeypatch.setattr(triton_attention, "kept_page_list", lambda *a: made.append(1) or listing(*a))
    kv_lens, hq, hkv, d, page = [37, 70, 131], 4, 2, 16, 4
    q = torch.randn(len(kv_lens), hq, d, dtype=DTYPE)
    _, k, vv = _qkv(1, sum(kv_lens), hq, hkv, d)
    flag = (torch.rand(len(kv_lens), max(kv_lens)) < 0.03).to(torch.int32)
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=page)

    def step(what):
        lens = [int(n) for n in (indptr[1:] - indptr[:-1] - 1) * page + last]
        out = v.decode(q, cache, indptr, indices, last, backend="triton", flag=flag)
        keys = [k[sum(kv_lens[:b]):sum(kv_lens[:b]) + n] for b, n in enumerate(lens)]
        values = [vv[sum(kv_lens[:b]):sum(kv_lens[:b]) + n] for b, n in enumerate(lens)]
        ref = _ragged_reference(v, q, torch.cat(keys), torch.cat(values), [1] * len(lens), lens, False,
                                {"flag": flag})
        _check(v.name, what, out, ref)
    step("first step")
    step("same inputs")
    assert len(made) == 1, made
    flag[1, int(torch.randint(0, kv_lens[1] - 8, ()))] = 1 - flag[1, 0]  # an in-place write: a new version
    step("flags written")
    assert len(made) == 2, made
    last[2] = int(torch.randint(1, int(last[2]), ()))  # 131 keys in pages of 4: its last page held 3
    step("a request's last page shortened")
    assert len(made) == 3, made

# --- semantics the emitter must get right: Python // and %, int() truncation, clamped indices, masks
def _semantics_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    d = kv_idx - q_idx
    wrapped = float(d // 3) * 0.25 + float(d % 5) * 0.5 - float(int(score * 2.5)) * 0.1
    return score + wrapped + params.table[qo_head, d + params.shift]  # reads past both ends: clamped


def _middle_band(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < 6 or kv_idx >= 30  # interior tiles are masked too


SEMANTICS = AttentionVariant(name="triton_semantics", logits=_semantics_logits, mask=_middle_band, params={
    "table": Tensor("float32", ("qo_head", "offset")), "shift": Scalar(int, default=3)})


@pytest.mark.parametrize("causal", [False, True])
def test_floor_division_truncation_clamping_and_interior_masks(causal):
    q, k, vv = _qkv(21, 45, 4, 2, 16)
    params = {"table": torch.randn(4, 9), "shift": 3}
    out = SEMANTICS.prefill(q, k, vv, causal=causal, backend="triton", **params)
    _check("triton_semantics", f"causal={causal}", out, SEMANTICS.reference(q, k, vv, causal=causal, **params))


# --- logits factors the optimizer folds into the softmax scale, signs kept in the logits (logit_factors.py)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("v", FACTORS, ids=lambda v: v.name)
def test_logits_factors_fold_into_the_softmax_scale_with_their_sign(v, causal):
    q, k, vv = _qkv(13, 29, 4, 2, 16)
    params = {"temp": float(torch.empty(()).uniform_(0.3, 3.0))} if v.params else {}
    out = v.prefill(q, k, vv, causal=causal, backend="triton", **params)
    _check(v.name, f"causal={causal}", out, v.reference(q, k, vv, causal=causal, **params))


def test_a_factor_that_params_make_negative_is_refused_by_name():
    temperature = next(v for v in FACTORS if v.name == "temperature")
    q, k, vv = _qkv(4, 4, 2, 2, 16)
    with pytest.raises(fivar.FivarError, match=r"variant 'temperature': the logits factor `\(sm_scale / "
                                               r"params.temp\)` evaluates to -0.\d+ .*positive"):
        temperature.prefill(q, k, vv, backend="triton", temp=-1.0)


def _shadowing_locals(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    fv_q_lo = batch + 0  # the twin's tile-range arguments and helpers: the user's names must not replace them
    fv_kv_hi = batch + 1
    _py_mod = q_idx + fv_q_lo
    return score + params.rel[q_idx - kv_idx + 4] + float(kv_idx % 3) * 0.5 + float(_py_mod + fv_kv_hi) * 0.01


SHADOWING = AttentionVariant(name="shadowing_locals", logits=_shadowing_locals,
                             params={"rel": Tensor("float32", ("n",))})


@pytest.mark.parametrize("causal", [False, True])
def test_locals_named_like_generated_code_do_not_replace_it(causal):
    q, k, vv = _qkv(21, 45, 4, 2, 16)
    params = {"rel": torch.randn(9)}
    out = SHADOWING.prefill(q, k, vv, causal=causal, backend="triton", **params)
    _check("shadowing_locals", f"causal={causal}", out, SHADOWING.reference(q, k, vv, causal=causal, **params))


def _truncated_param(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + float(int(params.f)) * 0.25 - float(int(-params.f))


def _per_head_or_key(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx <= q_idx - 3 or params.open[qo_head] > 0.0  # one value per program, one per element


def _per_head_and_key(batch, qo_head, kv_head, q_idx, kv_idx, params):
    keep = params.open[qo_head] > 0.0
    return keep and kv_idx % 3 != 1


PER_PROGRAM = [AttentionVariant(name="truncated_param", logits=_truncated_param,
                                params={"f": Scalar(float, default=1.5)})] + [
    AttentionVariant(name=f.__name__[1:], mask=f, params={"open": Tensor("float32", ("qo_head",))})
    for f in (_per_head_or_key, _per_head_and_key)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("v", PER_PROGRAM, ids=lambda v: v.name)
def test_values_per_program_mixed_with_values_per_element(v, causal):
    q, k, vv = _qkv(21, 37, 4, 2, 16)
    params = {"f": float(torch.empty(()).uniform_(-4, 4))} if "f" in v.params else {
        "open": torch.tensor([1.0, -1.0, 0.5, -0.5])}
    out = v.prefill(q, k, vv, causal=causal, backend="triton", **params)
    _check(v.name, f"causal={causal}", out, v.reference(q, k, vv, causal=causal, **params))


def test_module_is_cached_by_content_hash(tmp_path, monkeypatch):
    from fivar.jit import triton_module
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path))
    v = AttentionVariant(name="hash_probe", logits=_semantics_logits, params=SEMANTICS.params)
    mod = triton_module.load_triton_module(v)
    files = list((tmp_path / "triton").glob("fivar_hash_probe_triton_*.py"))
    assert [f.stem for f in files] == [mod.__name__.removesuffix("_interpreted")]
    assert files[0].read_text() == fivar.codegen.triton.render_attention(v)
    assert triton_module.load_triton_module(v) is mod


def test_cpu_inputs_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    v = fivar.load("softcap")
    q, k, vv = _qkv(4, 4, 2, 2, 16)
    with pytest.raises(fivar.FivarError, match="CUDA tensors.*TRITON_INTERPRET=1"):
        v.prefill(q, k, vv, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
@pytest.mark.parametrize("backend", ["auto", "fa2", "triton"])
def test_plans_without_a_gpu_say_so(backend):
    """A plan holds FlashInfer kernels: on the CPU it is refused in one line (not torch's 'not compiled with CUDA'
    assertion), and the Triton twin, which has no plan step, points at the one-shot calls."""
    v = fivar.load("softcap")
    indptr = torch.tensor([0, 5, 9], dtype=torch.int32)
    want = "a plan holds.*no plan step.*backend='triton'" if backend == "triton" else "a plan runs FlashInfer's kernels on a CUDA GPU"
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': {want}"):
        v.plan_ragged(indptr, indptr, num_qo_heads=4, num_kv_heads=2, head_dim=64, backend=backend, device="cpu")
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': {want}"):
        v.plan_decode(indptr, torch.arange(9, dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32),
                      num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=1, backend=backend)


def test_bfloat16_on_the_cpu_is_refused_not_miscomputed():
    """The interpreter has no bfloat16 arithmetic (it returned values around 1e8 where the reference has 1)."""
    v = fivar.load("softcap")
    q, k, vv = (t.bfloat16() for t in _qkv(16, 16, 2, 2, 16))
    with pytest.raises(fivar.FivarError, match="variant 'softcap': bfloat16 on the CPU.*use float16"):
        v.prefill(q, k, vv, backend="triton")


def test_bad_params_are_reported_before_launch():
    v = fivar.load("alibi")
    q, k, vv = _qkv(4, 4, 2, 2, 16)
    with pytest.raises(fivar.FivarError, match="missing parameter 'slopes'"):
        v.prefill(q, k, vv, backend="triton")
    with pytest.raises(fivar.FivarError, match="head_dim 24"):
        fivar.load("softcap").prefill(*_qkv(4, 4, 2, 2, 24), backend="triton")


def _score_indexed(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    bucket = int(score * 4.0) + 8
    return score + params.table[bucket]


def _wrapped_offset(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.table[qo_head, (kv_idx - q_idx) % 5]


def test_explain_says_how_the_twin_reads_each_tensor():
    from fivar.codegen.triton import TritonEmitter
    plan = dict(TritonEmitter(fivar.load("document_mask")).read_plan())
    assert plan == {"params.doc_ids[batch, q_idx]": "once per program (does not depend on the key)",
                    "params.doc_ids[batch, kv_idx]": "once per key (a row of values per tile)"}
    assert dict(TritonEmitter(fivar.load("relative_bias")).read_plan()) == {
        "params.bias[qo_head, offset]": "one value per tile where its clamped index cannot vary, else a gather"}
    wrapped = AttentionVariant(name="wrapped", logits=_wrapped_offset,
                               params={"table": Tensor("float32", ("qo_head", "offset"))})
    from fivar.config import override
    with override(position_tables="off"):  # read per element: % has no interval rule
        assert dict(TritonEmitter(wrapped).read_plan()) == {
            "params.table[qo_head, ((kv_idx - q_idx) % 5)]": "a gather per element"}
    # by default the gather at a costly function of the distance is a per-call table (fivar.spec.positions)
    assert dict(TritonEmitter(wrapped).read_plan()) == {
        "params.fv_pos_table0[qo_head, ((kv_idx - q_idx) + params.fv_pos_offset)]":
            "one value per tile where its clamped index cannot vary, else a gather"}
    by_score = AttentionVariant(name="by_score", logits=_score_indexed,
                                params={"table": Tensor("float32", ("offset",))})
    assert [how for _, how in TritonEmitter(by_score).read_plan()] == ["a gather per element"]


def test_show_prints_the_triton_twin():
    from fivar.cli import main
    result = CliRunner().invoke(main, ["show", "softcap", "--target", "triton"])
    assert result.exit_code == 0, result.output
    assert "def variant_logits(qk, batch, qo_head, kv_head, q_idx, kv_idx" in result.output
    assert "return _tanh((qk * fv_h0))" in result.output and "qk_scale = LOG2E * fvp_softcap" in result.output


# --- KV tile skipping: a band read off the mask bounds the loop, other masks are pre-scanned per block
def _two_sided(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx <= params.left and kv_idx - q_idx <= params.right


def _band_and_doc(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.left and params.doc[q_idx] == params.doc[kv_idx]


def _per_head_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.windows[qo_head]  # a tensor bound: no band, pre-scanned per head


PER_HEAD_WINDOW = AttentionVariant(name="per_head_window", mask=_per_head_window,
                                   params={"windows": Tensor("int32", ("qo_head",))})
TWO_SIDED = AttentionVariant(name="two_sided_band", mask=_two_sided,
                             params={"left": Scalar(int), "right": Scalar(int)})
BAND_AND_DOC = AttentionVariant(name="band_and_doc", mask=_band_and_doc,
                                params={"left": Scalar(int), "doc": Tensor("int32", ("position",))})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq,lk", [(75, 75), (37, 75)])
def test_tiles_outside_a_band_are_skipped_exactly(lq, lk, causal):
    """Several 16-wide tiles per row (lengths off the tile), windows from empty to wider than the sequence."""
    q, k, vv = _qkv(lq, lk, 2, 1, 16)
    sw = fivar.load("sliding_window")
    for window in (-2, 0, 1, 5, 16, 33, 200):
        out = sw.prefill(q, k, vv, causal=causal, backend="triton", window=window)
        _check("sliding_window", f"window={window}", out, sw.reference(q, k, vv, causal=causal, window=window))
    for left, right in ((3, 7), (20, -2), (0, 0), (-5, 40)):
        p = {"left": left, "right": right}
        out = TWO_SIDED.prefill(q, k, vv, causal=causal, backend="triton", **p)
        _check("two_sided_band", str(p), out, TWO_SIDED.reference(q, k, vv, causal=causal, **p))


def _all_but_one(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx != q_idx - params.gap  # each row keeps two runs of keys: no tile is kept for every row


ALL_BUT_ONE = AttentionVariant(name="all_but_one", mask=_all_but_one, params={"gap": Scalar(int)})


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq", [90, 53])
def test_prescanned_masks_keep_every_tile_they_need(lq, causal):
    """Documents of assorted lengths (one key long up to several tiles), alone and under a window; tiles
    the mask keeps for every row run unmasked, so a mask with a hole in each row must still be applied."""
    q, k, vv = _qkv(lq, 90, 2, 2, 16)
    lengths = [1, 17, 3, 40, 29]
    doc_ids = document_ids(lengths)
    dm = fivar.load("document_mask")
    p = {"doc_ids": doc_ids[None]}
    _check("document_mask", "5 docs", dm.prefill(q, k, vv, causal=causal, backend="triton", **p),
           dm.reference(q, k, vv, causal=causal, **p))
    p = {"windows": torch.tensor([3, 40], dtype=torch.int32)}
    _check("per_head_window", str(p), PER_HEAD_WINDOW.prefill(q, k, vv, causal=causal, backend="triton", **p),
           PER_HEAD_WINDOW.reference(q, k, vv, causal=causal, **p))
    p = {"left": 9, "doc": doc_ids}
    _check("band_and_doc", "5 docs, window 9", BAND_AND_DOC.prefill(q, k, vv, causal=causal, backend="triton", **p),
           BAND_AND_DOC.reference(q, k, vv, causal=causal, **p))
    for gap in (3, 40):
        p = {"gap": gap}
        _check("all_but_one", str(p), ALL_BUT_ONE.prefill(q, k, vv, causal=causal, backend="triton", **p),
               ALL_BUT_ONE.reference(q, k, vv, causal=causal, **p))


# --- a gather indexed by query and key reads one value on tiles where its clamped index cannot vary
def _stepped_table(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.table[qo_head, max(-(q_idx - kv_idx) * params.step, kv_idx - q_idx - params.reach) + params.shift]


STEPPED = AttentionVariant(name="stepped_table", logits=_stepped_table, params={
    "table": Tensor("float32", ("qo_head", "offset")), "step": Scalar(int), "reach": Scalar(int),
    "shift": Scalar(int)})


@pytest.mark.parametrize("step", [-3, 2])
def test_tile_uniform_gathers_match_the_reference(step):
    """Clamped at both ends of a 25-entry table: tiles far from the diagonal read one entry, the others
    gather; negative steps flip which corner of the tile bounds the index."""
    q, k, vv = _qkv(70, 100, 2, 1, 16)
    for causal in (False, True):
        p = {"table": torch.randn(2, 25), "step": step, "reach": 7, "shift": 9}
        _check("stepped_table", f"step={step} causal={causal}",
               STEPPED.prefill(q, k, vv, causal=causal, backend="triton", **p),
               STEPPED.reference(q, k, vv, causal=causal, **p))


@pytest.mark.parametrize("causal", [False, True])
def test_many_query_blocks_with_documents(causal):
    """Many query blocks (causal runs them last block first), short and long documents: every block is
    computed exactly once, with the pre-pass ranges of its own rows."""
    q, k, vv = _qkv(150, 180, 2, 1, 16)  # ten query blocks, twelve key tiles
    lengths = [100, 7, 33, 40]
    doc_ids = document_ids(lengths)
    dm = fivar.load("document_mask")
    p = {"doc_ids": doc_ids[None]}
    _check("document_mask", f"causal={causal}", dm.prefill(q, k, vv, causal=causal, backend="triton", **p),
           dm.reference(q, k, vv, causal=causal, **p))


def _log_gate(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + torch.log(torch.sigmoid(params.gate[qo_head]))


LOG_GATE = AttentionVariant(name="log_gate", logits=_log_gate, params={"gate": Tensor("float32", ("qo_head",))})


def test_sigmoid_inside_the_logits_stays_exact():
    """The tanh form of sigmoid is for a no-softmax weight only: log(sigmoid(-40)) must stay finite."""
    q, k, vv = _qkv(20, 20, 2, 2, 16)
    p = {"gate": torch.tensor([-40.0, 3.0])}
    _check("log_gate", str(p), LOG_GATE.prefill(q, k, vv, backend="triton", **p), LOG_GATE.reference(q, k, vv, **p))


@pytest.mark.parametrize("block_m,block_n", [(64, 32), (32, 64)])
def test_other_tile_shapes(block_m, block_n):
    """BLOCK_M != BLOCK_N and tiles larger than the interpreter's own 16 x 16: band edges and full ranges, and a
    block map (the document mask's) made at that tile, combine across the tile."""
    from fivar.jit.triton_module import load_triton_module
    cases = [("document_mask", {"doc_ids": torch.repeat_interleave(torch.arange(4), torch.tensor([50, 3, 30, 57]))
                                .to(torch.int32)[None]}),
             ("sliding_window", {"window": 37}), ("relative_bias", {"bias": torch.randn(2, 9), "max_distance": 4})]
    q, k, vv = _qkv(100, 140, 2, 1, 16)  # several 64-row and 64-key tiles, none of them whole at the end
    for name, p in cases:
        v = fivar.load(name)
        module = load_triton_module(v)
        kernel = module.prefill_kernel
        saved = kernel.configs, getattr(module, "MAP_BLOCK", None)
        if hasattr(module, "block_map"):  # the block map sets the tile
            module.MAP_BLOCK = (block_m, block_n)
        else:
            kernel.configs = [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=4, num_stages=1)]
        try:
            for causal in (False, True):
                _check(name, f"{block_m}x{block_n} causal={causal}", v.prefill(q, k, vv, causal=causal, backend="triton", **p),
                       v.reference(q, k, vv, causal=causal, **p))
        finally:
            kernel.configs = saved[0]
            if saved[1] is not None:
                module.MAP_BLOCK = saved[1]


def test_a_backend_typo_is_named_before_the_inputs_are_checked():
    v = fivar.load("softcap")
    q, k, vv = _qkv(4, 4, 2, 2, 16)
    for call in (lambda: v.prefill(q, k, vv, backend="trition"),
                 lambda: v.batch_prefill_ragged(q, k, vv, None, None, backend="fa4")):
        with pytest.raises(fivar.FivarError, match="variant 'softcap': backend '(trition|fa4)' is not available"):
            call()


def test_check_runs_decode_on_each_requested_backend(monkeypatch):
    """`fivar check NAME --backends triton` on a GPU checks the twin's decode too (FA3 has none: `auto`'s FA2)."""
    from fivar import testing
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for fn in ("check_single_prefill", "check_batch_prefill"):
        monkeypatch.setattr(testing, fn, lambda *a, **kw: None)
    monkeypatch.setattr(testing, "check_decode", lambda v, **kw: seen.append(kw["backend"]))
    testing.run_checks(fivar.load("softcap"), backends=("fa3", "triton", "auto"))
    assert seen == ["auto"] * len(testing.DECODE_CASES) + ["triton"] * len(testing.DECODE_CASES)


def _i32(*x):
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.parametrize("qo_indptr,match", [(_i32(2, 4, 10), r"qo_indptr must start at 0 and never decrease, got \[2, 4, 10\]"),
                                             (_i32(0, 6, 4, 10), "qo_indptr must start at 0 and never decrease"),
                                             (_i32(0, -2, 10), "qo_indptr must start at 0 and never decrease")])
def test_indptr_contents_are_checked_before_launch(qo_indptr, match):
    """The kernels trust the indptrs: a bad one left rows unwritten or crashed the process."""
    q, k, vv = _qkv(10, 12, 4, 2, 16)
    kv_indptr = torch.linspace(0, 12, qo_indptr.numel()).to(torch.int32)
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': {match}"):
        fivar.load("softcap").batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, backend="triton")


@pytest.mark.parametrize("indices,last,match", [
    (_i32(0, 1, 2, 3, 4), _i32(7, 4), r"kv_last_page_len must be in 0..page_size \(4\), got 4..7"),
    (_i32(0, 1, 2, 100000, 4), _i32(2, 4), r"kv_indices must be page numbers in 0..5 \(the cache's pages\), got 0..100000"),
    ([0, 1, 2, 3, 4], _i32(2, 4), "kv_indices must be a 1-D int32 tensor of at least 5 entries"),
    (_i32(0, 1, 2), _i32(2, 4), "kv_indices must be a 1-D int32 tensor of at least 5 entries"),
])
def test_decode_pages_are_checked_before_launch(indices, last, match):
    """A last-page length past the page read another request's page; a page number past the cache crashed."""
    q = torch.randn(2, 4, 16, dtype=DTYPE)
    cache = (torch.randn(6, 4, 2, 16, dtype=DTYPE), torch.randn(6, 4, 2, 16, dtype=DTYPE))
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': {match}"):
        fivar.load("softcap").decode(q, cache, _i32(0, 2, 5), indices, last, backend="triton")


def test_bad_out_and_sm_scale_are_one_line_and_the_paged_twin_reads_the_pages():
    v = fivar.load("softcap")
    q, k, vv = _qkv(8, 8, 4, 2, 16)
    with pytest.raises(fivar.FivarError, match=r"out must be like q \(torch.float16 \[8, 4, 16\] on cpu\), got "
                                               r"torch.float16 \[8, 4, 8\]"):
        v.prefill(q, k, vv, backend="triton", out=torch.empty(8, 4, 8, dtype=DTYPE))
    with pytest.raises(fivar.FivarError, match="sm_scale must be a finite number, got 'x'"):
        v.prefill(q, k, vv, backend="triton", sm_scale="x")
    # paged prefill gathers each request's keys from its pages, then runs the ragged kernel
    pages = torch.randperm(4)
    k_cache, v_cache = torch.randn(4, 2, 2, 16, dtype=DTYPE), torch.randn(4, 2, 2, 16, dtype=DTYPE)
    k_cache[pages], v_cache[pages] = k.view(4, 2, 2, 16), vv.view(4, 2, 2, 16)
    paged = v.batch_prefill_paged(q, (k_cache, v_cache), _i32(0, 8), _i32(0, 4), pages.to(torch.int32), _i32(2),
                                  backend="triton")
    assert torch.equal(paged, v.batch_prefill_ragged(q, k, vv, _i32(0, 8), _i32(0, 8), backend="triton"))


def _wrapping_mask(b, h, kh, qi, ki, p):
    return ki * 1000000000 >= 0  # wraps in 32 bits for ki >= 3


def _int64_ids_mask(b, h, kh, qi, ki, p):
    return p.ids[ki] <= p.ids[qi]


def test_integers_are_32_bit_in_the_reference_as_in_the_kernels():
    """The reference is the oracle `fivar check` trusts, so it computes integers as the kernels do: 32-bit, an
    overflow wraps, an int64 tensor is read as its low 32 bits; an int Scalar that does not fit is refused."""
    q, k, vv = _qkv(9, 30, 4, 2, 16)
    wrap = AttentionVariant(name="wrap", mask=_wrapping_mask)
    ref = wrap.reference(q, k, vv)
    _check("wrap", "32-bit overflow", wrap.prefill(q, k, vv, backend="triton"), ref)
    assert not torch.allclose(ref, AttentionVariant(name="plain", logits=_identity_logits).reference(q, k, vv),
                              atol=1e-3)  # the wrapped keys really are masked
    ids = AttentionVariant(name="ids", mask=_int64_ids_mask, params={"ids": Tensor("int64", ("kv_idx",))})
    big = torch.arange(30, dtype=torch.int64) * 2**32 + 7  # every low half is 7: every key kept
    ref = ids.reference(q, k, vv, ids=big)
    _check("ids", "int64 read as int32", ids.prefill(q, k, vv, backend="triton", ids=big), ref)
    assert torch.allclose(ref, ids.reference(q, k, vv, ids=torch.full((30,), 7)), atol=1e-6)
    window = AttentionVariant(name="w", mask=_scalar_window, params={"w": Scalar(int)})
    with pytest.raises(fivar.FivarError, match=r"parameter 'w' = 4294967299 does not fit the kernels' 32-bit"):
        window.reference(q, k, vv, w=2**32 + 3)


def _identity_logits(score, b, h, kh, qi, ki, p):
    return score


def _scalar_window(b, h, kh, qi, ki, p):
    return qi - ki < p.w


@pytest.mark.parametrize("ragged", [False, True])
def test_one_shot_calls_keep_the_block_map(monkeypatch, ragged):
    """A masked variant's one-shot Triton prefill makes its block map once per batch layout and params: a repeat
    call reuses it, and a params tensor changed in place makes it again (the result is the reference's with the new
    contents, not the old map's)."""
    from fivar.jit.triton_module import load_triton_module
    from fivar.runtime import triton_attention
    v = fivar.load("document_mask")
    module = load_triton_module(v)
    calls = []
    real = module.block_map
    monkeypatch.setattr(module, "block_map", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    monkeypatch.setattr(triton_attention, "_maps", triton_attention.PlanCache(capacity=8, recorded=True))
    torch.manual_seed(5)
    lq = 70
    q, k, vv = _qkv(lq, lq, 2, 1, 16)
    doc_ids = torch.zeros(1, lq, dtype=torch.int32)
    doc_ids[0, 30:] = 1

    ind = torch.tensor([0, lq], dtype=torch.int32)  # one batch layout, as the layers of a model step share

    def call():
        if ragged:
            return v.batch_prefill_ragged(q, k, vv, ind, ind, causal=True, backend="triton", doc_ids=doc_ids)
        return v.prefill(q, k, vv, causal=True, backend="triton", doc_ids=doc_ids)
    first = call()
    again = call()
    assert len(calls) == 1 and torch.equal(first, again)
    doc_ids[0, 50:] = 2  # in place: a new document from row 50
    out = call()
    assert len(calls) == 2
    _check("document_mask", "after an in-place change", out,
           v.reference(q.float(), k.float(), vv.float(), causal=True, doc_ids=doc_ids))
    # while a CUDA graph is captured, no cached ranges: the pre-pass is recorded, so a replay scans new contents
    from fivar.runtime import plan_cache
    monkeypatch.setattr(plan_cache, "capturing", lambda: True)
    call()
    call()
    assert len(calls) == 4


@pytest.mark.parametrize("scale", [3.5e38, -1e39, float("nan"), float("inf"), "0.1", True, torch.tensor([0.1, 0.2]),
                                   10**400])
def test_an_sm_scale_the_kernels_cannot_take_is_one_line_naming_it(scale):
    """"0.1" (a string) and 3.5e38 (inf in the kernels' float32) were taken; every entry point and the reference
    refuse them, and NaN, inf and non-numbers, in one line naming sm_scale, before anything runs."""
    import random
    v = fivar.load("softcap")
    q, k, vv = _qkv(random.randint(1, 9), random.randint(1, 9), 4, 2, 16)
    calls = (lambda: v.prefill(q, k, vv, backend="triton", sm_scale=scale),
             lambda: v.reference(q, k, vv, sm_scale=scale),
             lambda: v.attention(q, k, vv, backend="triton", sm_scale=scale))
    for call in calls:
        with pytest.raises(fivar.FivarError, match="variant 'softcap': sm_scale") as info:
            call()
        assert "\n" not in str(info.value)
    fine = random.uniform(0.01, 1.0)  # and a valid one, given as a one-element tensor, is the float it holds
    assert torch.equal(v.reference(q, k, vv, sm_scale=torch.tensor(fine)), v.reference(q, k, vv, sm_scale=fine))


def test_a_zero_or_negative_head_dim_is_one_line():
    from click.testing import CliRunner

    from fivar.cli import main
    from fivar.testing import run_checks
    v = fivar.load("softcap")
    empty = torch.randn(5, 2, 0, dtype=DTYPE)
    with pytest.raises(fivar.FivarError, match="variant 'softcap': .*head_dim must be positive"):
        v.reference(empty, empty, empty)
    for hd in (0, -64):
        with pytest.raises(fivar.FivarError, match=f"head dim must be a positive integer, got {hd}"):
            run_checks(v, head_dims=(hd,), backends=("triton",), device="cpu", dtypes=(DTYPE,))
        r = CliRunner().invoke(main, ["check", "softcap", f"--head-dims={hd}", "--backends", "triton"])
        assert r.exit_code == 1 and r.stderr.count("\n") == 1 and f"--head-dims: a head dim must be a positive " \
            f"integer, got {hd}" in r.stderr, r.output
        r = CliRunner().invoke(main, ["build", "softcap", f"--head-dims={hd}", "--arch", "9.0a"])
        assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "--head-dims" in r.stderr, r.output

# --- index tensors of any layout: the kernels read a raw pointer, the entry points hand them contiguous int32
def _column(t, dtype=torch.int32):
    """t's values as a column of a 2-D tensor (stride 2), poison in the other column: read as raw memory, the
    entries would come out as [t0, -5, t1, -5, ...]."""
    buf = torch.full((t.numel(), 2), -5, dtype=dtype)
    buf[:, 0] = t
    return buf[:, 0]


INDEX_FORMS = {
    "column": _column,
    "every_other": lambda t: torch.stack([t, t.new_full(t.shape, 7)], 1).reshape(-1)[::2],
    "int64": lambda t: t.long(),
    "int16_column": lambda t: _column(t, torch.int16),
    "int64_reversed_view": lambda t: t.long().flip(0).flip(0)[:],  # a copy, int64: converted, not refused
}


def _random_lengths(n, lo, hi):
    return [int(x) for x in torch.randint(lo, hi, (n,))]


def _indptr(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("form", list(INDEX_FORMS))
@pytest.mark.parametrize("name", ["softcap", "document_mask"])
def test_ragged_index_tensors_of_any_layout_and_integer_dtype(name, form):
    """A strided view of valid indptrs (a column of a 2-D tensor, t[::2]) or another integer dtype gives the result
    of contiguous int32 ones, the reference's: the twin read them as raw int32 memory (NaN, wrong rows, a crash).
    A tensor param given as a strided view (doc_ids transposed twice) is read as its values too."""
    v = fivar.load(name)
    qo_lens, kv_lens = _random_lengths(3, 1, 20), _random_lengths(3, 1, 30)
    hq, hkv, d = 4, 2, 16
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), hq, hkv, d)
    params = _params(v, hq, hkv, 3, max(kv_lens))
    if "doc_ids" in params:
        params["doc_ids"] = params["doc_ids"].t().contiguous().t()  # same values, strides (1, batch)
        assert not params["doc_ids"].is_contiguous()
    qo, kv = _indptr(qo_lens), _indptr(kv_lens)
    want = v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend="triton", **params)
    got = v.batch_prefill_ragged(q, k, vv, INDEX_FORMS[form](qo), INDEX_FORMS[form](kv), causal=True,
                                 backend="triton", **params)
    _check(name, f"ragged {form} {qo_lens} {kv_lens}", got,
           _ragged_reference(v, q, k, vv, qo_lens, kv_lens, True, params))
    assert torch.equal(got, want)


@pytest.mark.parametrize("form", list(INDEX_FORMS))
def test_decode_index_tensors_of_any_layout_and_integer_dtype(form):
    """kv_indptr, kv_indices and kv_last_page_len of a paged decode, each a strided view or another integer dtype:
    the result of contiguous int32 ones, the reference's."""
    v = fivar.load("softcap_sliding_window")
    kv_lens, hq, hkv, d = _random_lengths(3, 1, 40), 4, 2, 16
    q = torch.randn(len(kv_lens), hq, d, dtype=DTYPE)
    _, k, vv = _qkv(1, sum(kv_lens), hq, hkv, d)
    params = _params(v, hq, hkv, len(kv_lens), max(kv_lens))
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=4)
    want = v.decode(q, cache, indptr, indices, last, backend="triton", **params)
    f = INDEX_FORMS[form]
    got = v.decode(q, cache, f(indptr), f(indices), f(last), backend="triton", **params)
    _check("softcap_sliding_window", f"decode {form} {kv_lens}", got,
           _ragged_reference(v, q, k, vv, [1] * len(kv_lens), kv_lens, False, params))
    assert torch.equal(got, want)


@pytest.mark.parametrize("which,bad,match", [
    ("qo_indptr", torch.tensor([0.0, 10.0]), r"qo_indptr must be a 1-D int32 tensor with batch_size\+1 entries, "
                                             r"got torch.float32 \[2\]"),
    ("kv_indptr", torch.tensor([0, 12]).bool(), r"kv_indptr must be a 1-D int32 tensor .*got torch.bool"),
    ("kv_indptr", torch.tensor([0, 12], device="meta"), "kv_indptr is on meta, the inputs are on cpu"),
    ("qo_indptr", torch.tensor([0, 2**32 + 10]), r"qo_indptr ends at 4294967306, past the kernels' 32-bit indices"),
])
def test_ragged_index_tensors_that_cannot_convert_are_refused_by_name(which, bad, match):
    q, k, vv = _qkv(10, 12, 4, 2, 16)
    ind = {"qo_indptr": _i32(0, 10), "kv_indptr": _i32(0, 12), which: bad}
    with pytest.raises(fivar.FivarError, match=f"^variant 'softcap': {match}"):
        fivar.load("softcap").batch_prefill_ragged(q, k, vv, ind["qo_indptr"], ind["kv_indptr"], backend="triton")


@pytest.mark.parametrize("indices,last,match", [
    # int64 page 2**32 + 1 wrapped to page 1 in the int32 conversion, inside the cache: read silently
    (torch.tensor([0, 1, 2, 2**32 + 1, 4]), _i32(2, 4), r"kv_indices must be page numbers in 0..5 \(the cache's "
                                                         r"pages\), got 0..4294967297"),
    (torch.tensor([0.0, 1, 2, 3, 4]), _i32(2, 4), r"kv_indices must be a 1-D int32 tensor of at least 5 entries "
                                                  r"\(kv_indptr\[-1\]\), got torch.float32 \[5\]"),
    (_i32(0, 1, 2, 3, 4), torch.tensor([2.0, 4.0]), "kv_last_page_len must be a 1-D int32 tensor of 2 entries"),
    (_i32(0, 1, 2, 3, 4), torch.tensor([2, 4], device="meta"), "kv_last_page_len is on meta"),
])
def test_decode_index_tensors_that_cannot_convert_are_refused_by_name(indices, last, match):
    q = torch.randn(2, 4, 16, dtype=DTYPE)
    cache = (torch.randn(6, 4, 2, 16, dtype=DTYPE), torch.randn(6, 4, 2, 16, dtype=DTYPE))
    with pytest.raises(fivar.FivarError, match=f"^variant 'softcap': {match}"):
        fivar.load("softcap").decode(q, cache, _i32(0, 2, 5), indices, last, backend="triton")


# --- writes the version counter does not see: the kept mask ranges are made again from the new contents
def _write_numpy(t, index, value):
    t.numpy()[index] = value


def _write_data(t, index, value):
    t.data[index] = value


WRITERS = {"numpy": _write_numpy, "data": _write_data}


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("write", list(WRITERS))
def test_params_written_behind_the_version_counter_are_seen(write, ragged):
    """doc_ids written through .numpy() or .data (its _version unchanged) between two calls: the second call is
    the reference's for the new ids, not a replay of the ranges scanned from the old ones."""
    v = fivar.load("document_mask")
    lq = int(torch.randint(50, 70, ()))
    q, k, vv = _qkv(lq, lq, 4, 2, 16)
    doc_ids = torch.zeros(1, lq, dtype=torch.int32)
    cut = int(torch.randint(20, lq - 16, ()))  # past the first 16-key tile, which the old ranges then skip
    doc_ids[0, cut:] = 1
    ind = torch.tensor([0, lq], dtype=torch.int32)

    def call():
        if ragged:
            return v.batch_prefill_ragged(q, k, vv, ind, ind, causal=True, backend="triton", doc_ids=doc_ids)
        return v.prefill(q, k, vv, causal=True, backend="triton", doc_ids=doc_ids)
    call()
    version = doc_ids._version
    # the two documents become one: rows past the cut keep keys the old ranges skip
    WRITERS[write](doc_ids, (0, slice(cut, None)), 0)
    assert doc_ids._version == version  # the write went past the counter
    _check("document_mask", f"after a write through {write}", call(),
           v.reference(q, k, vv, causal=True, doc_ids=doc_ids))


@pytest.mark.parametrize("write", list(WRITERS))
def test_indptrs_written_behind_the_version_counter_are_seen(write):
    """The same for the indptrs of a ragged batch: request 0 grows from 18 to 40 tokens through .numpy() or .data,
    past its document boundary at 20, so its rows from there keep keys no range of the old batch held."""
    v = fivar.load("document_mask")
    q, k, vv = _qkv(48, 48, 4, 2, 16)
    doc_ids = torch.zeros(2, 48, dtype=torch.int32)
    doc_ids[0, 20:] = 1
    qo, kv = _i32(0, 18, 48), _i32(0, 18, 48)
    v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend="triton", doc_ids=doc_ids)
    for t in (qo, kv):
        WRITERS[write](t, 1, 40)
    _check("document_mask", f"indptrs written through {write}",
           v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend="triton", doc_ids=doc_ids),
           _ragged_reference(v, q, k, vv, [40, 8], [40, 8], True, {"doc_ids": doc_ids}))
