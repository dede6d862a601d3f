"""The tile list's request per head (fivar.runtime.fa3_tile_list.HeadRequests), on the CPU: a mask whose heads keep
very different tiles is planned as one request per query tile and head; q gathered head-major, k/v read in place
through pages of one KV head. The plan is run here the way the generated struct and FlashInfer's paged kernel read it
(keys through the page table of the view, whole keys kept, the others from their bits), in float64, and the output
scattered back must equal float64 attention under the torch reference's evaluator, for ragged batches with
GQA, lengths off every tile and a request without queries, k/v contiguous or slices of packed qkv.
"""
import random

import pytest
import torch

from fivar import AttentionVariant, Scalar, Tensor
from fivar.codegen.fa3 import TILE_WIDTH
from fivar.codegen.tile_list import reads_heads
from fivar.runtime.fa3_tile_list import HeadRequests, block_map, head_requests_pay, page_size_for, tile_list
from fivar.runtime.launch import _prepare
from fivar.spec.sparsity import keep_matrix

HEADS, KV_HEADS, DIM, ROWS = 4, 2, 8, 16


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _head_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.windows[qo_head] or kv_idx < params.sinks


def _head_bias(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.bias[qo_head]


VARIANT = AttentionVariant(name="head_window", mask=_head_window,
                           params={"windows": Tensor("int32", ("qo_head",)), "sinks": Scalar(int, default=2)})


def _ind(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def _run_as_kernel(layout, q_v, k_view, v_view, sm_scale):
    """Each request's rows over its listed keys as the paged kernel and the tile-list struct read them."""
    out = torch.zeros(q_v.shape[0], q_v.shape[-1], dtype=torch.float64)
    qo, kv = layout.qo_indptr.tolist(), layout.kv_indptr.tolist()
    lasts, page = layout.kv_last_page_len.tolist(), layout.page
    words = layout.cut_bits.view(-1).long() & 0xFFFFFFFF
    for r, (_, _, e0, whole, bit0, stride, head_words) in enumerate(layout.blocks.tolist()):
        assert head_words == 0  # one head a request: no head's bits after another's
        pages = layout.kv_indices[kv[r]:kv[r + 1]].tolist()
        keys = torch.cat([k_view[p, :lasts[r] if i == len(pages) - 1 else page, 0] for i, p in enumerate(pages)])
        vals = torch.cat([v_view[p, :lasts[r] if i == len(pages) - 1 else page, 0] for i, p in enumerate(pages)])
        rows = q_v[qo[r]:qo[r + 1], 0].double()
        n = rows.shape[0]
        if whole < 0:
            continue  # keeps nothing: zeros
        keep = torch.zeros(n, keys.shape[0], dtype=torch.bool)
        keep[:, :whole] = True
        for c in range(keys.shape[0] - whole):
            at = bit0 + (c // TILE_WIDTH) * stride + torch.arange(n)
            keep[:, whole + c] = ((words[at] >> (c % TILE_WIDTH)) & 1).bool()
        s = (rows @ keys.double().T) * sm_scale
        s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[qo[r]:qo[r + 1]] = p @ vals.double()
    return out


def _reference(q, k, v, qo, kv, bound, causal, sm_scale, key_of):
    out = torch.zeros(q.shape, dtype=torch.float64)
    qo_i = _ind(qo).tolist()
    for b, (lq, lk) in enumerate(zip(qo, kv)):
        keep = keep_matrix(VARIANT.ir.mask, qo_len=lq, kv_len=lk, scalars=bound.scalars, tensors=bound.tensors,
                           num_qo_heads=HEADS, num_kv_heads=KV_HEADS, batch_idx=b, causal=causal)
        for h in range(HEADS):
            keys, vals = key_of(k, b, h // (HEADS // KV_HEADS), lk), key_of(v, b, h // (HEADS // KV_HEADS), lk)
            s = (q[qo_i[b]:qo_i[b + 1], h].double() @ keys.double().T) * sm_scale
            p = torch.softmax(s.masked_fill(~keep[h], float("-inf")), -1).nan_to_num(0.0)
            out[qo_i[b]:qo_i[b + 1], h] = p @ vals.double()
    return out


def _case(kv_form, causal, mutate=None):
    kv = [random.randint(20, 90) for _ in range(3)]
    qo = [random.randint(1, k) for k in kv]
    qo[random.randrange(3)] = 0
    windows = torch.tensor([random.randint(1, 6), random.randint(1, 6), 1 << 20, random.randint(1, 6)],
                           dtype=torch.int32)
    params = {"windows": windows[torch.randperm(HEADS)], "sinks": random.randint(0, 3)}
    q = torch.randn(max(sum(qo), 1), HEADS, DIM, dtype=torch.float16)
    bound, sm_scale = _prepare(VARIANT, params, q, KV_HEADS, len(qo), None)
    starts = _ind(kv).long()
    page = page_size_for(_ind(kv))
    k, v = (torch.randn(sum(kv), KV_HEADS, DIM, dtype=torch.float16) for _ in range(2))
    if kv_form == "packed":  # k and v as slices of packed qkv: each token's heads a row, tokens further apart
        qkv = torch.randn(sum(kv), HEADS + 2 * KV_HEADS, DIM, dtype=torch.float16)
        k, v = qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    token_of = lambda b, kv_idx: starts[b] + kv_idx  # noqa: E731
    key_of = lambda x, b, g, n: x[int(starts[b]):int(starts[b]) + n, g]  # noqa: E731
    kinds, bits_at, heads = block_map(VARIANT, bound, _ind(qo), _ind(kv), HEADS, KV_HEADS, 128, causal, sm_scale,
                                      "cpu", ROWS, per_head=True)
    assert heads == HEADS  # run per head whatever head_requests_pay would choose
    h = HeadRequests.of(_ind(qo).long(), HEADS, KV_HEADS)
    at = h.token_of(token_of, page)
    if mutate == "kv_head":  # every request reads KV head 0
        at = lambda b, kv_idx, f=at: f(h.entry(b), kv_idx)  # noqa: E731
    layout = tile_list(h.map(kinds), h.indptr(_ind(qo).long()), h.indptr(_ind(kv).long()), ROWS, at,
                       h.bits_of(bits_at, kinds.shape[2]), page)
    q_v = h.gather(q)
    if mutate == "perm":  # the heads' rows moved round by one head
        q_v = q_v.roll(sum(qo), 0)
    got = h.scatter(_run_as_kernel(layout, q_v, h.kv_view(k, page), h.kv_view(v, page), sm_scale), None, q)
    return got, _reference(q, k, v, qo, kv, bound, causal, sm_scale, key_of)


@pytest.mark.parametrize("kv_form", ["ragged", "packed"])
@pytest.mark.parametrize("causal", [False, True])
def test_requests_per_head_compute_the_masked_attention(kv_form, causal):
    for _ in range(2):
        got, want = _case(kv_form, causal)
        assert torch.allclose(got, want, atol=1e-9), (got - want).abs().max()


@pytest.mark.parametrize("mutate", ["kv_head", "perm"])
def test_a_wrong_head_mapping_fails_the_check(mutate):
    got, want = _case("ragged", True, mutate)
    assert not torch.allclose(got, want, atol=1e-3)


def test_heads_alike_keep_the_union_and_head_reading_logits_keep_it_too():
    alike = torch.ones(1, HEADS, 3, 4, dtype=torch.int8)
    assert not head_requests_pay(alike)  # every head keeps what the union does
    apart = torch.zeros(1, HEADS, 3, 4, dtype=torch.int8)
    apart[0, 0] = 1
    assert head_requests_pay(apart)
    assert not reads_heads(VARIANT)
    biased = AttentionVariant(name="head_bias", logits=_head_bias, mask=_head_window,
                              params={**VARIANT.params, "bias": Tensor("float32", ("qo_head",))})
    assert reads_heads(biased)
