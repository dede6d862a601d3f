"""return_lse and fivar.merge_states: the log2-sum-exp every backend returns, checked against float64 math, and
attention over KV cut into chunks, merged, against attention over the whole KV (Triton twin under the interpreter,
and the torch reference)."""
import math

import pytest
import torch

import fivar
from fivar import AttentionVariant, Tensor
from fivar.testing import _ragged_reference, _to_paged, compare

DTYPE = torch.float16  # the interpreter has no bfloat16 arithmetic


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _head_bias(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score * params.scale[qo_head] + 0.5


def _drop_head_one(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return qo_head != 1  # every key of head 1 is masked: its rows are zeros with lse -inf


# Logits that do not depend on where a key sits, so a chunk of the keys is attention over those keys alone.
POSITION_FREE = [
    fivar.load("softcap"),
    AttentionVariant(name="head_scaled", logits=_head_bias, mask=_drop_head_one,
                     params={"scale": Tensor("float32", ("qo_head",))}),
]


def _params(v, hq):
    return {"scale": torch.rand(hq) + 0.5} if "scale" in v.params else {}


def _qkv(lq, lk, hq, hkv, d):
    return (torch.randn(lq, hq, d, dtype=DTYPE), torch.randn(lk, hkv, d, dtype=DTYPE),
            torch.randn(lk, hkv, d, dtype=DTYPE))


def _lse64(v, q, k, vv, causal, params):
    """The LSE by its definition, in float64: log2 of the sum of exp(logits) over the kept keys."""
    out, lse = v.reference(q.double(), k.double(), vv.double(), causal=causal, return_lse=True, **params)
    return lse


def _assert_lse(got, want, atol=2e-3):
    assert got.dtype == torch.float32 and got.shape == want.shape
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), "rows without a kept key must have lse -inf, only those"
    assert bool((got[~finite] == -math.inf).all())
    assert torch.allclose(got[finite].double(), want[finite].double(), atol=atol, rtol=1e-4), \
        (got[finite] - want[finite]).abs().max()


def test_reference_lse_is_log2_sum_exp_of_the_logits():
    v = fivar.load("softcap")
    q, k, vv = _qkv(7, 11, 2, 1, 16)
    out, lse = v.reference(q, k, vv, causal=True, softcap=5.0, return_lse=True)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(2, 1)) / 4.0
    s = 5.0 * torch.tanh(s / 5.0)
    s = s.masked_fill(torch.arange(11)[None, None, :] > (torch.arange(7) + 4)[None, :, None], -math.inf)
    want = (torch.logsumexp(s, -1) / math.log(2)).transpose(0, 1)
    assert torch.allclose(lse.double(), want, atol=1e-4)
    assert torch.equal(out, v.reference(q, k, vv, causal=True, softcap=5.0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["softcap", "alibi", "sliding_window", "document_mask", "relative_bias"])
def test_triton_ragged_lse_matches_the_reference(name, causal):
    from fivar.testing import example_params
    v = fivar.load(name)
    qo_lens, kv_lens, hq, hkv, d = [5, 1, 17], [19, 7, 17], 4, 2, 16
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens), hq, hkv, d)
    params = example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=3, max_len=19, device="cpu")
    if "window" in v.params:
        params["window"] = 4
    if "max_distance" in params:
        params["max_distance"], params["bias"] = 6, torch.randn(hq, 13)
    qo_indptr = torch.tensor([0, 5, 6, 23], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 19, 26, 43], dtype=torch.int32)
    out, lse = v.batch_prefill_ragged(q, k, vv, qo_indptr, kv_indptr, causal=causal, backend="triton",
                                      return_lse=True, **params)
    ref = _ragged_reference(v, q, k, vv, qo_lens, kv_lens, causal, params)
    assert compare(name, "ragged lse", out, ref, DTYPE).passed
    want, qo, ko = [], 0, 0
    for b, (lq, lk) in enumerate(zip(qo_lens, kv_lens)):
        want.append(v.reference(q[qo:qo + lq], k[ko:ko + lk], vv[ko:ko + lk], causal=causal, batch_idx=b,
                                batch_size=3, return_lse=True, **params)[1])
        qo, ko = qo + lq, ko + lk
    _assert_lse(lse, torch.cat(want))


@pytest.mark.parametrize("v", POSITION_FREE, ids=lambda v: v.name)
def test_triton_decode_lse_matches_the_reference(v):
    kv_lens, hq, hkv, d = [1, 9, 40], 4, 2, 16  # 40 keys: several decode splits, merged with their lse
    q = torch.randn(3, hq, d, dtype=DTYPE)
    _, k, vv = _qkv(1, sum(kv_lens), hq, hkv, d)
    params = _params(v, hq)
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page_size=4)
    out, lse = v.decode(q, cache, indptr, indices, last, backend="triton", return_lse=True, **params)
    assert compare(v.name, "decode", out, _ragged_reference(v, q, k, vv, [1] * 3, kv_lens, False, params), DTYPE).passed
    want = torch.cat([_lse64(v, q[b:b + 1], k[sum(kv_lens[:b]):sum(kv_lens[:b + 1])],
                             vv[sum(kv_lens[:b]):sum(kv_lens[:b + 1])], False, params) for b in range(3)])
    _assert_lse(lse, want)
    assert torch.equal(out, v.decode(q, cache, indptr, indices, last, backend="triton", **params))


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("v", POSITION_FREE, ids=lambda v: v.name)
def test_chunks_merged_equal_attention_over_all_keys(v, chunks):
    lq, lk, hq, hkv, d = 9, 53, 4, 2, 32
    q, k, vv = _qkv(lq, lk, hq, hkv, d)
    params = _params(v, hq)
    edges = sorted(torch.randperm(lk - 1)[:chunks - 1].add(1).tolist())
    cuts = list(zip([0] + edges, edges + [lk]))
    parts = [v.prefill(q, k[a:b], vv[a:b], backend="triton", return_lse=True, **params) for a, b in cuts]
    out, lse = fivar.merge_states([o for o, _ in parts], [s for _, s in parts])
    whole, whole_lse = v.prefill(q, k, vv, backend="triton", return_lse=True, **params)
    ref, ref_lse = v.reference(q, k, vv, return_lse=True, **params)
    assert out.dtype == DTYPE and out.shape == q.shape
    assert compare(v.name, "merged vs reference", out, ref, DTYPE).passed
    assert (out.float() - whole.float()).abs().max() < 2e-3
    _assert_lse(lse, ref_lse)
    _assert_lse(whole_lse, ref_lse)
    # the reference's own chunks merge to the reference (float64: exact up to rounding)
    ref_parts = [v.reference(q.double(), k[a:b].double(), vv[a:b].double(), return_lse=True, **params) for a, b in cuts]
    m_out, m_lse = fivar.merge_states(torch.stack([o for o, _ in ref_parts]), torch.stack([s for _, s in ref_parts]))
    full = v.reference(q.double(), k.double(), vv.double(), return_lse=True, **params)
    assert torch.allclose(m_out.double(), full[0].double(), atol=1e-5)
    _assert_lse(m_lse.float(), full[1].float(), atol=1e-5)


def test_merge_states_math_and_empty_parts():
    o = torch.randn(3, 5, 2, 8, dtype=torch.float64)
    s = torch.randn(3, 5, 2, dtype=torch.float64) * 4
    s[1, 0, 0] = -math.inf  # one empty part
    s[:, 4, 1] = -math.inf  # a row no part saw a key for
    out, lse = fivar.merge_states(list(o), list(s))
    w = torch.softmax(s * math.log(2), 0)
    want = (w.nan_to_num(0.0).unsqueeze(-1) * o).sum(0)
    assert torch.allclose(out, want, atol=1e-6)
    want_lse = torch.logsumexp(s * math.log(2), 0) / math.log(2)
    assert torch.equal(torch.isfinite(lse), torch.isfinite(want_lse))
    assert torch.allclose(lse[torch.isfinite(lse)].double(), want_lse[torch.isfinite(want_lse)], atol=1e-5)
    assert bool((out[4, 1] == 0).all())
    with pytest.raises(fivar.FivarError, match="merge_states: outputs"):
        fivar.merge_states(o, s[:, :4])


def test_out_is_filled_and_returned_with_the_lse():
    v = fivar.load("softcap")
    q, k, vv = _qkv(6, 21, 2, 2, 16)
    out = torch.empty_like(q)
    got, lse = v.prefill(q, k, vv, backend="triton", out=out, return_lse=True)
    assert got is out
    _assert_lse(lse, _lse64(v, q, k, vv, False, {}))


@pytest.mark.parametrize("call", ["prefill", "ragged", "decode", "reference"])
def test_no_softmax_variant_refuses_return_lse_by_name(call):
    v = fivar.load("sigmoid")
    q, k, vv = _qkv(4, 8, 2, 2, 16)
    from fivar.testing import example_params
    params = example_params(v, num_qo_heads=2, num_kv_heads=2, batch_size=1, max_len=8, device="cpu")
    indptr = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    run = {"prefill": lambda: v.prefill(q, k, vv, backend="triton", return_lse=True, **params),
           "ragged": lambda: v.batch_prefill_ragged(q, k, vv, *indptr, backend="triton", return_lse=True, **params),
           "decode": lambda: v.decode(q[:1], *_to_paged(k, vv, [8], 4), backend="triton", return_lse=True,
                                      **params),
           "reference": lambda: v.reference(q, k, vv, return_lse=True, **params)}[call]
    with pytest.raises(fivar.FivarError, match="variant 'sigmoid': return_lse=True needs a softmax variant"):
        run()


def test_return_lse_is_a_reserved_param_name():
    with pytest.raises(fivar.FivarSpecError, match="return_lse"):
        AttentionVariant(name="bad", logits=_head_bias, params={"return_lse": Tensor("float32", ("qo_head",))})


@pytest.mark.parametrize("bad", ["dtype", "shape", "device", "lse_device", "int_lse", "empty", "not_a_tensor"])
def test_merge_states_refuses_parts_that_do_not_match_in_one_line(bad):
    """torch.stack promoted mixed dtypes (a float16 and a bfloat16 part merged to float32) and failed with raw errors
    on shapes and devices; now every part must match, in one line naming it (a meta tensor stands for another
    device)."""
    import random
    c, n, h, d = random.randint(2, 4), random.randint(1, 6), random.randint(1, 3), random.choice((8, 16))
    outs = [torch.randn(n, h, d, dtype=torch.float16) for _ in range(c)]
    lses = [torch.randn(n, h) for _ in range(c)]
    i = random.randrange(1, c)
    if bad == "dtype":
        outs[i] = outs[i].bfloat16()
    elif bad == "shape":
        outs[i] = torch.randn(n + 1, h, d, dtype=torch.float16)
    elif bad == "device":
        outs[i] = outs[i].to("meta")
    elif bad == "lse_device":
        lses = [x.to("meta") for x in lses]
    elif bad == "int_lse":
        lses[i] = lses[i].long()
    elif bad == "empty":
        outs, lses = [], []
    else:
        outs[i] = 1.0
    with pytest.raises(fivar.FivarError, match="merge_states: ") as info:
        fivar.merge_states(outs, lses)
    msg = str(info.value)
    assert "\n" not in msg
    if bad in ("dtype", "shape", "device", "int_lse", "not_a_tensor"):
        assert f"[{i}]" in msg, msg
