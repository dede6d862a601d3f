"""Training through the Triton twin, run by Triton's interpreter on the CPU: dq, dk, dv and the gradients of
learnable tensor params against float64 autograd of the torch reference, at tiny float16 shapes (lengths off
the 16-wide tiles, qo_len != kv_len, GQA, ragged batches, causal or not)."""
import warnings

import pytest
import torch

import fivar
from fivar import AttentionVariant, Scalar, Tensor, clamp, log, maximum, minimum, tanh
from fivar.bench.train import learnable_copy
from fivar.codegen.triton import kernel_arg_values
from fivar.runtime.params import bind_params
from fivar.testing import check_gradients, compare, document_ids, example_params, reference_gradients

DTYPE = torch.float16  # the interpreter has no bfloat16 arithmetic
BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias", "softcap_sliding_window",
           "gpt_oss"]


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _params(variant, hq, hkv, batch, max_len):
    params = example_params(variant, num_qo_heads=hq, num_kv_heads=hkv, batch_size=batch, max_len=max_len,
                            device="cpu")
    if "window" in variant.params:
        params["window"] = int(torch.randint(3, max(4, max_len // 2), (1,)))
    if "max_distance" in params:
        params["max_distance"] = 6
        params["bias"] = torch.randn(hq, 13)
    if "softcap" in params:
        params["softcap"] = 2.0  # small enough that the tanh bends at these scores
    return params


def _qkv(lq, lk, hq, hkv, d):
    return (torch.randn(lq, hq, d, dtype=DTYPE), torch.randn(lk, hkv, d, dtype=DTYPE),
            torch.randn(lk, hkv, d, dtype=DTYPE))


def _check(v, qo_lens, kv_lens, hq, hkv, d, causal):
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), hq, hkv, d)
    params = _params(v, hq, hkv, len(qo_lens), max(kv_lens))
    r = check_gradients(v, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=causal, params=params, dtype=DTYPE)
    assert r.passed, r


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_single(name, causal):
    """GQA 4/2, 21 queries over 37 keys (bottom-right aligned), learnable tables where the variant has them."""
    _check(learnable_copy(fivar.load(name)), [21], [37], 4, 2, 16, causal)


@pytest.mark.parametrize("name", ["softcap", "document_mask", "relative_bias", "sigmoid", "gpt_oss"])
def test_bundled_ragged(name):
    """Three requests, one shorter than a tile and one with more queries than keys; causal."""
    _check(learnable_copy(fivar.load(name)), [5, 1, 20], [19, 7, 17], 4, 2, 16, True)


def _documents(lengths):
    return {"doc_ids": document_ids(lengths)[None]}


def _two_sided_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.left and kv_idx - q_idx <= params.right


def _lookahead_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx - q_idx <= params.right


BANDS = {"two_sided": AttentionVariant(name="two_sided", mask=_two_sided_mask, params={
             "left": Scalar(int, default=30), "right": Scalar(int, default=21)}),
         "lookahead": AttentionVariant(name="lookahead", mask=_lookahead_mask, params={
             "right": Scalar(int, default=21)})}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["document_mask", "sliding_window", "softcap", "two_sided", "lookahead"])
def test_full_and_edge_tiles(name, causal):
    """Lengths of several 16-wide tiles, documents and bands off the tile edges (a window, a band on both sides of
    the diagonal, one on its right only: exact bands fivar reads off the mask): each program runs full tiles (no
    bounds, causal or mask test) and edge tiles on both sides of them, in dQ and in dK/dV."""
    v = BANDS[name] if name in BANDS else learnable_copy(fivar.load(name))
    assert name == "softcap" or v.kv_band.exact or v.scans_mask
    qo_len, kv_len = 83, 101
    q, k, vv = _qkv(qo_len, kv_len, 2, 1, 16)  # GQA 2/1: the tile structure is per head, the cost per program
    params = _params(v, 2, 1, 1, kv_len)
    if name == "document_mask":
        params = _documents([37, 5, 50, 9])
    elif name == "sliding_window":
        params["window"] = 41
    r = check_gradients(v, q, k, vv, qo_lens=[qo_len], kv_lens=[kv_len], causal=causal, params=params, dtype=DTYPE)
    assert r.passed, r


def _head_band_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    # a band per head, known only from the data: the block map finds it, and each tile row keeps different whole tiles
    return q_idx - kv_idx < params.left[qo_head] and kv_idx - q_idx < params.right


HEAD_BAND = AttentionVariant(name="head_band", mask=_head_band_mask, params={
    "left": Tensor("int32", ("qo_head",)), "right": Scalar(int, default=8)})


@pytest.mark.parametrize("causal", [False, True])
def test_full_tiles_from_the_block_map(causal):
    """A mask the block map classifies (a band per head): each kernel runs the tiles every pair of which the mask
    keeps with no test, the cut ones pair by pair, per head."""
    assert HEAD_BAND.scans_mask
    q, k, vv = _qkv(90, 97, 4, 2, 16)
    params = {"left": torch.tensor([70, 45, 33, 100], dtype=torch.int32), "right": 29}
    r = check_gradients(HEAD_BAND, q, k, vv, qo_lens=[90], kv_lens=[97], causal=causal, params=params, dtype=DTYPE)
    assert r.passed, r


@pytest.mark.parametrize("name", ["document_mask", "head_band", "two_sided"])
def test_full_tiles_in_a_ragged_batch(name):
    """Requests of different lengths (one with more queries than keys, one of a single query): full tiles, edges and
    (for a classified mask) the programs' order, each program finding its request, block and head from its id."""
    v = {"head_band": HEAD_BAND, **BANDS}.get(name) or fivar.load(name)
    qo_lens, kv_lens = [83, 40, 1], [101, 29, 17]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), 2, 1, 16)  # GQA 2/1: heads add programs, not tile kinds
    if name == "document_mask":
        params = {"doc_ids": torch.cat([_documents(x)["doc_ids"] for x in ([37, 5, 50, 9], [20, 81], [60, 41])])}
    elif name == "head_band":
        params = {"left": torch.tensor([70, 33], dtype=torch.int32), "right": 29}
    else:
        params = {"left": 30, "right": 21}
    r = check_gradients(v, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=True, params=params, dtype=DTYPE)
    assert r.passed, r


def test_no_kept_tile_lists_while_a_cuda_graph_is_captured(monkeypatch):
    """Under capture a cached block map would not be recorded, and a replay after new document ids were copied in
    would attend with the old ones: each step classifies afresh then (recorded into the graph)."""
    from fivar.runtime import autograd, plan_cache, triton_attention
    monkeypatch.setattr(plan_cache, "capturing", lambda: True)
    v = fivar.load("document_mask")
    q, k, vv = _qkv(70, 70, 2, 1, 16)
    params = _documents([30, 22, 18])
    scans = []
    module = autograd._module(v)
    for name in ("bwd_tile_lists", "block_map"):  # the backward's block map, the forward's
        monkeypatch.setattr(module, name, lambda *a, _f=getattr(module, name), _n=name, **kw:
                            scans.append(_n) or _f(*a, **kw))
    kept = lambda: (autograd._kept.misses, autograd._kept.hits, triton_attention._maps.misses,  # noqa: E731
                    triton_attention._maps.hits)
    before = kept()
    for _ in range(2):
        r = check_gradients(v, q, k, vv, qo_lens=[70], kv_lens=[70], causal=True, params=params, dtype=DTYPE)
        assert r.passed, r
    assert kept() == before and sorted(scans) == ["block_map"] * 2 + ["bwd_tile_lists"] * 2  # each step, twice


def _gated_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + log(params.gate[q_idx])  # a gate of 0: the row's logits are all -inf, its output 0


GATED = AttentionVariant(name="gated_rows", logits=_gated_logits, params={"gate": Tensor("float32", ("n",))})


def test_rows_whose_logits_are_all_minus_infinity():
    """A row with every logit -inf (no mask: its tiles are full ones) has lse -inf; its weights are 0 in every
    tile, full or edge, so the gradients stay finite and the other rows' match the reference with it left out."""
    q, k, vv = _qkv(64, 64, 2, 1, 16)
    gate = torch.ones(64)
    gate[40:] = 0.0
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, vv))
    o = GATED.attention(qg, kg, vg, causal=False, gate=gate)
    do = torch.randn_like(o)
    do[40:] = 0.0  # rows 40.. are 0 whatever their upstream gradient: the reference's are NaN (softmax of all -inf)
    o.backward(do)
    assert bool((o[40:] == 0).all())
    assert all(bool(torch.isfinite(g).all()) for g in (qg.grad, kg.grad, vg.grad))
    sub = {"gate": gate[:40]}
    _, ref = reference_gradients(GATED, q[:40], k, vv, do[:40], qo_lens=[40], kv_lens=[64], causal=False, params=sub)
    for name, got in (("q", qg.grad[:40]), ("k", kg.grad), ("v", vg.grad)):
        assert compare("gated_rows", f"d{name}", got.detach(), ref[name], DTYPE).passed, name


def test_tile_lists_kept_for_the_backward_and_redone_after_an_in_place_write():
    """One forward block map and one backward tile list for steps with one batch layout and params, each kept for
    the next step. Document ids rewritten in place are classified again (a stale map or lists, or a stale order of the
    programs, would drop or keep the wrong keys: the gradients would not match)."""
    from fivar.runtime import autograd, triton_attention
    v = fivar.load("document_mask")
    q, k, vv = _qkv(70, 70, 2, 1, 16)
    params = _documents([30, 22, 18])
    counts = lambda: (autograd._kept.misses, autograd._kept.hits, triton_attention._maps.misses,  # noqa: E731
                      triton_attention._maps.hits)
    for lengths, written in (([30, 22, 18], True), ([30, 22, 18], False), ([9, 50, 11], True)):
        if written:
            params["doc_ids"].copy_(_documents(lengths)["doc_ids"])
        before = counts()
        r = check_gradients(v, q, k, vv, qo_lens=[70], kv_lens=[70], causal=True, params=params, dtype=DTYPE)
        assert r.passed, (lengths, r)
        # a step after a write: one block map (forward) and one tile list (backward); a step with nothing written:
        # both kept from the step before
        assert tuple(a - b for a, b in zip(counts(), before)) == ((1, 0, 1, 0) if written else (0, 1, 0, 1))


# --- a variant with every kind of learnable read: per program, per query row, per element ----------------------
def _reads_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    r = params.radius
    rel = params.rel[qo_head, clamp(kv_idx - q_idx, -r, r) + r]  # per element (one element on far tiles)
    capped = params.cap[qo_head] * tanh(score / params.cap[qo_head])  # per program
    return capped + rel * params.row[q_idx % 5] - params.rel[qo_head, 0] * 0.5


READS = AttentionVariant(name="learnable_reads", logits=_reads_logits, params={
    "rel": Tensor("float32", ("qo_head", "offset"), learnable=True),
    "cap": Tensor("float32", ("qo_head",), learnable=True),
    "row": Tensor("float32", ("n",), learnable=True),
    "radius": Scalar(int, default=3),
})


def _dilated_head_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    # every `stride`-th key within a window per head, plus a local band: empty, whole and cut tiles at once
    return q_idx - kv_idx < params.band or ((q_idx - kv_idx) % params.stride == 0
                                            and q_idx - kv_idx < params.windows[qo_head])


DILATED_READS = AttentionVariant(name="dilated_reads", logits=_reads_logits, mask=_dilated_head_mask, params={
    **READS.params, "windows": Tensor("int32", ("qo_head",)), "band": Scalar(int, default=20),
    "stride": Scalar(int, default=3)})


@pytest.mark.parametrize("causal", [True, False])
def test_learnable_reads_on_tile_lists(causal):
    """A mask no band describes, read per head, with learnable reads of every kind: the backward runs on its tile
    lists (whole tiles with no test, so their rows' and programs' sums take every pair; a tile of rows past its
    request's end is cut). Ragged requests, one with a short last tile and one of a single query; every gradient
    against float64 autograd."""
    assert DILATED_READS.scans_mask
    qo_lens, kv_lens = [75, 1, 40], [90, 33, 40]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), 4, 2, 16)
    params = {"rel": torch.randn(4, 7), "cap": torch.rand(4) * 3 + 2, "row": torch.randn(5),
              "windows": torch.tensor([90, 0, 45, 12], dtype=torch.int32), "band": 48, "stride": 3}
    r = check_gradients(DILATED_READS, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=causal, params=params,
                        dtype=DTYPE)
    assert {"drel", "dcap", "drow"} <= {x.case for x in r.results}
    assert r.passed, r


def _scattered_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    # indices fivar cannot bound over a tile (a modulo, the score itself): the kernel reduces each tile's offsets
    return score + params.t[qo_head, (kv_idx + 2 * q_idx) % 7] * 0.5 + params.u[clamp(int(score * 2.0), -3, 3) + 3]


SCATTERED = AttentionVariant(name="learnable_scattered", logits=_scattered_logits, params={
    "t": Tensor("float32", ("qo_head", "n"), learnable=True), "u": Tensor("float32", ("m",), learnable=True)})


def _bucket_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    # a table of distance buckets 24 wide, the last for every distance past 72: a 16 x 16 tile that far from the
    # diagonal reads one entry on all its diagonals, a nearer one several. The width is computed once per launch
    # (a hoisted value, as T5's log(128 / 16) is): the index still reads positions only
    return score + params.table[minimum(maximum(q_idx - kv_idx, 0) // (params.half_width * 2), 3), qo_head]


BUCKETS = AttentionVariant(name="learnable_buckets", logits=_bucket_logits, params={
    "table": Tensor("float32", ("bucket", "qo_head"), learnable=True), "half_width": Scalar(int, default=12)})


def test_distance_buckets_far_and_near():
    """A learnable table read by a bucket of the distance (T5's form): tiles whose diagonals all read one entry add
    the tile's sum once, the others a sum per diagonal; the table's gradient against float64 autograd."""
    from fivar.codegen.triton_bwd import render_training
    from fivar.config import override
    with override(position_tables="off"):  # as training renders it: every term per element
        module = render_training(BUCKETS)
    dq = module.split("def bwd_dq_kernel")[1]
    assert dq.count("if fv_first == fv_last:") == 1 and "fv_diag" in dq  # the diagonal form, with the one-entry test
    # Hopper's Gluon dQ kernel runs it too: the one-element tiles by the tile's bounds, the others through the skew
    gl_dq = module.split("def gl_bwd_dq_kernel")[1]
    assert "GLUON_DQ = True" in module and "fv_one = gl_fv_grad_tile0(" in gl_dq and "fv_skew_in.store(" in gl_dq
    q, k, vv = _qkv(150, 150, 2, 1, 16)
    r = check_gradients(BUCKETS, q, k, vv, qo_lens=[150], kv_lens=[150], causal=True,
                        params={"table": torch.randn(4, 2)}, dtype=DTYPE)
    assert "dtable" in {x.case for x in r.results}
    assert r.passed, r


def _kerple_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    # learnable per-head parameters inside a term of the distance alone, which the lowering tabulates (a log)
    return score - params.r1[qo_head] * log(1.0 + params.r2[qo_head] * float(abs(kv_idx - q_idx)))


KERPLE = AttentionVariant(name="learnable_kerple", logits=_kerple_logits, params={
    "r1": Tensor("float32", ("qo_head",), learnable=True), "r2": Tensor("float32", ("qo_head",), learnable=True)})


@pytest.mark.parametrize("mode", ["costly", "off"])
def test_learnable_terms_inside_position_tables(mode):
    """Where the lowering tabulates a term that reads learnable params, the backward recomputes the logits from the
    table (no log per pair) and derives every gradient from the logits per element, its own terms of the distance
    tabulated too (r1's derivative, a log); float64 autograd's gradients either way, ragged and with a request whose
    keys outnumber its queries."""
    from fivar.codegen.triton_bwd import render_training
    from fivar.config import override
    with override(position_tables=mode):
        text = render_training(KERPLE)
        for fn in ("variant_logits", "fv_dlogits_dload0"):  # the logits, d logits / d r1
            assert ("tl.log" in text.split(f"def {fn}(")[1].split("@triton.jit")[0]) == (mode == "off"), fn
        q, k, vv = _qkv(23 + 40, 31 + 40, 2, 1, 16)
        params = {"r1": torch.rand(2) + 0.2, "r2": torch.rand(2) * 2 + 0.1}
        r = check_gradients(KERPLE, q, k, vv, qo_lens=[23, 40], kv_lens=[31, 40], causal=True, params=params,
                            dtype=DTYPE)
    assert {"dr1", "dr2"} <= {x.case for x in r.results}
    assert r.passed, r


def _strided_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.stride or (q_idx - kv_idx) % params.stride == 0


STRIDED = AttentionVariant(name="strided_train", mask=_strided_mask, params={"stride": Scalar(int, default=5)})


@pytest.mark.parametrize("mode", ["costly", "off"])
def test_a_mask_of_the_distance_reads_a_table_in_training(mode):
    """The training module reads a mask that is a costly function of the distance (a modulo) from a table of the
    training lowering (the inference module keeps evaluating it); float64 autograd's gradients either way, ragged."""
    from fivar.codegen.triton_bwd import render_training
    from fivar.config import override
    with override(position_tables=mode):
        mask_fn = render_training(STRIDED).split("def variant_mask(")[1].split("@triton.jit")[0]
        assert ("fv_pos_table" in mask_fn) == (mode == "costly") and ("_py_mod" in mask_fn) == (mode == "off")
        q, k, vv = _qkv(37 + 50, 37 + 61, 2, 1, 16)
        r = check_gradients(STRIDED, q, k, vv, qo_lens=[37, 50], kv_lens=[37, 61], causal=True,
                            params={"stride": 7}, dtype=DTYPE)
    assert r.passed, r


@pytest.mark.parametrize("causal", [False, True])
def test_every_kind_of_learnable_read(causal):
    q, k, vv = _qkv(19, 40, 2, 1, 16)
    params = {"rel": torch.randn(2, 7), "cap": torch.rand(2) * 2 + 1.0, "row": torch.randn(5)}
    r = check_gradients(READS, q, k, vv, qo_lens=[19], kv_lens=[40], causal=causal, params=params, dtype=DTYPE)
    assert r.passed, r


def test_scattered_learnable_reads():
    q, k, vv = _qkv(19, 40, 2, 1, 16)
    params = {"t": torch.randn(2, 7), "u": torch.randn(7)}
    r = check_gradients(SCATTERED, q, k, vv, qo_lens=[19], kv_lens=[40], causal=True, params=params, dtype=DTYPE)
    assert r.passed, r


def test_bench_train_rows():
    """The --op train runner's row for fivar alone (timed on the CPU here; the GPU run adds Flex and SDPA)."""
    from fivar.bench.train import bench_train
    rows = bench_train(fivar.load("alibi"), seqlen=16, heads=(2, 1), head_dim=16, dtype=DTYPE, wanted=("fivar",),
                       rounds=1, device="cpu")
    (row,) = rows
    assert row["contender"] == "fivar" and row["op"] == "train" and row["ms"] > 0 and row["tflops"] > 0


def test_flex_frozen_contender_only_where_tensors_are_learnable():
    """Flex's own step differentiates the captured tensors; "flex-frozen" holds them constant (for variants whose
    captured-tensor gradient Flex cannot compile), so it exists only for a variant with learnable tensors."""
    from fivar.bench.train import train_contenders
    q, k, vv = _qkv(8, 8, 2, 2, 16)
    for v, params, want in ((learnable_copy(fivar.load("relative_bias")), {"bias": torch.randn(2, 13),
                                                                          "max_distance": 6}, True),
                            (fivar.load("softcap"), {"softcap": 2.0}, False)):
        fns = train_contenders(v, q, k, vv, causal=True, params=params, wanted=("fivar", "flex", "flex-frozen"))
        assert ("flex-frozen" in fns) == want and {"fivar", "flex"} <= set(fns)


def test_fivar_frozen_contender_does_flex_frozens_work():
    """"fivar-frozen" (next to flex-frozen) holds the learnable tensors constant: the same dq, dk, dv as fivar's own
    step, no parameter gradient, through a module whose backward computes none."""
    from fivar.bench.train import train_contenders
    from fivar.codegen.triton_bwd import learnable_params
    v = learnable_copy(fivar.load("alibi"))
    assert learnable_params(v) == ["slopes"] and learnable_params(learnable_copy(v, learnable=False)) == []
    q, k, vv = _qkv(24, 24, 4, 2, 16)
    params = _params(v, 4, 2, 1, 24)
    fns = train_contenders(v, q, k, vv, causal=True, params=params, wanted=("fivar", "fivar-frozen"))
    full, held = fns["fivar"](), fns["fivar-frozen"]()
    assert len(full) == 4 and len(held) == 3
    for a, b in zip(held, full):
        torch.testing.assert_close(a, b)
    assert "fivar-frozen" not in train_contenders(fivar.load("softcap"), q, k, vv, causal=True, params={"softcap": 2.0},
                                                  wanted=("fivar", "fivar-frozen"))


def test_gradients_reach_only_learnable_tensors():
    """A table not declared learnable gets no gradient (and needs no requires_grad)."""
    v = fivar.load("relative_bias")
    q, k, vv = (x.requires_grad_(True) for x in _qkv(8, 8, 2, 2, 16))
    bias = torch.randn(2, 13, requires_grad=True)
    with pytest.warns(UserWarning, match="'relative_bias': tensor param 'bias' requires grad but is not declared "
                                         "learnable"):
        v.attention(q, k, vv, bias=bias, max_distance=6).sum().backward()
    assert bias.grad is None and q.grad is not None
    with warnings.catch_warnings():  # said once per variant and param; a table without requires_grad says nothing
        warnings.simplefilter("error")
        v.attention(q, k, vv, bias=bias, max_distance=6).sum().backward()
        v.attention(q, k, vv, bias=bias.detach(), max_distance=6).sum().backward()


def test_learnable_needs_a_float_tensor():
    with pytest.raises(fivar.FivarSpecError, match="learnable=True needs a float dtype"):
        AttentionVariant(name="bad", mask=lambda *a: True,
                         params={"ids": Tensor("int32", ("n",), learnable=True)})


def test_lse_is_the_log2_sum_exp():
    v = fivar.load("softcap")
    q, k, vv = _qkv(9, 21, 2, 1, 16)
    o, lse = v.attention(q, k, vv, causal=True, return_lse=True, softcap=3.0)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(2, 1)) / 4.0
    s = 3.0 * torch.tanh(s / 3.0)
    s = s.masked_fill(torch.arange(21)[None, None, :] > torch.arange(9)[None, :, None] + 12, float("-inf"))
    want = torch.logsumexp(s, -1).T / torch.log(torch.tensor(2.0, dtype=torch.float64))
    assert torch.allclose(lse.double(), want, atol=2e-3)


def _request_sink(batch, qo_head, params):
    head = qo_head % 4  # an index through a let
    return params.sinks[batch, head] * params.gain[qo_head] + params.sinks[batch, 0]


def _gained(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score * params.gain[qo_head]


#: a learnable sink per (request, query head), scaled by a learnable per-head factor the logits read too, plus a
#: second read of the same table
REQUEST_SINK = AttentionVariant(
    name="request_sink_train", sink=_request_sink,
    logits=_gained,
    params={"sinks": Tensor("float32", ("batch", "qo_head"), learnable=True),
            "gain": Tensor("float32", ("qo_head",), learnable=True)})


@pytest.mark.parametrize("loss", ["o", "o+lse", "lse"])
def test_learnable_sink_and_lse_gradients(loss):
    """A sink's learnable tensors get their gradient (a sum over each request's rows of -P_sink * delta), and a loss
    that reads the lse gets its gradient too (ring attention merges states by it): ragged with a request of no
    queries, GQA, causal."""
    qo_lens, kv_lens = [7, 0, 1, 18], [19, 5, 6, 18]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), 4, 2, 16)
    params = {"sinks": torch.randn(4, 4) * 2, "gain": 0.5 + torch.rand(4)}
    r = check_gradients(REQUEST_SINK, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=True, params=params,
                        dtype=DTYPE, loss=loss)
    assert r.passed, r


def test_lse_gradient_without_a_sink():
    """The lse's gradient on a softmax variant without a sink (ALiBi, learnable slopes), one request whose rows all
    keep a key."""
    q, k, vv = _qkv(13, 29, 4, 2, 16)
    r = check_gradients(learnable_copy(fivar.load("alibi")), q, k, vv, qo_lens=[13], kv_lens=[29], causal=True,
                        params=_params(fivar.load("alibi"), 4, 2, 1, 29), dtype=DTYPE, loss="o+lse")
    assert r.passed, r


@pytest.mark.parametrize("reads_lse", [False, True])
def test_compiled_training_step(reads_lse):
    """torch.compile traces through the custom ops (fake implementations give the shapes), with and without a loss
    that reads the lse (the optional gradient through AOTAutograd)."""
    v = learnable_copy(fivar.load("relative_bias"))
    q, k, vv = _qkv(16, 16, 2, 2, 16)
    bias = torch.randn(2, 13, requires_grad=True)

    def step(q, k, vv, bias):
        o, lse = v.attention(q, k, vv, causal=True, bias=bias, max_distance=6, return_lse=True)
        return (o.float() ** 2).sum() + (lse.sin().sum() if reads_lse else 0.0)

    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, vv)]
    torch.compile(step, backend="aot_eager")(*leaves, bias).backward()
    want = [x.detach().clone().requires_grad_(True) for x in (q, k, vv)]
    bias2 = bias.detach().clone().requires_grad_(True)
    step(*want, bias2).backward()
    for a, b in zip(leaves + [bias], want + [bias2]):
        assert torch.equal(a.grad, b.grad)


def test_custom_ops_trace_in_one_graph():
    """The forward op and its autograd formula (the backward op) inside one fullgraph-compiled step."""
    import fivar.runtime.autograd  # noqa: F401 - registers the ops
    v = fivar.load("softcap")
    q, k, vv = (x.requires_grad_(True) for x in _qkv(16, 16, 2, 1, 16))
    indptr = torch.tensor([0, 16], dtype=torch.int32)
    key = v.key

    def step(q, k, vv):
        o, _ = torch.ops.fivar.attention_fwd(key, q, k, vv, indptr, indptr, 16, 16, True, 0.25, [], [30.0],
                                             "triton")
        return o.float().sum()

    torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, vv).backward()
    want = [x.detach().clone().requires_grad_(True) for x in (q, k, vv)]
    v.attention(*want, causal=True, sm_scale=0.25, softcap=30.0).float().sum().backward()
    for a, b in zip((q, k, vv), want):
        assert torch.equal(a.grad, b.grad)


def test_forward_backend_choice():
    """`auto` takes the FA3 forward only where it can run the call; asking for it where it cannot is a one-line
    error naming the variant."""
    from fivar.runtime.autograd import forward_target
    v = fivar.load("softcap")
    q, k, _ = _qkv(8, 8, 2, 1, 16)
    assert forward_target(v, "auto", q, k, True, False)[0] == "triton"
    assert forward_target(v, "triton", q, k, True, False)[0] == "triton"
    with pytest.raises(fivar.FivarError, match="variant 'softcap'.*backend='fa3'.*cpu"):
        forward_target(v, "fa3", q, k, True, False)
    with pytest.raises(fivar.FivarError, match="variant 'softcap'.*'fa4' is not available"):
        v.attention(q, k, k, backend="fa4", softcap=2.0)


def test_forward_backend_choice_on_a_gpu(monkeypatch):
    """The FA3 forward where it can run the call, the Triton one (auto) or a one-line error (fa3) otherwise: the
    GPU's arch, dtype, head dim, a CUDA graph being captured, causal rows before the first key."""
    from types import SimpleNamespace

    import fivar.runtime.autograd as ag
    from fivar.runtime.autograd import forward_target
    v = fivar.load("softcap")
    arch, capture = [(9, 0)], [False]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: arch[0])
    monkeypatch.setattr(ag, "capturing", lambda: capture[0])

    def q(dtype=torch.bfloat16, head_dim=128):
        return SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(8, 4, head_dim))
    assert forward_target(v, "auto", q(), q(), True, False)[0] == "fa3"
    assert forward_target(v, "auto", q(), q(), False, True)[0] == "fa3"  # rows before the first key: only causal
    for why, call in (("float16/bfloat16", dict(q=q(torch.float32))), ("head dims", dict(q=q(head_dim=96))),
                      ("qo_len > kv_len", dict(late_rows=True)), ("captured", dict(capture=True)),
                      ("sm80", dict(arch=(8, 0)))):
        capture[0], arch[0] = call.get("capture", False), call.get("arch", (9, 0))
        args = (call.get("q", q()), q(), True, call.get("late_rows", False))
        assert forward_target(v, "auto", *args)[0] == "triton", why
        with pytest.raises(fivar.FivarError, match=f"variant 'softcap'.*backend='fa3'.*{why}"):
            forward_target(v, "fa3", *args)
    capture[0], arch[0] = False, (8, 0)
    assert forward_target(v, "fa2", q(), q(), True, False)[0] == "fa2"


@pytest.mark.parametrize("name,ragged", [("relative_bias", False), ("document_mask", True), ("sigmoid", True),
                                         ("softcap", False)])
def test_flashinfer_forward_feeds_the_backward(monkeypatch, name, ragged):
    """The FA3/FA2 forward path: the variant's params reach the inference entry point by name, its (o, lse) go
    to the generated backward (zeros for lse without softmax), and the gradients are those of the Triton forward.
    FlashInfer's kernels need a GPU, so the entry points are stood in for by the Triton twin's own."""
    import fivar.runtime.attention as rt
    import fivar.runtime.autograd  # noqa: F401 - registers the ops
    calls = []

    def stand_in(kind):
        def run(variant, q, k, vv, *indptrs, backend, params, return_lse, **kw):
            calls.append((kind, backend, sorted(params), return_lse))
            fn = rt.triton_prefill if kind == "single" else rt.triton_batch_prefill_ragged
            return fn(variant, q, k, vv, *indptrs, params=params, return_lse=return_lse, **kw)
        return run
    monkeypatch.setattr(rt, "single_prefill", stand_in("single"))
    monkeypatch.setattr(rt, "batch_prefill_ragged", stand_in("ragged"))
    v = learnable_copy(fivar.load(name))
    qo_lens, kv_lens = ([5, 19, 12], [5, 23, 12]) if ragged else ([21], [21])
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), 4, 2, 16)
    params = _params(v, 4, 2, len(qo_lens), max(kv_lens))
    learn = [n for n, p in v.tensor_params.items() if p.learnable]
    kw = {}
    if ragged:
        kw = dict(qo_indptr=torch.tensor([0, *torch.tensor(qo_lens).cumsum(0)], dtype=torch.int32),
                  kv_indptr=torch.tensor([0, *torch.tensor(kv_lens).cumsum(0)], dtype=torch.int32))
    do = torch.randn_like(q)
    grads = []
    for target in ("fa3", "triton"):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, vv)]
        p = {n: (t.clone().requires_grad_(True) if n in learn else t) for n, t in params.items()}
        tensors = [p[n] for n in v.tensor_params]
        scalars = [float(p[n]) for n in v.scalar_params]
        indptrs = (kw["qo_indptr"], kw["kv_indptr"]) if ragged else (torch.tensor([0, 21], dtype=torch.int32),) * 2
        o, lse = torch.ops.fivar.attention_fwd(v.key, *leaves, *indptrs, max(qo_lens), max(kv_lens), True, 0.25,
                                               tensors, scalars, target)
        o.backward(do)
        grads.append([x.grad for x in leaves] + [p[n].grad for n in learn] + [lse])
    assert calls == [("ragged" if ragged else "single", "fa3", sorted(v.params), v.softmax)]
    if not v.softmax:
        assert torch.equal(grads[0][-1], torch.zeros_like(grads[0][-1]))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_sink_and_window_gradients_skip_the_gap():
    """A mask of two runs per row (attention sinks and a causal window, StreamingLLM's): the backward's tile lists
    leave out the tiles every row of a block drops between them (both kernels), and the gradients still match
    float64 autograd; single and ragged."""
    def sink_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
        return kv_idx < params.sinks or q_idx - kv_idx < params.window
    v = AttentionVariant(name="sink_window_train", mask=sink_window,
                         params={"sinks": Scalar(int, default=4), "window": Scalar(int, default=24)})
    for qo_lens in ([110], [37, 110]):  # row groups from 64 on leave whole key tiles in their gap
        q, k, vv = _qkv(sum(qo_lens), sum(qo_lens), 2, 1, 16)
        r = check_gradients(v, q, k, vv, qo_lens=qo_lens, kv_lens=qo_lens, causal=True,
                            params={"sinks": 4, "window": 24}, dtype=DTYPE)
        assert r.passed, r
    from fivar.jit.triton_module import load_triton_module
    module = load_triton_module(v, training=True)
    indptr = torch.tensor([0, 130], dtype=torch.int32)
    bound = bind_params(v, {"sinks": 4, "window": 24}, num_qo_heads=4, num_kv_heads=2, batch_size=1, device="cpu")
    args = kernel_arg_values(v, bound, 0.25)
    lists = module.bwd_tile_lists(indptr, indptr, 130, 130, 4, 2, True, args)
    (rows, keys), (dq_rows, dq_keys) = module.DKDV_TILE, module.DQ_TILE
    # keys 32..63 (the window keeps them for rows up to 86): no query tile from row 96 on visits them
    key_tile = 32 // keys
    listed = lists.dkdv_tiles[0, 0, key_tile, :int(lists.dkdv_counts[0, 0, key_tile].sum())]
    assert listed.numel() and int(listed.max()) * rows < 96 <= (int(listed.max()) + 1) * rows
    # rows 96..127 keep keys 0..3 and 73..127 only: none of the key tiles between
    query_tile = 96 // dq_rows
    listed = set(lists.dq_tiles[0, 0, query_tile, :int(lists.dq_counts[0, 0, query_tile].sum())].tolist())
    assert listed == set(range(4 // dq_keys + 1)) | set(range(73 // dq_keys, -(-128 // dq_keys)))


def test_flashinfer_forward_not_while_a_cuda_graph_is_captured(monkeypatch):
    """A compiled step chose the FA3 forward when it was traced; captured into a CUDA graph (reduce-overhead), the
    op runs the Triton forward instead, whose block map the graph records (a kept FlashInfer plan would replay
    the document ids it was made with)."""
    import fivar.runtime.attention as rt
    import fivar.runtime.autograd  # noqa: F401 - registers the ops

    def refuse(*a, **kw):
        raise AssertionError("the FlashInfer forward ran while a CUDA graph was captured")
    monkeypatch.setattr(rt, "single_prefill", refuse)
    monkeypatch.setattr(fivar.runtime.autograd, "capturing", lambda: True)
    v = fivar.load("softcap")
    q, k, vv = _qkv(16, 16, 2, 1, 16)
    indptr = torch.tensor([0, 16], dtype=torch.int32)
    got = torch.ops.fivar.attention_fwd(v.key, q, k, vv, indptr, indptr, 16, 16, True, 0.25, [], [30.0], "fa3")
    want = torch.ops.fivar.attention_fwd(v.key, q, k, vv, indptr, indptr, 16, 16, True, 0.25, [], [30.0], "triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_autotune_timings_kept_on_disk_where_triton_can(monkeypatch):
    """Triton >= 3.4 keeps autotuning timings in its cache: every tuned kernel of the module asks for it (the
    compiled module; the interpreter tunes nothing)."""
    import inspect

    import triton
    from fivar.jit.triton_module import load_triton_module
    if "cache_results" not in inspect.signature(triton.autotune).parameters:
        pytest.skip("this Triton has no autotune cache")
    # Triton fixes interpreted-or-compiled as it imports: Gluon (which the module imports) is imported interpreted
    # here, as the rest of Triton was, before the module is loaded as if compiled
    pytest.importorskip("triton.experimental.gluon")
    monkeypatch.delenv("TRITON_INTERPRET")
    module = load_triton_module(fivar.load("alibi"), training=True)
    for name in ("prefill_kernel", "decode_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"):
        assert getattr(module, name).cache_results, name


class _FakeCuda:
    """Stands in for a CUDA tensor [tokens, heads, head_dim] of bf16: only what tma_loads reads."""
    is_cuda = True
    device = "cuda:0"

    def __init__(self, shape, strides, ptr=1 << 20):
        self.shape, self._strides, self._ptr = shape, strides, ptr

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]

    def element_size(self):
        return 2

    def data_ptr(self):
        return self._ptr


def test_tma_loads_only_where_a_descriptor_can_read_the_tiles(monkeypatch):
    """The backward's full tiles go through TMA on sm90+ only for heads-contiguous, 16-byte-aligned rows; else (and
    before Hopper, and interpreted) through pointers."""
    from fivar.jit.triton_module import load_triton_module
    module = load_triton_module(fivar.load("alibi"), training=True)
    assert module.tma_loads(torch.zeros(4, 2, 16), torch.zeros(4, 2, 16)) is False  # CPU / interpreted
    monkeypatch.setattr(module, "INTERPRETING", False)
    monkeypatch.setattr(module, "TMA", True)
    monkeypatch.setattr(module, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(module, "_scratch_allocator", lambda: True)
    good = _FakeCuda((64, 8, 128), (8 * 128, 128, 1))
    assert module.tma_loads(good, good) is True
    assert module.tma_loads(good, _FakeCuda((64, 3, 128), (3 * 3 * 128, 128, 1))) is True  # a slice of fused qkv
    assert module.tma_loads(good, _FakeCuda((64, 8, 128), (128, 64 * 128, 1))) is False  # heads not contiguous
    assert module.tma_loads(good, _FakeCuda((64, 8, 128), (8 * 128, 128, 2))) is False  # strided head_dim
    assert module.tma_loads(good, _FakeCuda((64, 1, 4), (4 + 1, 4, 1))) is False  # a row not a multiple of 16 B
    assert module.tma_loads(good, _FakeCuda((64, 8, 128), (8 * 128, 128, 1), ptr=(1 << 20) + 8)) is False
    assert module.tma_loads(good, _FakeCuda((0, 8, 128), (8 * 128, 128, 1))) is False  # no rows
    assert module.tma_loads(_FakeCuda((64, 8, 128), (128, 64 * 128, 1)), good) is False  # either tensor decides
    monkeypatch.setattr(module, "_capability", lambda device: (8, 9))
    assert module.tma_loads(good, good) is False  # Ada: no TMA
    monkeypatch.setattr(module, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(module, "TMA", False)
    assert module.tma_loads(good, good) is False  # FIVAR_TRITON_TMA=0


def test_a_gluon_kernel_that_does_not_compile_falls_back_to_the_triton_kernels(monkeypatch):
    """Gluon's API moves between Triton releases: a Gluon launch that fails to compile warns once, names the Triton
    version, turns the Gluon kernels off for the module (gluon_dkdv says no from then on) and reports False, so the
    backward runs the Triton kernels; a launch that compiles reports True."""
    import triton

    from fivar.jit.triton_module import load_triton_module
    module = load_triton_module(fivar.load("alibi"), training=True)
    monkeypatch.setattr(module, "GLUON", True)
    ran = []
    assert module._gluon_launch(lambda: ran.append(1)) is True and ran == [1] and module.GLUON

    def broken():
        raise triton.CompilationError("kernel.py", None, "module 'gluon.language' has no attribute 'x'")

    with pytest.warns(UserWarning, match=f"Triton {triton.__version__}.*Triton kernels run instead"):
        assert module._gluon_launch(broken) is False
    assert module.GLUON is False
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    assert not module.gluon_dkdv(q, q, q, q)


def test_gluon_launch_out_of_memory_is_not_a_compile_failure(monkeypatch):
    """Running out of GPU memory is raised as it is, with the Gluon kernels left on (it is no compiler's error)."""
    from fivar.jit.triton_module import load_triton_module
    module = load_triton_module(fivar.load("alibi"), training=True)
    monkeypatch.setattr(module, "GLUON", True)

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        module._gluon_launch(oom)
    assert module.GLUON is True


def test_gluon_functions_take_the_key_reads_as_arguments():
    """Reads of the key alone (not the query, its head or the score) reach the Gluon functions as arguments, each
    function taking those it uses, read once before the dK/dV kernel's tile loop; the outermost read only, and
    never a read that also depends on the query."""
    import re

    from fivar.codegen.triton_bwd import _gluon_functions, render_training

    def per_key(batch, qo_head, kv_head, q_idx, kv_idx, params):
        return params.doc_ids[batch, q_idx] == params.doc_ids[batch, kv_idx]

    def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
        return score + params.key_bias[params.doc_ids[batch, kv_idx]] + params.pair[qo_head, q_idx - kv_idx]

    v = AttentionVariant(name="key_reads", logits=logits, mask=per_key,
                         params={"doc_ids": Tensor("int32", ("batch", "position")), "key_bias": Tensor("float32", ("doc",)),
                                 "pair": Tensor("float32", ("qo_head", "distance"))})
    fns, emit = _gluon_functions(v, [])
    reads = {n: str(e) for e, n in emit.col_loads.items()}
    assert len(reads) == 2, reads  # key_bias[doc_ids[kv]] (not its inner read) and doc_ids[kv]; never pair[...]
    assert all("pair" not in r for r in reads.values()) and sum("key_bias" in r for r in reads.values()) == 1
    by_name = {re.search(r"def (\w+)\(", f).group(1): f for f in fns}
    for name, cols in emit.function_cols.items():
        signature = by_name[name].splitlines()[1]
        assert all(c in signature for c in cols) and not any(c in signature for c in set(reads) - set(cols))
    assert emit.function_cols["gl_variant_mask"] == [n for n, r in reads.items() if "key_bias" not in r]
    assert set(emit.function_cols["gl_variant_logits"]) == {n for n, r in reads.items() if "key_bias" in r}
    assert "tl.load" not in by_name["gl_variant_mask"]  # both of its reads come in: the query's as a row read
    source = render_training(v)
    dkdv = source[source.index("def gl_bwd_dkdv_kernel"):source.index("def gl_bwd_dq_kernel")]
    for name in reads:
        assert dkdv.index(f"{name} = tl.load(") < dkdv.index("for fv_run in range(")  # before the runs of tiles
