"""Each bundled variant's torch reference against a hand-written formula of what the variant means.

The hand-written side never goes through fivar's parser, so a mistake in the parser, the IR evaluator
or the index conventions (q_idx alignment, GQA head mapping, batch index) shows up here.
"""
import math

import pytest
import torch

import fivar

torch.manual_seed(0)


def _plain(q, k, v, logits_fn=None, keep_fn=None, causal=False, softmax=True, sm_scale=None):
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    g = hq // hkv
    sm_scale = sm_scale or 1 / math.sqrt(d)
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * sm_scale
    qpos = torch.arange(lq).view(1, lq, 1) + (lk - lq)
    kpos = torch.arange(lk).view(1, 1, lk)
    head = torch.arange(hq).view(hq, 1, 1)
    if logits_fn:
        s = logits_fn(s, head, qpos, kpos)
    keep = torch.ones_like(s, dtype=torch.bool)
    if keep_fn:
        keep &= keep_fn(head, qpos, kpos)
    if causal:
        keep &= kpos <= qpos
    if softmax:
        p = torch.softmax(s.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0)
    else:
        p = torch.where(keep, s, 0.0)
    return torch.einsum("hqk,khd->qhd", p, vv)


SHAPES = [(1, 1, 4, 4), (7, 23, 8, 2), (19, 19, 4, 1), (5, 40, 6, 3)]  # qo_len, kv_len, Hq, Hkv


def _qkv(lq, lk, hq, hkv, d=32):
    return torch.randn(lq, hq, d), torch.randn(lk, hkv, d), torch.randn(lk, hkv, d)


def _assert_close(out, ref):
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_softcap(shape, causal):
    q, k, v = _qkv(*shape)
    cap = float(torch.empty(1).uniform_(0.5, 5.0))
    out = fivar.load("softcap").reference(q, k, v, causal=causal, softcap=cap)
    _assert_close(out, _plain(q, k, v, lambda s, h, i, j: cap * torch.tanh(s / cap), causal=causal))


@pytest.mark.parametrize("shape", SHAPES)
def test_alibi_uses_absolute_query_position(shape):
    q, k, v = _qkv(*shape)
    slopes = torch.rand(shape[2])
    out = fivar.load("alibi").reference(q, k, v, causal=True, slopes=slopes)
    ref = _plain(q, k, v, lambda s, h, i, j: s + slopes[h] * (j - i).double(), causal=True)
    _assert_close(out, ref)


@pytest.mark.parametrize("shape", SHAPES)
def test_sigmoid_has_no_normalisation(shape):
    q, k, v = _qkv(*shape)
    bias = float(torch.randn(1))
    out = fivar.load("sigmoid").reference(q, k, v, bias=bias)
    _assert_close(out, _plain(q, k, v, lambda s, h, i, j: torch.sigmoid(s + bias), softmax=False))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [1, 3, 16])
def test_sliding_window(shape, window):
    q, k, v = _qkv(*shape)
    out = fivar.load("sliding_window").reference(q, k, v, causal=True, window=window)
    _assert_close(out, _plain(q, k, v, keep_fn=lambda h, i, j: (i - j) < window, causal=True))


@pytest.mark.parametrize("shape", SHAPES)
def test_document_mask(shape):
    q, k, v = _qkv(*shape)
    lk = shape[1]
    ids = torch.sort(torch.randint(0, 3, (2, lk), dtype=torch.int32), dim=1).values
    out = fivar.load("document_mask").reference(q, k, v, doc_ids=ids, batch_idx=1, batch_size=2)
    row = ids[1].long()
    _assert_close(out, _plain(q, k, v, keep_fn=lambda h, i, j: row[i.clamp(0, lk - 1)] == row[j]))


@pytest.mark.parametrize("shape", SHAPES)
def test_relative_bias(shape):
    q, k, v = _qkv(*shape)
    r = 4
    table = torch.randn(shape[2], 2 * r + 1)
    out = fivar.load("relative_bias").reference(q, k, v, bias=table, max_distance=r)
    ref = _plain(q, k, v, lambda s, h, i, j: s + table[h, (j - i).clamp(-r, r) + r].double())
    _assert_close(out, ref)


@pytest.mark.parametrize("shape", SHAPES)
def test_softcap_sliding_window(shape):
    q, k, v = _qkv(*shape)
    out = fivar.load("softcap_sliding_window").reference(q, k, v, causal=True, softcap=20.0, window=5)
    ref = _plain(q, k, v, lambda s, h, i, j: 20.0 * torch.tanh(s / 20.0), keep_fn=lambda h, i, j: (i - j) < 5,
                 causal=True)
    _assert_close(out, ref)


def test_missing_and_wrong_params_are_clear_errors():
    q, k, v = _qkv(3, 5, 4, 2)
    alibi = fivar.load("alibi")
    with pytest.raises(fivar.FivarError, match="variant 'alibi': missing parameter 'slopes'"):
        alibi.reference(q, k, v)
    with pytest.raises(fivar.FivarError, match="dimension 0 \\('qo_head'\\) must be 4"):
        alibi.reference(q, k, v, slopes=torch.rand(3))
    with pytest.raises(fivar.FivarError, match="dtype torch.float32"):
        alibi.reference(q, k, v, slopes=torch.rand(4, dtype=torch.float64))
    with pytest.raises(fivar.FivarError, match="unknown parameter\\(s\\) slope"):
        alibi.reference(q, k, v, slope=torch.rand(4))
    with pytest.raises(fivar.FivarError, match="'window' is an int parameter"):
        fivar.load("sliding_window").reference(q, k, v, window=2.5)
