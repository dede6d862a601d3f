"""FA3 single prefill's last-wave split (fivar/runtime/wave_split.py) on the CPU: the merge kernel (Triton's
interpreter) against attention over all keys in float64, the plan against a plain event simulation, and which
variants may split."""
import heapq
import math
import random

import pytest
import torch

import fivar
from fivar import FivarError
from fivar.runtime import wave_split
from fivar.triton_ops.merge_states import merge_states


def _attention(q, k, v):
    """Output and log2-sum-exp of softmax attention, float64, [N, H, D] and [N, H]."""
    s = torch.einsum("nhd,khd->hnk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hnk,khd->nhd", s.softmax(-1), v), (torch.logsumexp(s, -1) / math.log(2)).T


@pytest.mark.parametrize("chunks", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,h,d,kv", [(37, 3, 80, 203), (1, 1, 64, 9), (20, 5, 128, 40)])
def test_merge_states_equals_attention_over_all_keys(n, h, d, kv, dtype, chunks):
    g = torch.Generator().manual_seed(n * 1000 + kv + chunks)
    q, k, v = (torch.randn(m, h, d, generator=g, dtype=torch.float64) for m in (n, kv, kv))
    cuts = sorted(random.Random(kv * chunks).sample(range(1, kv), chunks - 1))  # uneven, each chunk non-empty
    parts = [_attention(q, k[a:b], v[a:b]) for a, b in zip([0, *cuts], [*cuts, kv])]
    o_parts = torch.stack([o for o, _ in parts]).to(dtype)
    lse_parts = torch.stack([lse for _, lse in parts]).float()
    out = torch.full((n, h + 2, d), float("nan"), dtype=dtype)
    merge_states(o_parts, lse_parts, out[:, 1:h + 1])  # a strided view: the last heads of a full output
    want = _attention(q, k, v)[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[:, 1:h + 1].double(), want, atol=tol, rtol=tol)
    assert out[:, 0].isnan().all() and out[:, h + 1].isnan().all()  # nothing outside the view written


def test_merge_states_gives_an_empty_chunk_no_weight():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(m, 2, 64, generator=g, dtype=torch.float64) for m in (5, 30, 30))
    o, lse = _attention(q, k, v)
    o_parts = torch.stack([o, torch.randn(5, 2, 64, generator=g, dtype=torch.float64)]).float()
    lse_parts = torch.stack([lse, torch.full_like(lse, float("-inf"))]).float()
    out = merge_states(o_parts, lse_parts, torch.empty(5, 2, 64))
    torch.testing.assert_close(out.double(), o, atol=1e-5, rtol=1e-5)


def test_merge_states_refuses_shapes_it_cannot_merge():
    from fivar import FivarError
    with pytest.raises(FivarError, match="power of two"):
        merge_states(torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2), torch.zeros(4, 2, 8))
    with pytest.raises(FivarError, match="expected"):
        merge_states(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 3), torch.zeros(4, 2, 8))


@pytest.mark.parametrize("bad", ["3d_parts", "lse_fp16", "lse_elsewhere", "int_out"])
def test_merges_refuse_parts_that_do_not_match_in_one_line(bad):
    """Shapes, dtypes and devices the kernels cannot take are one line each, before a launch (a meta tensor stands for
    another device)."""
    from fivar import FivarError
    o, lse, out = torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2), torch.empty(4, 2, 8)
    if bad == "3d_parts":
        o = o[0]
    elif bad == "lse_fp16":
        lse = lse.half()
    elif bad == "lse_elsewhere":
        lse = lse.to("meta")
    elif bad == "int_out":
        out = out.int()
    with pytest.raises(FivarError) as info:
        merge_states(o, lse, out)
    assert "\n" not in str(info.value) and "merge" in str(info.value)


def _simulated_end(lengths, sms):
    """Greedy list scheduling, event by event: each job in order goes to the SM that is free first."""
    free = [(0.0, i) for i in range(sms)]
    end = 0.0
    for length in lengths:
        t, i = heapq.heappop(free)
        end = max(end, t + length)
        heapq.heappush(free, (t + length, i))
    return end


@pytest.mark.parametrize("seed", range(20))
def test_makespan_matches_an_event_simulation(seed):
    rng = random.Random(seed)
    sms, full, pieces = rng.randint(1, 140), rng.randint(0, 600), rng.randint(0, 900)
    full_len, piece_len = rng.uniform(5, 200), rng.uniform(1, 50)
    want = _simulated_end([full_len] * full + [piece_len] * pieces, sms)
    assert wave_split._makespan(full, full_len, pieces, piece_len, sms) == pytest.approx(want)


@pytest.mark.parametrize("q_tiles,heads,group,kv_tiles,sms", [
    (128, 32, 1, 128, 132), (128, 32, 4, 128, 132), (64, 32, 1, 64, 132), (37, 13, 1, 300, 132),
    (128, 32, 1, 128, 114), (9, 48, 8, 100, 78), (128, 33, 1, 128, 132), (64, 33, 3, 64, 132)])
def test_plan_splits_whole_groups_and_gains_what_it_claims(q_tiles, heads, group, kv_tiles, sms):
    p = wave_split.plan(q_tiles, heads, group, kv_tiles, sms)
    full_len = kv_tiles + wave_split.CTA_FIXED_TILES
    unsplit = _simulated_end([full_len] * (q_tiles * heads), sms)
    if p is None:
        return
    assert p.tail_heads % group == 0 and 0 < p.tail_heads < heads
    assert p.chunks in wave_split.CHUNK_COUNTS and kv_tiles >= wave_split.MIN_CHUNK_TILES * p.chunks
    piece = math.ceil(kv_tiles / p.chunks) + wave_split.CTA_FIXED_TILES
    end = _simulated_end([full_len] * (q_tiles * (heads - p.tail_heads)) + [piece] * (q_tiles * p.tail_heads * p.chunks),
                         sms) + wave_split.MERGE_TILES
    assert p.makespan == pytest.approx(end)
    assert end <= unsplit * (1 - wave_split.MIN_GAIN)


def test_plan_leaves_full_waves_alone():
    # 33 heads x 128 tiles = 4224 CTAs: exactly 32 waves of 132
    assert wave_split.plan(128, 33, 1, 128, 132) is None
    # S=16384, 32 heads on 132 SMs: 31 waves and 4 CTAs, the case it is for
    assert wave_split.plan(128, 32, 1, 128, 132) is not None


def test_which_variants_may_split():
    softcap = fivar.load("softcap")
    assert wave_split.applies(softcap, causal=False, window_left=-1)
    assert not wave_split.applies(softcap, causal=True, window_left=-1)
    assert not wave_split.applies(softcap, causal=False, window_left=100)
    assert not wave_split.applies(softcap, causal=False, window_left=-1, schedule="persistent")
    # ALiBi reads the head and kv_idx, relative_bias a table, the windows and document mask mask: a launch over a
    # slice of heads or keys would see other indices
    for name in ("alibi", "relative_bias", "sliding_window", "document_mask"):
        assert not wave_split.applies(fivar.load(name), causal=False, window_left=-1), name
    assert not wave_split.applies(fivar.load("sigmoid"), causal=False, window_left=-1)  # no softmax: no LSE


def test_a_bad_setting_names_the_variant_and_the_variable(monkeypatch):
    monkeypatch.setenv(wave_split.ENV, "3x5")
    with pytest.raises(FivarError, match=r"variant 'softcap': FIVAR_FA3_WAVE_SPLIT='3x5'"):
        wave_split.plan_for(fivar.load("softcap"), torch.zeros(100, 8, 64), torch.zeros(100, 8, 64), (128, 128))
    monkeypatch.setenv(wave_split.ENV, "3x4")  # 3 query heads are not whole groups of 4
    with pytest.raises(FivarError, match="whole KV-head groups"):
        wave_split.plan_for(fivar.load("softcap"), torch.zeros(1000, 8, 64), torch.zeros(1000, 2, 64), (128, 128))
    monkeypatch.setenv(wave_split.ENV, "0")
    assert wave_split.plan_for(fivar.load("softcap"), torch.zeros(1000, 8, 64), torch.zeros(1000, 2, 64),
                               (128, 128)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_into_is_attention_over_both_key_sets(dtype):
    """The running two-state merge, in place on strided views, against float64 attention over both key sets; rows
    empty in one state take the other's, rows empty in both are zeros with lse -inf."""
    from fivar.triton_ops.merge_states import merge_into
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    n, h, d = 37, 3, 80
    q, k, v = (torch.randn(m, h, d, generator=g, dtype=torch.float64) for m in (n, 50, 50))
    (o_a, lse_a), (o_b, lse_b) = _attention(q, k[:20], v[:20]), _attention(q, k[20:], v[20:])
    want, want_lse = _attention(q, k, v)
    lse_a[3], lse_b[5], lse_a[7], lse_b[7] = float("-inf"), float("-inf"), float("-inf"), float("-inf")
    want[3], want_lse[3] = o_b[3], lse_b[3]
    want[5], want_lse[5] = o_a[5], lse_a[5]
    want[7], want_lse[7] = 0, float("-inf")
    out = torch.full((n, h + 1, d), float("nan"), dtype=dtype)
    out[:, :h] = o_a.to(dtype)
    lse = torch.full((h, n), float("nan")).T  # column-major: strides of its own
    lse[:] = lse_a.float()
    merge_into(out[:, :h], lse, o_b.to(dtype), lse_b.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:, :h].double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    assert out[:, h].isnan().all()
