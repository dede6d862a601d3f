"""The Triton twin's block map (`block_map` of a masked variant's module), on the CPU, against every pair.

For masks of the kinds no band describes (dilated and strided windows, keys flagged by a tensor, a window per head
with sinks, random block tables, documents with a window, frame-causal), over random ragged batches (a request
without queries, queries outside their keys' range, lengths off every tile), causal and not, at two tiles: each tile's
kind must be what the torch reference's evaluator says of its pairs (empty: none kept; whole: every pair of the
tile's rows kept and the tile inside the keys; cut otherwise), each row of the map lists exactly its whole tiles and
then exactly its cut ones, and a cut tile's bits are exactly its kept pairs. A corrupted map must fail the same
check. Then the prefill that runs on the map against the float64 reference.
"""
import random

import pytest
import torch

from fivar import AttentionVariant, Scalar, Tensor
from fivar.codegen.triton import kernel_arg_values, reads_mask_bits
from fivar.jit.triton_module import load_triton_module
from fivar.runtime.launch import _prepare
from fivar.spec.sparsity import keep_matrix
from fivar.testing import _ragged_reference, compare

HEADS, KV_HEADS, DIM = 2, 1, 16  # GQA; each head is one more interpreted program per block


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def _dilated(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return (q_idx - kv_idx) % params.stride == 0 and q_idx - kv_idx < params.span


def _flagged(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return (q_idx - kv_idx < params.window and kv_idx - q_idx < params.window) or params.flags[batch, kv_idx] > 0


def _head_window_sinks(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.windows[qo_head] or kv_idx < params.sinks


def _block_table(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.table[q_idx // params.block, kv_idx // params.block] > 0 or q_idx == kv_idx


def _document_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc[batch, q_idx] == params.doc[batch, kv_idx] and q_idx - kv_idx < params.window


def _frames(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx // params.frame <= q_idx // params.frame


MASKS = {
    "dilated": (_dilated, {"stride": Scalar(int, default=3), "span": Scalar(int, default=40)},
                lambda b, n: {"stride": random.randint(2, 5), "span": random.randint(8, 80)}),
    "flagged": (_flagged, {"window": Scalar(int, default=5), "flags": Tensor("int32", ("batch", "position"))},
                lambda b, n: {"window": random.randint(1, 20),
                              "flags": (torch.rand(b, n) < 0.08).to(torch.int32)}),
    "head_window_sinks": (_head_window_sinks, {"windows": Tensor("int32", ("qo_head",)),
                                               "sinks": Scalar(int, default=4)},
                          lambda b, n: {"windows": torch.randint(1, 40, (HEADS,), dtype=torch.int32),
                                        "sinks": random.randint(0, 9)}),
    "block_table": (_block_table, {"table": Tensor("int32", ("q_block", "kv_block")), "block": Scalar(int, default=8)},
                    lambda b, n: {"table": (torch.rand(n // 4 + 2, n // 4 + 2) < 0.3).to(torch.int32),
                                  "block": random.choice([4, 7, 8, 13])}),
    "document_window": (_document_window, {"doc": Tensor("int32", ("batch", "position")),
                                           "window": Scalar(int, default=9)},
                        lambda b, n: {"doc": torch.sort(torch.randint(0, 5, (b, n), dtype=torch.int32), 1).values,
                                      "window": random.randint(1, 30)}),
    "frames": (_frames, {"frame": Scalar(int, default=12)}, lambda b, n: {"frame": random.randint(3, 40)}),
}


def _variant(name):
    fn, params, draw = MASKS[name]
    return AttentionVariant(name=f"map_{name}", mask=fn, params=params), draw


def _batch():
    """Ragged lengths off every tile: one request without queries, one with more queries than keys."""
    kv = [random.randint(1, 90) for _ in range(3)]
    qo = [random.randint(1, k) for k in kv]
    qo[random.randrange(3)] = 0
    kv[2] = random.randint(1, 30)
    qo[2] = kv[2] + random.randint(1, 8)
    return qo, kv


def _plan(v, params, qo, kv, causal, block):
    q = torch.zeros(max(sum(qo), 1), HEADS, DIM, dtype=torch.float16)
    bound, sm_scale = _prepare(v, params, q, KV_HEADS, len(qo), None)
    ind = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)  # noqa: E731
    return load_triton_module(v).block_map(ind(qo), ind(kv), max(qo), max(kv), HEADS, HEADS // KV_HEADS, causal,
                                           kernel_arg_values(v, bound, sm_scale), block=block), bound


def map_errors(v, bound, plan, qo, kv, causal) -> list[str]:
    """Where the plan disagrees with every pair evaluated by the torch reference's evaluator."""
    bm, bn = plan.block
    heads = plan.kinds.shape[1]
    errors = []
    for b, (lq, lk) in enumerate(zip(qo, kv)):
        keep = keep_matrix(v.ir.mask, qo_len=lq, kv_len=lk, scalars=bound.scalars, tensors=bound.tensors,
                           num_qo_heads=HEADS, num_kv_heads=KV_HEADS, batch_idx=b, causal=causal)
        if heads == 1 and not torch.equal(keep.all(0), keep.any(0)):
            errors.append("one map stands for all heads, but the heads keep different pairs")
        for h in range(heads):
            head_keep = keep[h]
            for qt in range(plan.kinds.shape[2]):
                wanted = {2: [], 1: []}
                for kt in range(plan.kinds.shape[3]):
                    rows = head_keep[qt * bm:min((qt + 1) * bm, lq), kt * bn:min((kt + 1) * bn, lk)]
                    kind = (0 if rows.numel() == 0 or not rows.any() else
                            2 if rows.all() and (kt + 1) * bn <= lk else 1)
                    got = int(plan.kinds[b, h, qt, kt])
                    if got != kind:
                        errors.append(f"request {b} head {h} tile ({qt}, {kt}): kind {got}, pairs say {kind}")
                    if kind:
                        wanted[kind].append(kt)
                    if kind == 1 and got == 1:
                        slot = int(plan.slots[b, h, qt][(plan.tiles[b, h, qt] == kt).nonzero()[0, 0]])
                        words = plan.bits[slot][:rows.shape[0]]
                        bits = ((words[:, None] >> torch.arange(bn)) & 1).bool()
                        expect = torch.zeros(rows.shape[0], bn, dtype=torch.bool)
                        expect[:, :rows.shape[1]] = rows
                        if not torch.equal(bits, expect) or bool(plan.bits[slot][rows.shape[0]:].any()):
                            errors.append(f"request {b} head {h} tile ({qt}, {kt}): bits differ from the pairs")
                n_full, n_cut = plan.counts[b, h, qt].tolist()
                listed = plan.tiles[b, h, qt].tolist()
                if (n_full, n_cut) != (len(wanted[2]), len(wanted[1])) or \
                        sorted(listed[:n_full]) != wanted[2] or sorted(listed[n_full:n_full + n_cut]) != wanted[1]:
                    errors.append(f"request {b} head {h} query tile {qt}: lists {listed[:n_full + n_cut]} "
                                  f"({n_full} whole), pairs say whole {wanted[2]}, cut {wanted[1]}")
    return errors


@pytest.mark.parametrize("block", [(16, 16), (32, 64)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_block_map_matches_every_pair(name, causal, block):
    v, draw = _variant(name)
    for _ in range(2):  # fresh lengths and params each time
        qo, kv = _batch()
        params = draw(len(qo), max(kv))
        plan, bound = _plan(v, params, qo, kv, causal, block)
        assert map_errors(v, bound, plan, qo, kv, causal) == []


@pytest.mark.parametrize("corrupt", ["kind", "bit", "order", "count"])
def test_a_corrupted_map_fails_the_check(corrupt):
    v, draw = _variant("flagged")
    qo, kv = [40, 0, 33], [64, 20, 50]
    plan, bound = _plan(v, {"window": 6, "flags": torch.tensor([[0] * 10 + [1] + [0] * 53] * 3, dtype=torch.int32)},
                        qo, kv, False, (16, 16))
    assert map_errors(v, bound, plan, qo, kv, False) == []
    cut = (plan.kinds == 1).nonzero()[0].tolist()
    if corrupt == "kind":
        plan.kinds[tuple(cut)] = 2
    elif corrupt == "bit":
        plan.bits[0, 0] ^= 1 << 3
    elif corrupt == "order":
        row = plan.tiles[cut[0], cut[1], cut[2]]
        row[:] = row.flip(0)
    else:
        plan.counts[cut[0], cut[1], cut[2], 1] -= 1
    assert map_errors(v, bound, plan, qo, kv, False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_prefill_on_the_block_map_matches_the_reference(name, causal):
    v, draw = _variant(name)
    qo, kv = _batch()
    qo = [q or 5 for q in qo]  # the ragged reference takes every request with rows; empty ones are tested above
    params = draw(len(qo), max(kv))
    q = torch.randn(sum(qo), HEADS, DIM, dtype=torch.float16)
    k, vv = (torch.randn(sum(kv), KV_HEADS, DIM, dtype=torch.float16) for _ in range(2))
    ind = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)  # noqa: E731
    out = v.batch_prefill_ragged(q, k, vv, ind(qo), ind(kv), causal=causal, backend="triton", **params)
    ref = _ragged_reference(v, q, k, vv, qo, kv, causal, params)
    r = compare(v.name, f"causal={causal} {qo}/{kv}", out, ref, torch.float16)
    assert r.passed, r


def test_costly_masks_read_bits_and_cheap_ones_evaluate():
    """The choice per cut tile follows the mask's cost: an integer modulo or a gather by both indices reads the
    precomputed bits, a read of the key alone compared with a row's value evaluates the mask."""
    assert reads_mask_bits(_variant("dilated")[0]) and reads_mask_bits(_variant("block_table")[0])
    assert not reads_mask_bits(AttentionVariant(name="docs", mask=_documents,
                                                params={"doc": Tensor("int32", ("batch", "position"))}))


def _documents(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.doc[batch, q_idx] == params.doc[batch, kv_idx]


# --- the backward's tile lists (bwd_tile_lists of the training module): the same map at each kernel's tile ---------
def _tile_lists(v, params, qo, kv, causal):
    """The training module and its tile lists for these params, their args as a training step makes them (the
    training lowering's position tables included)."""
    from fivar.runtime import autograd
    q = torch.zeros(max(sum(qo), 1), HEADS, DIM, dtype=torch.float16)
    bound, sm_scale = _prepare(v, params, q, KV_HEADS, len(qo), None)
    ind = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)  # noqa: E731
    with autograd._training(v):
        module = autograd._module(v)
        trained = autograd._bound(v, [bound.tensors[n] for n in v.tensor_params],
                                  [bound.scalars[n] for n in v.scalar_params], (max(qo), max(kv)), (HEADS, KV_HEADS))
        args = kernel_arg_values(v, trained, sm_scale)
    return module, module.bwd_tile_lists(ind(qo), ind(kv), max(qo), max(kv), HEADS, HEADS // KV_HEADS, causal,
                                         args), bound


def tile_list_errors(v, bound, module, lists, qo, kv, causal) -> list[str]:
    """Where the backward's lists disagree with every pair: the dK/dV kernel's (per key tile, its query tiles) and
    the dQ kernel's (per query tile, its key tiles), each row its whole tiles (every pair kept, the tile inside its
    request's rows and keys) then its cut ones, in the order the kernels visit them; and each kernel's program order
    a permutation, the programs with the most tiles first."""
    errors = []
    group = HEADS // KV_HEADS
    keeps = [keep_matrix(v.ir.mask, qo_len=lq, kv_len=lk, scalars=bound.scalars, tensors=bound.tensors,
                         num_qo_heads=HEADS, num_kv_heads=KV_HEADS, batch_idx=b, causal=causal)
             for b, (lq, lk) in enumerate(zip(qo, kv))]
    for kernel, (bm, bn) in (("dkdv", module.DKDV_TILE), ("dq", module.DQ_TILE)):
        tiles, counts, order = (getattr(lists, f"{kernel}_{x}") for x in ("tiles", "counts", "order"))
        heads = tiles.shape[1]
        n_q, n_k = -(-max(qo) // bm), -(-max(kv) // bn)
        work = {}
        for b, (lq, lk) in enumerate(zip(qo, kv)):
            for h in range(heads):
                kind = {}
                for qt in range(n_q):
                    for kt in range(n_k):
                        pairs = keeps[b][h][qt * bm:min((qt + 1) * bm, lq), kt * bn:min((kt + 1) * bn, lk)]
                        inside = (qt + 1) * bm <= lq and (kt + 1) * bn <= lk
                        kind[qt, kt] = 0 if not pairs.any() else 2 if inside and pairs.all() else 1
                rows = ([(kt, [(qt, kt) for qt in reversed(range(n_q))]) for kt in range(n_k)] if kernel == "dkdv"
                        else [(qt, [(qt, kt) for kt in range(n_k)]) for qt in range(n_q)])
                for r, cells in rows:
                    want = [[c[0 if kernel == "dkdv" else 1] for c in cells if kind[c] == k] for k in (2, 1)]
                    n_whole, n_cut = counts[b, h, r].tolist()
                    listed = tiles[b, h, r].tolist()
                    if [listed[:n_whole], listed[n_whole:n_whole + n_cut]] != want:
                        errors.append(f"{kernel} request {b} head {h} row {r}: lists {listed[:n_whole + n_cut]} "
                                      f"({n_whole} whole), pairs say whole {want[0]}, cut {want[1]}")
                    work[b, h, r] = n_whole + n_cut
        if kernel == "dkdv":  # programs (request, key tile, KV head), the group's heads' tiles summed
            ids = [(b, r, g) for b in range(len(qo)) for r in range(n_k) for g in range(KV_HEADS)]
            cost = [sum(work[b, h if heads > 1 else 0, r] for h in range(g * group, g * group + group))
                    for b, r, g in ids]
        else:  # programs (request, query tile, query head)
            ids = [(b, r, h) for b in range(len(qo)) for r in range(n_q) for h in range(HEADS)]
            cost = [work[b, h if heads > 1 else 0, r] for b, r, h in ids]
        seq = order.tolist()
        if sorted(seq) != list(range(len(ids))):
            errors.append(f"{kernel} order is not a permutation of its {len(ids)} programs")
        elif any(cost[a] < cost[c] for a, c in zip(seq, seq[1:])):
            errors.append(f"{kernel} order does not put the programs with the most tiles first")
    return errors


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(MASKS))
def test_backward_tile_lists_match_every_pair(name, causal):
    v, draw = _variant(name)
    for _ in range(2):
        qo, kv = _batch()
        params = draw(len(qo), max(kv))
        module, lists, bound = _tile_lists(v, params, qo, kv, causal)
        assert tile_list_errors(v, bound, module, lists, qo, kv, causal) == []


@pytest.mark.parametrize("corrupt", ["whole", "order", "count", "programs"])
def test_corrupted_tile_lists_fail_the_check(corrupt):
    v, _ = _variant("frames")
    qo, kv = [70, 0, 37], [96, 20, 50]  # the last request's last query tile is short: never whole
    module, lists, bound = _tile_lists(v, {"frame": 20}, qo, kv, False)
    assert tile_list_errors(v, bound, module, lists, qo, kv, False) == []
    counts = lists.dq_counts.view(-1, 2)
    row = int(((counts[:, 0] > 0) & (counts[:, 1] > 0)).nonzero()[0])
    if corrupt == "whole":  # a cut tile run as whole
        counts[row, 0] += 1
        counts[row, 1] -= 1
    elif corrupt == "order":
        listed = lists.dkdv_tiles.view(-1, lists.dkdv_tiles.shape[-1])
        r = int((lists.dkdv_counts.view(-1, 2).sum(1) > 1).nonzero()[0])
        listed[r, :2] = listed[r, :2].flip(0)
    elif corrupt == "count":
        counts[row, 1] -= 1
    else:
        lists.dq_order[:] = lists.dq_order.flip(0).clone()  # the fewest tiles first
    assert tile_list_errors(v, bound, module, lists, qo, kv, False)
