"""CUDA-graph verify plans (fivar.runtime.graph_verify), on the CPU: the planning half (VerifyTiles) with the Triton
twin's block map under TRITON_INTERPRET=1.

A plan's buffers, refilled for a second step (other lengths, draft trees and pages, fewer requests than the
capacity), must hold exactly what a fresh plan of that step holds, at the same addresses; read the way the struct
reads them they keep exactly the pairs of the variant's mask, causal and the custom mask; the padding requests have
no pages, and no query rows unless a uniform plan on FA2 gives them its drafts' rows. A step past a limit is a one-line FivarError naming the variant and the limit, and
leaves the buffers as they were.
"""
import math
import random

import pytest
import torch

import fivar
from fivar.codegen.fa3 import TILE_WIDTH
from fivar.integrations.serving import tree_mask, tree_rows
from fivar.runtime.fa3_tile_list import block_map, paged_keys, tile_list
from fivar.runtime.graph_verify import VerifyTiles, capacity
from fivar.runtime.launch import _prepare
from fivar.testing import example_params

from test_block_map import HEADS, KV_HEADS, _variant
from test_fa3_tile_list import _ind, list_errors
from test_serving import _tree

D = 16
BUFFERS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "blocks", "tile_keys", "cut_bits")


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _setup(name, max_batch, max_len):
    """(variant, params): a bundled variant or test_block_map's head-window mask (bits per head)."""
    if name == "head_window_sinks":
        v, draw = _variant(name)
        return v, draw(max_batch, max_len)
    v = fivar.load(name)
    return v, example_params(v, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, batch_size=max_batch, max_len=max_len,
                             device="cpu")


class Step:
    """A random verify step: `batch` requests of 1..max_qo drafts (a random tree) after a prefix of up to `prefix`
    keys, in a shuffled pool of pages."""

    def __init__(self, batch, max_qo, prefix, page_size, qo=None, prefixes=None, pool=None):
        self.qo = qo or [random.randint(1, max_qo) for _ in range(batch)]
        prefixes = prefixes or [random.randint(0, prefix) for _ in range(batch)]
        parents = [_tree(n) for n in self.qo]
        self.kv = [p + n for p, n in zip(prefixes, self.qo)]
        self.masks = [torch.cat([torch.ones(n, p, dtype=torch.bool), tree_rows(par)], 1)
                      for n, p, par in zip(self.qo, prefixes, parents)]
        n_pages = [math.ceil(k / page_size) for k in self.kv]
        perm = torch.randperm(pool or sum(n_pages) + 5).tolist()
        self.owner, i, table = {}, 0, []
        for b, n in enumerate(n_pages):
            table += perm[i:i + n]
            for j, p in enumerate(perm[i:i + n]):
                self.owner[p] = (b, j)
            i += n
        self.page_size = page_size
        self.args = (_ind(self.qo), _ind(n_pages), torch.tensor(table, dtype=torch.int32),
                     torch.tensor([k - (n - 1) * page_size for k, n in zip(self.kv, n_pages)], dtype=torch.int32))
        packed, mask_indptr = tree_mask(prefixes, parents)
        self.mask = dict(packed_custom_mask=packed, mask_indptr=mask_indptr)

    def key_at(self, token):
        b, j = self.owner[token // self.page_size]
        return b, j * self.page_size + token % self.page_size


def _tiles(v, params, target, causal, page_size, max_batch=4, max_qo=12, max_pages=24):
    q = torch.zeros(1, HEADS, D, dtype=torch.float16)
    bound, sm_scale = _prepare(v, params, q, KV_HEADS, max_batch, None)
    return VerifyTiles(v, bound, target=target, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                       page_size=page_size, causal=causal, sm_scale=sm_scale, max_batch=max_batch, max_qo_len=max_qo,
                       max_pages=max_pages, device="cpu")


def _snapshot(tiles):
    return {n: getattr(tiles, n).clone() for n in BUFFERS}


@pytest.mark.parametrize("target", ["fa3", "fa2"])
@pytest.mark.parametrize("name", ["softcap", "document_mask", "head_window_sinks"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_replan_fills_the_buffers_as_a_fresh_plan_of_that_step(target, name, causal):
    page_size = random.choice([1, 16])
    max_pages = 4 * math.ceil(150 / page_size)
    v, params = _setup(name, 4, max_pages * page_size)
    tiles = _tiles(v, params, target, causal, page_size, max_pages=max_pages)
    addresses = [getattr(tiles, n).data_ptr() for n in BUFFERS]
    first = Step(4, 12, 150 - 12, page_size)  # the capacity's batch, long prefixes: many tiles, pages and cut bits
    tiles.plan(*first.args, **first.mask)
    second = Step(2, 6, 40, page_size)
    got = tiles.plan(*second.args, **second.mask)
    fresh = _tiles(v, params, target, causal, page_size, max_pages=max_pages)
    want = fresh.plan(*second.args, **second.mask)
    assert [getattr(tiles, n).data_ptr() for n in BUFFERS] == addresses  # the graph's addresses stay
    for n in BUFFERS:
        assert torch.equal(getattr(tiles, n), getattr(fresh, n)), n
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3])) and got[3] == want[3]
    assert tiles.batch == 2
    # the list's part is the plan TileListPrefill makes of that step, the heads' bits one buffer height apart
    qo, kv_pages, table, last = second.args
    token_of, kv_h = paged_keys(kv_pages, table, last, page_size, "cpu")
    kinds, bits_of, heads = block_map(v, tiles.bound, qo, kv_h, HEADS, KV_HEADS, D, causal, tiles.sm_scale, "cpu",
                                      tiles.rows, _custom(v, second))
    layout = tile_list(kinds, qo, kv_h, tiles.rows, token_of, bits_of, tiles.page, heads)
    r, e, w = layout.qo_indptr.numel() - 1, layout.tile_keys.numel(), layout.cut_bits.shape[1]
    assert tiles.requests == r and torch.equal(tiles.qo_indptr[:r + 1], layout.qo_indptr)
    assert torch.equal(tiles.kv_indptr[:r + 1], layout.kv_indptr)
    assert torch.equal(tiles.kv_indices[:int(layout.kv_indptr[-1])], layout.kv_indices)
    assert torch.equal(tiles.tile_keys[:e], layout.tile_keys) and torch.equal(tiles.cut_bits[:, :w], layout.cut_bits)
    assert torch.equal(tiles.blocks[:r, :-1], layout.blocks[:, :-1])
    assert (tiles.blocks[:r, -1] == (tiles.cut_bits.shape[1] * tiles.rows if heads > 1 else 0)).all()
    # padding requests: no query rows, no pages, no table entry
    assert (tiles.qo_indptr[r:] == sum(second.qo)).all() and (tiles.kv_indptr[r:] == tiles.kv_indptr[r]).all()
    assert (tiles.kv_last_page_len[r:] == 0).all() and (tiles.blocks[r:] == 0).all()
    # read as the struct reads them, the refilled buffers keep exactly the step's pairs
    view = type(layout)(tiles.qo_indptr[:r + 1], tiles.kv_indptr[:r + 1], tiles.kv_indices,
                        tiles.kv_last_page_len[:r], tiles.page, tiles.blocks[:r], tiles.tile_keys, tiles.cut_bits,
                        0, 0)
    assert list_errors(v, tiles.bound, view, second.qo, second.kv, causal, second.key_at, custom=second.masks) == []


def _custom(v, step):
    from fivar.runtime.custom_mask import check_custom_mask
    return check_custom_mask(v, None, step.mask["packed_custom_mask"], step.mask["mask_indptr"],
                             torch.tensor(step.qo), torch.tensor(step.kv), "cpu")


def _one_line(exc_info, *words):
    text = str(exc_info.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_a_step_past_a_limit_is_one_line_and_writes_nothing():
    v, params = _setup("softcap", 4, 400)
    tiles = _tiles(v, params, "fa3", False, 16)
    step = Step(3, 12, 100, 16)
    tiles.plan(*step.args, **step.mask)
    before = _snapshot(tiles)
    for big, limit in ((Step(5, 4, 10, 16), "max_batch=4 (5)"), (Step(2, 0, 10, 16, qo=[3, 13]), "max_qo_len=12 (13)"),
                       (Step(4, 12, 0, 16, prefixes=[100] * 4), "max_pages=24")):  # 7 pages each
        with pytest.raises(fivar.FivarError) as e:
            tiles.plan(*big.args, **big.mask)
        _one_line(e, "softcap", limit)
        assert all(torch.equal(getattr(tiles, n), before[n]) for n in BUFFERS)
    bad_mask = dict(step.mask, packed_custom_mask=step.mask["packed_custom_mask"][:-1])
    with pytest.raises(fivar.FivarError) as e:
        tiles.plan(*step.args, **bad_mask)
    _one_line(e, "softcap", "packed_custom_mask")
    assert all(torch.equal(getattr(tiles, n), before[n]) for n in BUFFERS)


def test_limits_and_fa3s_one_launch_are_checked_when_the_plan_is_made():
    v, params = _setup("softcap", 4, 400)
    with pytest.raises(fivar.FivarError) as e:
        _tiles(v, params, "fa3", False, 16, max_batch=2049, max_qo=100, max_pages=1)
    _one_line(e, "softcap", "2048", "max_batch=2049")
    _tiles(v, params, "fa2", False, 16, max_batch=2049, max_qo=100, max_pages=1)  # FA2: one launch of any size
    for bad in (0, -1, True, 2.5):
        with pytest.raises(fivar.FivarError) as e:
            _tiles(v, params, "fa2", False, 16, max_qo=bad)
        _one_line(e, "softcap", "max_qo_len")


@pytest.mark.parametrize("target", ["fa3", "fa2"])
def test_padding_requests_compute_nothing_and_the_seed_is_the_capacity(target):
    """The seed (FlashInfer's first plan) is the largest batch: every request's max_qo_len queries over the capacity's
    requests; a step of no queries is padding alone; every request past a step's has no rows and no pages."""
    v, params = _setup("softcap", 4, 400)
    tiles = _tiles(v, params, target, True, 16, max_batch=3, max_qo=20, max_pages=10)
    qo, kv, indices, last = tiles.seed()
    assert qo.numel() - 1 == tiles.capacity.requests == 3 * math.ceil(20 / tiles.rows)
    assert int(qo[-1]) == 3 * 20 and int(qo.diff().max()) <= tiles.rows and int(qo.diff().min()) > 0
    assert indices.numel() == kv.numel() - 1 == last.numel()
    got_qo, got_kv, got_last, pages = tiles.plan(torch.zeros(3, dtype=torch.int32), torch.tensor([0, 1, 2]),
                                                 torch.tensor([4, 7]), torch.tensor([3, 16]))
    assert pages == 0 and tiles.requests == 0 and not got_qo.any() and not got_kv.any() and not got_last.any()
    step = Step(1, 20, 30, 16)
    got_qo, got_kv, got_last, pages = tiles.plan(*step.args, **step.mask)
    r = tiles.requests
    assert 0 < r < tiles.capacity.requests and got_qo.numel() == got_kv.numel() == tiles.capacity.requests + 1
    assert (got_qo.diff()[r:] == 0).all() and (got_kv.diff()[r:] == 0).all() and (got_last[r:] == 0).all()
    assert int(got_kv[-1]) == pages


@pytest.mark.parametrize("target", ["fa2", "fa3"])
def test_a_uniform_plan_gives_every_request_and_padding_its_drafts_and_refuses_a_ragged_step(target):
    """uniform_qo_len=True on FA2 with drafts shorter than its query tile: each request one tile-list request of
    max_qo_len rows, padding requests too (q's rows past the step's, no pages), the step's part the list a
    non-uniform plan makes; FA3 (no scheduler hint) pads with requests of no rows. A step whose requests do not
    all hold max_qo_len queries is refused in one line, writing nothing."""
    max_batch, max_qo, page_size = 4, random.randint(2, 7), 16
    v, params = _setup("sliding_window", max_batch, 400)
    q = torch.zeros(1, HEADS, D, dtype=torch.float16)
    bound, sm_scale = _prepare(v, params, q, KV_HEADS, max_batch, None)

    def tiles(uniform, hint=True):
        return VerifyTiles(v, bound, target=target, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                           page_size=page_size, causal=True, sm_scale=sm_scale, max_batch=max_batch,
                           max_qo_len=max_qo, max_pages=40, device="cpu", uniform=uniform, hint=hint)
    uniform, ragged = tiles(True), tiles(False)
    assert max_qo < uniform.rows  # the tile is larger than the drafts: the case the promise serves
    rows = max_qo if target == "fa2" else None
    assert uniform.uniform_rows == rows and ragged.uniform_rows is None
    assert tiles(True, hint=False).uniform_rows is None  # a FlashInfer without the hint: padding keeps no rows
    seed_qo = uniform.seed()[0]
    assert seed_qo.numel() - 1 == max_batch and (seed_qo.diff() == max_qo).all()
    step = Step(2, max_qo, 150, page_size, qo=[max_qo, max_qo])
    got_qo, got_kv, got_last, pages = uniform.plan(*step.args, **step.mask)
    want_qo, want_kv, want_last, want_pages = ragged.plan(*step.args, **step.mask)
    r = uniform.requests
    assert r == ragged.requests == 2 and pages == want_pages
    assert torch.equal(got_kv, want_kv) and torch.equal(got_last, want_last)  # padding: no pages either way
    assert torch.equal(got_qo[:r + 1], want_qo[:r + 1])
    for n in BUFFERS[2:]:
        assert torch.equal(getattr(uniform, n), getattr(ragged, n)), n
    if rows:  # padding rows cover the rest of q: every row of the capacity lies in a request
        assert (got_qo.diff() == max_qo).all() and int(got_qo[-1]) == max_batch * max_qo
    else:
        assert (got_qo[r:] == 2 * max_qo).all()
    before = _snapshot(uniform)
    short = Step(2, max_qo, 40, page_size, qo=[max_qo, max_qo - 1])
    with pytest.raises(fivar.FivarError) as e:
        uniform.plan(*short.args, **short.mask)
    _one_line(e, "sliding_window", "uniform_qo_len=True", f"max_qo_len={max_qo}")
    assert all(torch.equal(getattr(uniform, n), before[n]) for n in BUFFERS)
    ragged.plan(*short.args, **short.mask)  # a plan without the promise takes it
    with pytest.raises(fivar.FivarError) as e:
        v.plan_paged(*step.args, cuda_graph=True, uniform_qo_len=max_qo, num_qo_heads=HEADS, num_kv_heads=KV_HEADS,
                     head_dim=64, page_size=page_size, device="cpu", **step.mask, **params)
    _one_line(e, "sliding_window", "uniform_qo_len must be True")
    with pytest.raises(fivar.FivarError) as e:  # a plan made directly checks it too
        tiles(1)
    _one_line(e, "sliding_window", "uniform_qo_len must be True")
    with pytest.raises(fivar.FivarError) as e:
        v.plan_paged(*step.args, uniform_qo_len=True, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=64,
                     page_size=page_size, device="cpu", **step.mask, **params)
    _one_line(e, "sliding_window", "cuda_graph=True")


def test_the_capacity_bounds_the_tile_list_of_any_step_within_the_limits():
    """Steps at the limits, every tile kept (no mask, not causal): the list fits the capacity, which is what the
    buffers hold."""
    v, params = _setup("softcap", 5, 4000)
    for _ in range(4):
        page_size = random.choice([1, 8, 16, 64])
        max_batch, max_qo = random.randint(1, 5), random.randint(1, 40)
        max_pages = random.randint(max_batch, 3 * max_batch) * max(1, 64 // page_size)
        tiles = _tiles(v, params, random.choice(["fa2", "fa3"]), False, page_size, max_batch, max_qo, max_pages)
        # split max_pages pages among max_batch requests of max_qo queries, each a full last page
        cuts = sorted(random.sample(range(1, max_pages), max_batch - 1)) if max_batch > 1 else []
        n_pages = [b - a for a, b in zip([0] + cuts, cuts + [max_pages])]
        qo = [max_qo] * max_batch
        kv = [n * page_size for n in n_pages]
        qo = [min(q, k) for q, k in zip(qo, kv)]
        args = (_ind(qo), _ind(n_pages), torch.randperm(max_pages).to(torch.int32),
                torch.full((max_batch,), page_size, dtype=torch.int32))
        tiles.plan(*args)
        cap = tiles.capacity
        used = tiles._used
        assert used[0] <= cap.pages and used[1] <= cap.requests and used[2] <= cap.entries
        assert cap == capacity(max_batch, max_qo, max_pages, page_size, tiles.rows)
        assert used[2] == sum(math.ceil(q / tiles.rows) * math.ceil(k / TILE_WIDTH) for q, k in zip(qo, kv))


def test_cuda_graph_plans_check_their_device_and_limits_in_one_line():
    v = fivar.load("softcap")
    step = Step(2, 4, 20, 16)
    common = dict(num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=64, page_size=16, **step.mask)
    with pytest.raises(fivar.FivarError) as e:
        v.plan_paged(*step.args, max_batch=4, **common)
    _one_line(e, "softcap", "cuda_graph=True", "max_batch")
    with pytest.raises(fivar.FivarError) as e:  # the CPU's twin runs float16 only
        v.plan_paged(*step.args, cuda_graph=True, backend="triton", device="cpu", dtype=torch.bfloat16, **common)
    _one_line(e, "softcap", "float16")
    if not torch.cuda.is_available():
        with pytest.raises(fivar.FivarError) as e:
            v.plan_paged(*step.args, cuda_graph=True, max_batch=4, device="cpu", **common)
        _one_line(e, "softcap", "CUDA GPU")


def _gathered(cache, step):
    kv_pages, table = step.args[1], step.args[2]
    return torch.cat([cache[table[kv_pages[b]:kv_pages[b + 1]].long()].reshape(-1, *cache.shape[2:])[:n]
                      for b, n in enumerate(step.kv)])


@pytest.mark.parametrize("name", ["softcap", "document_mask", "head_window_sinks"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_twins_graph_plan_runs_new_steps_through_its_fixed_tensors(name, causal):
    """backend="triton": one launch over max_batch requests at max_qo_len rows, re-planned for steps of other
    lengths, trees, pages and fewer requests (and one without a custom mask); each step against the float64
    reference, the rows past its tokens zeros."""
    from fivar.codegen.torch_ref import reference_attention
    page_size, pool, max_batch, max_qo = random.choice([1, 16]), 0, 3, 8
    pool = 3 * math.ceil(60 / page_size) + 4
    v, params = _setup(name, max_batch, pool * page_size)
    k_cache = torch.randn(pool, page_size, KV_HEADS, D).half()
    v_cache = torch.randn(pool, page_size, KV_HEADS, D).half()
    steps = [Step(3, max_qo, 52, page_size, pool=pool), Step(1, max_qo, 20, page_size, pool=pool),
             Step(2, max_qo, 52, page_size, pool=pool), Step(2, 3, 10, page_size, pool=pool)]
    first = steps[0]
    plan = v.plan_paged(*first.args, cuda_graph=True, backend="triton", device="cpu", max_batch=max_batch,
                        max_qo_len=max_qo, max_pages=pool, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                        page_size=page_size, dtype=torch.float16, causal=causal, **first.mask, **params)
    q_static = torch.zeros(max_batch * max_qo, HEADS, D, dtype=torch.float16)
    for i, step in enumerate(steps):
        masked = i < 3
        if i:
            plan.plan(*step.args, **(step.mask if masked else {}))
        n = sum(step.qo)
        q_static.zero_()
        q_static[:n] = torch.randn(n, HEADS, D).half()
        out = plan.run(q_static, (k_cache, v_cache))
        k, vv = _gathered(k_cache, step), _gathered(v_cache, step)
        refs, a, b = [], 0, 0
        for r, (lq, lk) in enumerate(zip(step.qo, step.kv)):
            refs.append(reference_attention(v, q_static[a:a + lq], k[b:b + lk], vv[b:b + lk], causal=causal,
                                            params=params, batch_idx=r, batch_size=max_batch,
                                            float_dtype=torch.float64,
                                            custom_mask=step.masks[r] if masked else None))
            a, b = a + lq, b + lk
        assert (out[:n].double() - torch.cat(refs)).abs().max() < 2e-2, (name, i, step.qo, step.kv)
        assert not out[n:].any() and plan.batch == len(step.qo)
    with pytest.raises(fivar.FivarError) as e:
        plan.plan(*Step(4, 2, 5, page_size, pool=pool).args)
    _one_line(e, name if name != "head_window_sinks" else "map_head_window_sinks", "max_batch=3 (4)")


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("hint", [False, True])
def test_a_maskless_plans_requests_are_the_steps_own_padded_to_the_capacity(uniform, hint):
    """A verify plan made without a custom mask on FA2 (VerifyRequests): its buffers hold the step's own requests
    then padding ones of no pages (and, promised uniform with FlashInfer told so, max_qo_len rows each, q's rows
    past the step's), at the same addresses; pages past the step's zeros; a step giving a mask and one past a limit
    are one-line errors leaving the buffers as they were."""
    from fivar.runtime.graph_verify import VerifyRequests
    v = fivar.load("softcap")
    max_batch, max_qo, page = 5, 6, 16
    plan = VerifyRequests(v, page_size=page, max_batch=max_batch, max_qo_len=max_qo, max_pages=40, device="cpu",
                          uniform=uniform, hint=hint)
    addresses = [t.data_ptr() for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len)]
    for batch, prefix in ((4, 90), (2, 30), (3, 5)):
        step = Step(batch, max_qo, prefix, page, qo=[max_qo] * batch if uniform else None)
        qo_h, kv_h, table, last = step.args
        plan.plan(*step.args)
        rows = max_qo if uniform and hint else 0
        pad = max_batch - batch
        want_qo = torch.cat([qo_h, qo_h[-1] + rows * torch.arange(1, pad + 1)])
        assert plan.qo_indptr.tolist() == want_qo.tolist()
        assert plan.kv_indptr.tolist() == kv_h.tolist() + [int(kv_h[-1])] * pad
        assert plan.kv_last_page_len.tolist() == last.tolist() + [0] * pad
        n = int(kv_h[-1])
        assert plan.kv_indices[:n].tolist() == table.tolist() and not plan.kv_indices[n:].any()
        assert plan.batch == batch
        assert addresses == [t.data_ptr() for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                                    plan.kv_last_page_len)]
    before = [t.clone() for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len)]
    step = Step(2, max_qo, 10, page, qo=[max_qo] * 2)
    with pytest.raises(fivar.FivarError) as e:
        plan.plan(*step.args, **step.mask)
    _one_line(e, "softcap", "made without a custom mask")
    with pytest.raises(fivar.FivarError) as e:
        plan.plan(*Step(max_batch + 1, max_qo, 10, page, qo=[max_qo] * (max_batch + 1)).args)
    _one_line(e, "softcap", f"max_batch={max_batch}")
    assert all(torch.equal(a, b) for a, b in zip(before, (plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                                          plan.kv_last_page_len)))


def test_the_twins_plan_made_without_a_mask_runs_its_steps_without_one():
    """backend="triton" keeps the same rule as FlashInfer's plans: made without a custom mask, a step runs the
    variant's mask and causal alone (against the float64 reference), and a step giving a mask is refused."""
    from fivar.codegen.torch_ref import reference_attention
    page_size, max_batch, max_qo = 16, 3, 6
    pool = 3 * math.ceil(40 / page_size) + 4
    v, params = _setup("softcap", max_batch, pool * page_size)
    k_cache = torch.randn(pool, page_size, KV_HEADS, D).half()
    v_cache = torch.randn(pool, page_size, KV_HEADS, D).half()
    first, second = (Step(n, max_qo, 30, page_size, pool=pool) for n in (3, 2))
    plan = v.plan_paged(*first.args, cuda_graph=True, backend="triton", device="cpu", max_batch=max_batch,
                        max_qo_len=max_qo, max_pages=pool, num_qo_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D,
                        page_size=page_size, dtype=torch.float16, causal=True, **params)
    with pytest.raises(fivar.FivarError) as e:
        plan.plan(*second.args, **second.mask)
    _one_line(e, "softcap", "made without a custom mask")
    plan.plan(*second.args)
    n = sum(second.qo)
    q_static = torch.zeros(max_batch * max_qo, HEADS, D, dtype=torch.float16)
    q_static[:n] = torch.randn(n, HEADS, D).half()
    out = plan.run(q_static, (k_cache, v_cache))
    k, vv = _gathered(k_cache, second), _gathered(v_cache, second)
    refs, a, b = [], 0, 0
    for r, (lq, lk) in enumerate(zip(second.qo, second.kv)):
        refs.append(reference_attention(v, q_static[a:a + lq], k[b:b + lk], vv[b:b + lk], causal=True, params=params,
                                        batch_idx=r, batch_size=max_batch, float_dtype=torch.float64))
        a, b = a + lq, b + lk
    assert (out[:n].double() - torch.cat(refs)).abs().max() < 2e-2
    assert not out[n:].any()
