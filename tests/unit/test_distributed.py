"""Context-parallel attention (fivar.distributed) on CPU ranks: gloo process groups of 2 and 4 spawned processes,
the Triton twin under the interpreter and the torch reference per pair, checked against the single-process float64
reference of the whole sequence (outputs, LSEs, gradients)."""
import gloo_group
import pytest
import torch
import torch.distributed as dist

import fivar
import fivar.testing
from fivar import AttentionVariant, FivarError, Scalar, Tensor, tanh
from fivar.codegen.torch_ref import reference_attention
from fivar.distributed import Sharding, all_gather_attention, ring_attention

STRATEGIES = {"ring": ring_attention, "all_gather": all_gather_attention}


def window_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


def prefix_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.prefix or kv_idx <= q_idx


def first_keys_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.first or q_idx - kv_idx < params.window


def table_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.keep[q_idx, kv_idx]


def alibi_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + params.slope[qo_head] * float(kv_idx - q_idx)


def distance_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score + 2.0 * tanh(float(kv_idx - q_idx) * 0.3)  # a costly term of the distance: a position table


def sigmoid_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score


WINDOW = AttentionVariant(name="cp_window", mask=window_mask, params={"window": Scalar(int)})
PREFIX = AttentionVariant(name="cp_prefix", mask=prefix_mask, params={"prefix": Scalar(int)})
FIRST_KEYS = AttentionVariant(name="cp_first_keys", mask=first_keys_mask,
                              params={"first": Scalar(int), "window": Scalar(int)})
TABLE = AttentionVariant(name="cp_table", mask=table_mask, params={"keep": Tensor("bool", ("position", "key"))})
ALIBI = AttentionVariant(name="cp_alibi", logits=alibi_logits,
                         params={"slope": Tensor("float32", ("qo_head",), learnable=True)})
ALIBI_FIRST_KEYS = AttentionVariant(name="cp_alibi_first_keys", logits=alibi_logits, mask=first_keys_mask,
                                    params={"slope": Tensor("float32", ("qo_head",), learnable=True),
                                            "first": Scalar(int), "window": Scalar(int)})
DISTANCE = AttentionVariant(name="cp_distance", logits=distance_logits)
SIGMOID = AttentionVariant(name="cp_sigmoid", logits=sigmoid_logits, softmax=False)


def cases(seq_len: int, heads: int, gen: torch.Generator):
    """(name, variant, causal, params) for every kind of mask, with fresh random params."""
    docs = fivar.testing.document_ids([5, 1, seq_len - 11, 5]).view(1, -1)
    return [
        ("causal window", WINDOW, True, {"window": 6}),
        ("documents", fivar.load("document_mask"), False, {"doc_ids": docs}),
        ("sinks + window", fivar.load("gpt_oss"), True,
         {"sinks": torch.randn(heads, generator=gen) + 1.0, "window": 7}),
        ("prefix", PREFIX, False, {"prefix": 4}),
        ("distance table", DISTANCE, True, {}),
        ("random", TABLE, False, {"keep": torch.rand(seq_len, seq_len, generator=gen) < 0.3}),
        ("first keys + window", FIRST_KEYS, True, {"first": 2, "window": 4}),
    ]


@pytest.fixture(scope="module")
def groups():
    """groups(world): this file's process group of `world` ranks (gloo_group.Group), started on first use (again
    after a failure)."""
    with gloo_group.Groups() as get:
        yield get


def qkv(seq_len, hq, hkv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return gen, [torch.randn(seq_len, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv)]


def reference(variant, q, k, v, causal, params):
    """The single-process float64 reference of the whole sequence: (out, lse)."""
    return reference_attention(variant, q, k, v, causal=causal, params=params, float_dtype=torch.float64,
                               return_lse=True)


def close(got, want, atol, what):
    """|got - want| <= atol * max(1, max |want|), and the same rows without keys (lse -inf)."""
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), f"{what}: rows without keys differ"
    finite = torch.isfinite(want)
    err, scale = (got.double() - want.double()).abs()[finite], want.double().abs()[finite]
    bound = atol * max(1.0, float(scale.max())) if scale.numel() else 0.0
    assert err.numel() == 0 or float(err.max()) <= bound, f"{what}: max error {float(err.max()):.3g} > {bound:.3g}"


def _triton_forward(rank, world):
    """Triton twin, fp16, uneven zigzag shards: every mask kind through the ring, two through the all-gather."""
    seq_len, hq, hkv, d = 29, 2, 1, 16
    gen, (q, k, v) = qkv(seq_len, hq, hkv, d, seed=1)
    sharding = Sharding.zigzag(seq_len, world)
    for name, variant, causal, params in cases(seq_len, hq, gen):
        ref, ref_lse = reference(variant, q, k, v, causal, params)
        for strategy in ("ring", "all_gather") if name in ("documents", "random") else ("ring",):
            shard = [sharding.shard(x, rank).half() for x in (q, k, v)]
            out, lse = STRATEGIES[strategy](variant, *shard, sharding, causal=causal, backend="triton",
                                            return_lse=True, **params)
            close(out, sharding.shard(ref, rank), 2e-3, f"{name}/{strategy} rank {rank} out")
            close(lse, sharding.shard(ref_lse, rank), 2e-3, f"{name}/{strategy} rank {rank} lse")


def test_triton_twin_matches_reference_on_two_ranks(groups):
    groups(2).run(_triton_forward)


def grads_of(fn, inputs, weights):
    """d(sum(out * w_out) + sum(lse * w_lse)) / d inputs, fn(*inputs) -> (out, lse)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out, lse = fn(*leaves)
    w_out, w_lse = weights
    loss = (out.double() * w_out).sum() + (torch.where(torch.isfinite(lse), lse.double(), 0) * w_lse).sum()
    return torch.autograd.grad(loss, leaves)


def _against_reference(rank, name, variant, causal, params, sharding, qkv_, weights):
    """Ring and all-gather on the reference backend per pair: this rank's output, LSE and gradients of q, k, v
    against the single-process float64 reference of the whole sequence."""
    q, k, v = qkv_
    mine = lambda x: sharding.shard(x, rank)  # noqa: E731
    ref = lambda q_, k_, v_: reference(variant, q_, k_, v_, causal, params)  # noqa: E731
    ref_out, ref_lse = ref(q, k, v)
    ref_grads = grads_of(ref, (q, k, v), weights)
    for strategy, fn in STRATEGIES.items():
        run = lambda q_, k_, v_: fn(variant, q_, k_, v_, sharding, causal=causal, backend="reference",  # noqa: E731
                                    return_lse=True, **params)
        out, lse = run(*map(mine, (q, k, v)))
        close(out, mine(ref_out), 2e-6, f"{name}/{strategy} rank {rank} out")
        close(lse, mine(ref_lse), 1e-5, f"{name}/{strategy} rank {rank} lse")
        got = grads_of(run, list(map(mine, (q, k, v))), tuple(map(mine, weights)))
        for g, want, what in zip(got, ref_grads, "qkv"):
            close(g, mine(want), 1e-5, f"{name}/{strategy} rank {rank} d{what}")
    return ref_out, ref_lse


def _four_ranks(rank, world):
    """A rank with no rows, uneven shards: forward and backward of every mask kind, ring and all-gather, on the
    float64 reference per pair; the skipped pairs are really empty; one Triton call over the empty rank too."""
    seq_len, hq, hkv, d = 31, 2, 1, 16
    gen, (q, k, v) = qkv(seq_len, hq, hkv, d, seed=2)
    sharding = Sharding.of_lengths([9, 0, 14, 8])
    assert sharding.length(1) == 0
    w_out = torch.randn(seq_len, hq, d, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(seq_len, hq, generator=gen, dtype=torch.float64)
    mine = lambda x: sharding.shard(x, rank)  # noqa: E731
    for name, variant, causal, params in cases(seq_len, hq, gen):
        ref_out, ref_lse = _against_reference(rank, name, variant, causal, params, sharding, (q, k, v), (w_out, w_lse))
        if name == "sinks + window":  # the Triton twin over the same shards, the empty rank among them
            out, lse = ring_attention(variant, *(mine(x).half() for x in (q, k, v)), sharding, causal=causal,
                                      backend="triton", return_lse=True, **params)
            close(out, mine(ref_out), 2e-3, f"{name}/triton rank {rank} out")
            close(lse, mine(ref_lse), 2e-3, f"{name}/triton rank {rank} lse")


def _skips_only_empty_pairs(rank, world):
    """Zigzag causal shards: the upper-triangle pairs are skipped, every skipped pair of every mask kind keeps no
    (query, key) pair when evaluated element by element, and a kept pair's trimmed rows and keys hold every one it
    keeps."""
    from fivar.distributed.core import Plan
    from fivar.spec.sparsity import keep_matrix
    seq_len, hq = 33, 2
    gen, (q, k, v) = qkv(seq_len, hq, 1, 16, seed=3)
    sharding = Sharding.zigzag(seq_len, world)
    skipped = 0
    for name, variant, causal, params in cases(seq_len, hq, gen):
        plan = Plan(variant, *(sharding.shard(x, rank) for x in (q, k, v)), sharding, causal=causal, sm_scale=None,
                    backend="reference", group=None, params=params, strategy="ring_attention")
        truth = keep_matrix(variant.ir.mask, qo_len=seq_len, kv_len=seq_len, scalars=plan.bound.scalars,
                            tensors=plan.bound.tensors, num_qo_heads=hq, causal=causal).any(0)
        for (i, owner, j), keep in plan.keep.items():
            qs, qe, _ = plan.q_runs[i]
            ks, ke = sharding.runs[owner][j]
            if not keep:
                skipped += 1
                assert not truth[qs:qe, ks:ke].any(), f"{name}: pair {(qs, qe)} x {(ks, ke)} skipped but keeps keys"
                continue
            (lo, hi), (a, b) = plan.rows[(i, owner, j)], plan.keys[(i, owner, j)]
            kept = truth[qs:qe, ks:ke].clone()
            kept[lo:hi, a - ks:b - ks] = False
            assert not kept.any(), f"{name}: pair {(qs, qe)} x {(ks, ke)} trimmed to rows {(lo, hi)} keys {(a, b)}"
        if name == "causal window":
            assert sum(not kept for kept in plan.keep.values()) >= world, f"{name}: causal pairs were not skipped"
    assert skipped > 0


def _four_ranks_and_skips(rank, world):
    from fivar.distributed import core
    core.ROW_BLOCK = core.KEY_BLOCK = 2  # pairs trim their rows and keys, transfers their slices
    _four_ranks(rank, world)
    _skips_only_empty_pairs(rank, world)


def test_four_ranks_with_an_empty_rank_and_skipped_pairs(groups):
    groups(4).run(_four_ranks_and_skips)  # one group of 4 processes: starting one costs seconds on a small machine


def _triton_backward(rank, world):
    """Ring backward through the Triton twin's own backward per pair: q, k, v and a learnable per-head slope (its
    gradient summed over the group) against the float64 reference."""
    seq_len, hq, hkv, d = 21, 2, 1, 16
    gen, (q, k, v) = qkv(seq_len, hq, hkv, d, seed=4)
    slope = torch.rand(hq, generator=gen) * 0.5
    sharding = Sharding.zigzag(seq_len, world)
    w_out = torch.randn(seq_len, hq, d, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(seq_len, hq, generator=gen, dtype=torch.float64)
    ref = lambda q_, k_, v_, s_: reference(ALIBI, q_, k_, v_, True, {"slope": s_})  # noqa: E731
    want = grads_of(ref, (q, k, v, slope), (w_out, w_lse))
    run = lambda q_, k_, v_, s_: ring_attention(  # noqa: E731
        ALIBI, q_, k_, v_, sharding, causal=True, backend="triton", return_lse=True, slope=s_)
    got = grads_of(run, [sharding.shard(x, rank).half() for x in (q, k, v)] + [slope],
                   (sharding.shard(w_out, rank), sharding.shard(w_lse, rank)))
    dslope = got[3].clone()
    dist.all_reduce(dslope)
    for g, w, what in zip(got[:3], want[:3], "qkv"):
        close(g, sharding.shard(w, rank), 2e-2, f"rank {rank} d{what}")
    close(dslope, want[3], 5e-2, f"rank {rank} dslope")
    # a random mask leaving some rows no key at all (lse -inf): their gradients are zeros, the others' as reference
    keep = torch.rand(seq_len, seq_len, generator=gen) < 0.25
    keep[3] = keep[seq_len - 2] = False
    ref = lambda q_, k_, v_: reference(TABLE, q_, k_, v_, True, {"keep": keep})  # noqa: E731
    want = grads_of(ref, (q, k, v), (w_out, w_lse))
    run = lambda q_, k_, v_: ring_attention(  # noqa: E731
        TABLE, q_, k_, v_, sharding, causal=True, backend="triton", return_lse=True, keep=keep)
    got = grads_of(run, [sharding.shard(x, rank).half() for x in (q, k, v)],
                   (sharding.shard(w_out, rank), sharding.shard(w_lse, rank)))
    for g, w, what in zip(got, want, "qkv"):
        assert torch.isfinite(g).all(), f"rank {rank} d{what} of the random mask is not finite"
        close(g, sharding.shard(w, rank), 2e-2, f"rank {rank} d{what} (random mask)")


def test_triton_ring_backward_on_two_ranks(groups):
    groups(2).run(_triton_backward)


def _bad_inputs(rank, world):
    sharding = Sharding.zigzag(8, world)
    q = k = v = torch.randn(sharding.length(rank) + 1, 1, 16)
    with pytest.raises(FivarError, match="rows, rank"):
        ring_attention(WINDOW, q, k, v, sharding, window=3, backend="reference")
    with pytest.raises(FivarError, match="sharding has 3 ranks"):
        ring_attention(WINDOW, q, k, v, Sharding.contiguous(8, 3), window=3, backend="reference")


def test_bad_inputs_are_one_line_errors(groups):
    groups(2).run(_bad_inputs)
    sharding = Sharding.zigzag(8, 2)
    q = torch.randn(4, 1, 16)
    with pytest.raises(FivarError, match="softmax=False"):
        ring_attention(SIGMOID, q, q, q, sharding)
    with pytest.raises(FivarError, match="init_process_group"):
        all_gather_attention(WINDOW, q, q, q, sharding, window=3)
    with pytest.raises(FivarError, match="held by 2 ranks"):
        Sharding(8, (((0, 5),), ((4, 8),)))


def test_zigzag_shards_round_trip():
    for seq_len, world in ((37, 4), (5, 4), (16, 2)):
        sharding = Sharding.zigzag(seq_len, world)
        x = torch.randn(seq_len, 3)
        assert torch.equal(sharding.unshard([sharding.shard(x, r) for r in range(world)]), x)
        if seq_len >= 2 * world:
            assert [run[0] for run in sharding.runs[0]] == [0, seq_len * (2 * world - 1) // (2 * world)]


def test_a_ranks_runs_that_follow_each_other_are_one_run():
    """Runs adjacent in position and in storage join (one kernel call a pair): zigzag's middle chunks on 2 ranks,
    and a user's sharding; rows stored as before (shard / unshard round trip); runs out of order stay apart."""
    zig = Sharding.zigzag(16, 2)
    assert zig.runs == (((0, 4), (12, 16)), ((4, 12),))
    for runs in ((((0, 3), (3, 5), (9, 12)), ((5, 9),)), (((3, 5), (0, 3)), ((5, 12),))):
        sharding = Sharding(12, runs)
        x = torch.randn(12, 2)
        parts = [torch.cat([x[s:e] for s, e in rank_runs]) for rank_runs in runs]  # stored as given
        assert all(torch.equal(sharding.shard(x, r), parts[r]) for r in range(2))
        assert torch.equal(sharding.unshard(parts), x)
        joined = [[(s, e) for s, e in r] for r in sharding.runs]
        assert all(a[1] != b[0] for r in joined for a, b in zip(r, r[1:]))  # nothing left to join
    assert Sharding(12, runs).runs[0] == ((3, 5), (0, 3))  # in storage order 3..5 then 0..3: not one run


def _transfer_order(rank, world):
    """Every ring transfer is posted before the compute it overlaps and waited for after it: the next step's key/value
    slices in the forward and the backward, and in the backward a step's gradients on their way back to their owner
    (with those arriving for this rank's own slices), posted after the step's compute and waited for after the next
    step's. Recorded through wrappers of batch_isend_irecv, the requests'
    wait and the per-pair compute, with results still the reference's."""
    import fivar.distributed.ring as ring
    from fivar.distributed.core import Plan
    events = []
    real_batch, real_pair = dist.batch_isend_irecv, Plan.pair

    class Request:
        def __init__(self, req, n):
            self.req, self.n = req, n

        def wait(self):
            if events[-1] != ("wait", self.n):  # one event for the pair of requests of one exchange
                events.append(("wait", self.n))
            return self.req.wait()

    def batch(ops):
        n = sum(e[0] == "post" for e in events)
        events.append(("post", n))
        return [Request(r, n) for r in real_batch(ops)]

    def pair(self, q, k, v, q_start, kv_start, **kw):
        owner = next(o for o, runs in enumerate(self.sharding.runs) if any(s <= kv_start < e for s, e in runs))
        if events[-1] != ("compute", owner):
            events.append(("compute", owner))
        return real_pair(self, q, k, v, q_start, kv_start, **kw)

    seq_len, hq, hkv, d = 4 * world + 3, 2, 1, 16
    gen, (q, k, v) = qkv(seq_len, hq, hkv, d, seed=5)
    sharding = Sharding.zigzag(seq_len, world)
    w_out = torch.randn(seq_len, hq, d, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(seq_len, hq, generator=gen, dtype=torch.float64)
    ref = lambda q_, k_, v_: reference(DISTANCE, q_, k_, v_, False, {})  # noqa: E731
    want = grads_of(ref, (q, k, v), (w_out, w_lse))
    ring.dist.batch_isend_irecv, Plan.pair = batch, pair
    try:
        events.append(("start", None))
        run = lambda q_, k_, v_: ring_attention(DISTANCE, q_, k_, v_, sharding, backend="reference",  # noqa: E731
                                                return_lse=True)
        got = grads_of(run, [sharding.shard(x, rank) for x in (q, k, v)], (sharding.shard(w_out, rank),
                                                                           sharding.shard(w_lse, rank)))
    finally:
        ring.dist.batch_isend_irecv, Plan.pair = real_batch, real_pair
    for g, w, what in zip(got, want, "qkv"):
        close(g, sharding.shard(w, rank), 1e-5, f"rank {rank} d{what}")
    owners = [(rank - s) % world for s in range(world)]
    fwd = []  # kv_s is exchange s
    for s, o in enumerate(owners):
        fwd += ([("post", s)] if s < world - 1 else []) + [("compute", o)] + ([("wait", s)] if s < world - 1 else [])
    bwd, n, grads = [], world - 1, None  # in the backward the exchanges are numbered in posting order
    for s, o in enumerate(owners):
        kv = None
        if s < world - 1:
            kv, n = n, n + 1
            bwd.append(("post", kv))
        bwd.append(("compute", o))
        if grads is not None:
            bwd.append(("wait", grads))
        grads = None
        if s:  # the own shard's gradients stay here
            grads, n = n, n + 1
            bwd.append(("post", grads))
        if kv is not None:
            bwd.append(("wait", kv))
    bwd.append(("wait", grads))
    assert events[1:] == fwd + bwd, f"rank {rank}: {events[1:]}"


@pytest.mark.parametrize("world", [2, 3])
def test_ring_posts_each_transfer_before_the_compute_it_overlaps(groups, world):
    groups(world).run(_transfer_order)


def _classified_once_per_layout(rank, world):
    import fivar.spec.sparsity as sparsity
    calls = []
    plain = sparsity.classify_bounds

    def counted(*a, **k):
        calls.append(1)
        return plain(*a, **k)
    sparsity.classify_bounds = counted
    try:
        seq_len = 24
        docs = fivar.testing.document_ids([7, 9, 8]).view(1, -1)
        sharding = Sharding.zigzag(seq_len, world)
        gen = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(seq_len, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
        mine = [sharding.shard(x, rank) for x in (q, k, v)]
        variant = fivar.load("document_mask")
        runs = []
        for _ in range(2):
            runs.append(ring_attention(variant, *mine, sharding, causal=True, backend="reference", doc_ids=docs))
        assert len(calls) == 1, calls  # the second call reuses the first call's pairs
        assert torch.equal(runs[0], runs[1])
        docs[0, 9:] = docs[0, 9:] + 1  # an in-place write: the documents changed, so must the pairs
        ring_attention(variant, *mine, sharding, causal=True, backend="reference", doc_ids=docs)
        assert len(calls) == 2, calls
        ring_attention(variant, *mine, sharding, causal=False, backend="reference", doc_ids=docs)
        assert len(calls) == 3, calls  # another call layout
    finally:
        sparsity.classify_bounds = plain


def test_the_kept_pairs_are_classified_once_per_call_layout(groups):
    groups(2).run(_classified_once_per_layout)


def test_pair_causality_matches_global_causal_positions():
    """Random (query run, key run) pairs: NOT_CAUSAL only where every key is at or before every query, KERNEL_CAUSAL
    only where the kernels' bottom-right aligned causal square (local j <= i + kv_len - qo_len) is exactly
    kv <= q on global positions; the runs of one sharding never need MASK_CAUSAL."""
    from fivar.distributed.positions import KERNEL_CAUSAL, MASK_CAUSAL, NOT_CAUSAL, pair_causality
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    seen = set()
    for n in range(400):
        qs, ks = (int(x) for x in torch.randint(0, 40, (2,), generator=gen))
        ql, kl = (int(x) for x in torch.randint(1, 20, (2,), generator=gen))
        if n % 4 == 0:  # runs ending together (where the kernels' causal square can hold), a few times in every draw
            ks = max(0, qs + ql - kl)
        qpos, kpos = torch.arange(qs, qs + ql), torch.arange(ks, ks + kl)
        truth = kpos.view(1, -1) <= qpos.view(-1, 1)
        how = pair_causality(True, qs, ql, ks, kl)
        seen.add(how)
        if how == NOT_CAUSAL:
            assert truth.all()
        elif how == KERNEL_CAUSAL:
            local = torch.arange(kl).view(1, -1) <= torch.arange(ql).view(-1, 1) + kl - ql
            assert torch.equal(local, truth)
        else:
            assert not truth.all()
        assert pair_causality(False, qs, ql, ks, kl) == NOT_CAUSAL
    assert seen == {NOT_CAUSAL, KERNEL_CAUSAL, MASK_CAUSAL}
    for sharding in (Sharding.zigzag(37, 4), Sharding.of_lengths([9, 0, 14, 8]), Sharding.contiguous(20, 3)):
        runs = [r for rank in sharding.runs for r in rank]
        assert all(pair_causality(True, a, b - a, c, d - c) != MASK_CAUSAL for a, b in runs for c, d in runs if c < b)


def _rank_work(sharding, keep) -> list[int]:
    """Each rank's kept (query, key) pairs, counted element by element."""
    return [sum(int(keep[s:e].sum()) for s, e in runs) for runs in sharding.runs]


def _lockstep(sharding, keep) -> int:
    """The ring in lockstep, element by element: the sum over steps of the busiest rank's kept pairs against the
    keys of the rank `step` before it."""
    rows = [torch.cat([torch.arange(s, e) for s, e in runs] or [torch.zeros(0, dtype=torch.long)])
            for runs in sharding.runs]
    world = len(rows)
    pair = [[int(keep[rows[r]][:, rows[o]].sum()) for o in range(world)] for r in range(world)]
    return sum(max(pair[r][(r - k) % world] for r in range(world)) for k in range(world))


def test_balanced_sharding_evens_the_work_of_uneven_documents():
    """Documents of fresh random uneven lengths, causal: `balanced` is a valid sharding whose busiest rank keeps
    about as many pairs as zigzag's busiest or fewer (brute force over all pairs; the choice is made on 128 blocks,
    hence the slack), close to an even share; plain causal keeps zigzag, and a window, whose work stays by the
    diagonal, gets one run a rank, as balanced, its ring in lockstep about as short as zigzag's."""
    from fivar.spec.sparsity import keep_matrix
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    variant, seq_len = fivar.load("document_mask"), 1536
    for world in (2, 3):
        for _ in range(3):
            big = int(torch.randint(seq_len // 2, seq_len - 40, (), generator=gen))
            rest = torch.randint(1, 8, (6,), generator=gen).double()
            small = [max(1, int(x)) for x in (rest / rest.sum() * (seq_len - big)).floor()]
            lengths = [*small, big]
            lengths[-1] += seq_len - sum(lengths)
            params = {"doc_ids": fivar.testing.document_ids(lengths).view(1, -1)}
            sharding = Sharding.balanced(variant, seq_len, world, causal=True, blocks=128, **params)
            assert sorted(p for runs in sharding.runs for r in runs for p in range(*r)) == list(range(seq_len))
            keep = keep_matrix(variant.ir.mask, qo_len=seq_len, kv_len=seq_len, scalars={},
                               tensors=params, num_qo_heads=1, causal=True).any(0)
            zigzag = Sharding.zigzag(seq_len, world)
            got, zig = _rank_work(sharding, keep), _rank_work(zigzag, keep)
            assert max(got) <= 1.05 * max(zig), (lengths, got, zig)
            assert max(got) <= 1.15 * sum(got) / world, (lengths, got)
    assert Sharding.balanced(fivar.load("softcap"), 999, 3, causal=True) == Sharding.zigzag(999, 3)
    window = Sharding.balanced(WINDOW, 999, 3, causal=True, window=16)
    assert [len(runs) for runs in window.runs] == [1, 1, 1]
    keep = keep_matrix(WINDOW.ir.mask, qo_len=999, kv_len=999, scalars={"window": 16}, tensors={}, num_qo_heads=1,
                       causal=True).any(0)
    assert max(_rank_work(window, keep)) <= 1.05 * sum(_rank_work(window, keep)) / 3
    assert _lockstep(window, keep) <= 1.05 * _lockstep(Sharding.zigzag(999, 3), keep)


def _trimmed_rows(rank, world):
    """Row and key blocks of 3: pairs run only the query rows that keep any of their keys and the keys those rows
    keep (trimmed, in pieces apart from each other, the keys at their global positions), states merge over those
    rows alone; outputs, LSEs and gradients (a learnable slope's summed over the group too) still equal the float64
    reference, ring and all-gather, reference and Triton per pair."""
    from fivar.distributed import core
    core.ROW_BLOCK = core.KEY_BLOCK = 3
    core.MIN_GAP = 1  # another rank's keys travel in pieces wherever a kept block is apart from the next
    seq_len, hq, hkv, d = 40, 2, 1, 16
    gen, (q, k, v) = qkv(seq_len, hq, hkv, d, seed=7)
    sharding = Sharding.zigzag(seq_len, world)
    w_out = torch.randn(seq_len, hq, d, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(seq_len, hq, generator=gen, dtype=torch.float64)
    mine = lambda x: sharding.shard(x, rank)  # noqa: E731
    trimmed = keys_trimmed = split = 0
    for name, variant, causal, params in cases(seq_len, hq, gen):
        plan = core.Plan(variant, *map(mine, (q, k, v)), sharding, causal=causal, sm_scale=None, backend="reference",
                         group=None, params=params, strategy="ring_attention")
        trimmed += sum(r is not None and r != (0, plan.q_runs[i][1] - plan.q_runs[i][0])
                       for (i, _, _), r in plan.rows.items())
        keys_trimmed += sum(r is not None and r != sharding.runs[o][j] for (_, o, j), r in plan.keys.items())
        split += sum(len(p) > 1 for p in plan.pieces.values())
        ref_out, ref_lse = _against_reference(rank, name, variant, causal, params, sharding, (q, k, v), (w_out, w_lse))
        if name in ("causal window", "random", "first keys + window"):
            out, lse = ring_attention(variant, *(mine(x).half() for x in (q, k, v)), sharding, causal=causal,
                                      backend="triton", return_lse=True, **params)
            close(out, mine(ref_out), 2e-3, f"{name}/triton rank {rank} out")
            close(lse, mine(ref_lse), 2e-3, f"{name}/triton rank {rank} lse")
    # a learnable slope over trimmed pieces: its gradient, summed over the group, is the reference's
    slope = torch.rand(hq, generator=gen) * 0.5
    ref = lambda q_, k_, v_, s_: reference(ALIBI_FIRST_KEYS, q_, k_, v_, True,  # noqa: E731
                                           {"slope": s_, "first": 2, "window": 4})
    want = grads_of(ref, (q, k, v, slope), (w_out, w_lse))
    for strategy, fn in STRATEGIES.items():
        run = lambda q_, k_, v_, s_: fn(ALIBI_FIRST_KEYS, q_, k_, v_, sharding, causal=True,  # noqa: E731
                                        backend="reference", return_lse=True, slope=s_, first=2, window=4)
        got = grads_of(run, [mine(x) for x in (q, k, v)] + [slope], (mine(w_out), mine(w_lse)))
        dslope = got[3].clone()
        dist.all_reduce(dslope)
        for g, w, what in zip(got[:3], want[:3], "qkv"):
            close(g, mine(w), 1e-5, f"alibi + first keys/{strategy} rank {rank} d{what}")
        close(dslope, want[3], 1e-5, f"alibi + first keys/{strategy} rank {rank} dslope")
    counts = torch.tensor([trimmed, keys_trimmed, split])
    dist.all_reduce(counts)  # over the group: rank 1 alone gets the first keys and the window apart
    assert bool((counts > 0).all()), counts


def test_pairs_run_only_the_rows_that_keep_their_keys(groups):
    groups(2).run(_trimmed_rows)


class Recorder:
    """What this rank's strategies hand torch.distributed to send: every isend of a batch_isend_irecv and every
    all_to_all_single's input cut per destination, as {destination: [tensors]} in sending order."""

    def __init__(self):
        self.sent = {}

    def __enter__(self):
        self.batch, self.a2a = dist.batch_isend_irecv, dist.all_to_all_single

        def batch(ops):
            for op in ops:
                if op.op is dist.isend:
                    self.sent.setdefault(op.peer, []).append(op.tensor.clone())
            return self.batch(ops)

        def a2a(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
            at = 0
            for peer, n in enumerate(input_split_sizes):
                if n:
                    self.sent.setdefault(peer, []).append(input[at:at + n].clone())
                at += n
            return self.a2a(output, input, output_split_sizes, input_split_sizes, **kw)
        dist.batch_isend_irecv, dist.all_to_all_single = batch, a2a
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv, dist.all_to_all_single = self.batch, self.a2a

    def keys(self, strategy: str, peer: int, hkv: int, d: int):
        """(k, v) this rank sent `peer`: the ring sends k and v of each slice in turn, the all-to-all one flat
        [2, rows, Hkv, D] part per destination."""
        parts = self.sent.get(peer, [])
        if strategy == "ring":
            none = [torch.empty(0, hkv, d)]
            return torch.cat(parts[0::2] or none), torch.cat(parts[1::2] or none)
        flat = torch.cat(parts or [torch.empty(0)]).view(2, -1, hkv, d)
        return flat[0], flat[1]


def kept_slices(sharding, truth, receiver: int, owner: int, min_gap: int = 1) -> list[tuple[int, int]]:
    """Brute force: per run of the owner, the runs of consecutive keys that any of the receiver's rows keeps
    (truth [position, key], causal included), runs less than min_gap keys apart as one."""
    rows = torch.tensor([p for s, e in sharding.runs[receiver] for p in range(s, e)], dtype=torch.int64)
    out = []
    for s, e in sharding.runs[owner]:
        kept = truth[rows][:, s:e].any(0).nonzero().view(-1).tolist() if rows.numel() else []
        pieces = []
        for key in kept:
            if pieces and s + key - pieces[-1][1] < min_gap:
                pieces[-1][1] = s + key + 1
            else:
                pieces.append([s + key, s + key + 1])
        out += [tuple(p) for p in pieces]
    return out


def _sent_keys(rank, world):
    """Blocks of one row and key, pieces as apart as they are: each rank sends each other rank exactly the keys and
    values of the runs of consecutive keys (per run of its shard) that the receiver's rows keep, counted element by
    element against the brute force and compared value by value, ring and all-to-all, nothing where a pair keeps
    none; the gradients going back are as many rows; outputs, LSEs and gradients still equal the float64 reference.
    Pieces closer than MIN_GAP travel as one. A transfer shifted by one row (a mutated plan) fails the
    comparison."""
    from fivar.distributed import core
    from fivar.spec.sparsity import keep_matrix
    core.ROW_BLOCK = core.KEY_BLOCK = core.MIN_GAP = 1  # every run of kept keys a piece of its own
    core.MAX_PIECES = 1 << 20
    seq_len, hq, hkv, d = (29, 2, 1, 16) if world == 2 else (31, 2, 1, 16)
    sharding = Sharding.zigzag(seq_len, world) if world == 2 else Sharding.of_lengths([9, 0, 14, 8])
    gen, (q, k, v) = qkv(seq_len, hq, hkv, d, seed=11 + world)
    w_out = torch.randn(seq_len, hq, d, generator=gen, dtype=torch.float64)
    w_lse = torch.randn(seq_len, hq, generator=gen, dtype=torch.float64)
    mine = lambda x: sharding.shard(x, rank)  # noqa: E731
    chosen = ("causal window", "documents", "random", "first keys + window")
    checked = partial = split = 0

    def check(rec, strategy, truth, what):
        for peer in range(world):
            if peer == rank:
                continue
            want = kept_slices(sharding, truth, peer, rank, core.MIN_GAP)
            got_k, got_v = rec.keys(strategy, peer, hkv, d)
            n = sum(e - s for s, e in want)
            assert got_k.numel() + got_v.numel() == 2 * n * hkv * d, \
                f"{what}: {got_k.shape[0]} rows sent to rank {peer}, its rows keep {n} ({want})"
            for got, full in ((got_k, k), (got_v, v)):
                assert torch.equal(got, torch.cat([full[s:e] for s, e in want] or [full[:0]])), \
                    f"{what}: the rows sent to rank {peer} are not {want}"
    for name, variant, causal, params in cases(seq_len, hq, gen):
        if name not in chosen:
            continue
        truth = keep_matrix(variant.ir.mask, qo_len=seq_len, kv_len=seq_len,
                            scalars={n: x for n, x in params.items() if not isinstance(x, torch.Tensor)},
                            tensors={n: x for n, x in params.items() if isinstance(x, torch.Tensor)},
                            num_qo_heads=hq, causal=causal).any(0)
        _against_reference(rank, name, variant, causal, params, sharding, (q, k, v), (w_out, w_lse))
        for strategy, fn in STRATEGIES.items():
            call = lambda q_, k_, v_: fn(variant, q_, k_, v_, sharding, causal=causal,  # noqa: E731
                                         backend="reference", return_lse=True, **params)
            with Recorder() as rec, torch.no_grad():
                call(*map(mine, (q, k, v)))
            check(rec, strategy, truth, f"{name}/{strategy} rank {rank}")
            with Recorder() as rec:
                grads_of(call, list(map(mine, (q, k, v))), tuple(map(mine, (w_out, w_lse))))
            for owner in range(world):  # the gradients of what this rank got go back to its owner, as many rows
                back = sum(t.numel() for t in rec.sent.get(owner, []) if t.dtype == torch.float32)
                n = sum(e - s for s, e in kept_slices(sharding, truth, rank, owner)) if owner != rank else 0
                assert back == 2 * n * hkv * d, f"{name}/{strategy} rank {rank}: {back} gradients to rank {owner}"
            checked += 1
        for peer in range(world):
            want = kept_slices(sharding, truth, peer, rank) if peer != rank else []
            partial += 0 < sum(e - s for s, e in want) < sharding.length(rank)
            split += len(want) > len({next(j for j, (s, e) in enumerate(sharding.runs[rank]) if s <= a < e)
                                      for a, _ in want})
    assert checked == 2 * len(chosen)
    if world == 2 and rank == 0:
        assert split, "no transfer in pieces: the first keys and the window's keys of one run should be two"
    if world == 2:  # pieces closer than MIN_GAP travel as one
        core.MIN_GAP = 3
        name, variant, causal, params = next(c for c in cases(seq_len, hq, gen) if c[0] == "first keys + window")
        truth = keep_matrix(variant.ir.mask, qo_len=seq_len, kv_len=seq_len, scalars=params, num_qo_heads=hq,
                            causal=causal).any(0)
        for strategy, fn in STRATEGIES.items():
            with Recorder() as rec, torch.no_grad():
                out = fn(variant, *map(mine, (q, k, v)), sharding, causal=causal, backend="reference", **params)
            check(rec, strategy, truth, f"{name}/{strategy} min gap 3 rank {rank}")
            close(out, mine(reference(variant, q, k, v, causal, params)[0]), 2e-6, f"{name}/{strategy} min gap 3")
        core.MIN_GAP = 1
    if world == 2:  # a slice shifted by one row: the same count, other keys; the comparison must see it
        assert partial, f"rank {rank} sends no partial shard to shift"
        name, variant, causal, params = next(c for c in cases(seq_len, hq, gen) if c[0] == "causal window")
        truth = keep_matrix(variant.ir.mask, qo_len=seq_len, kv_len=seq_len, scalars=params, num_qo_heads=hq,
                            causal=causal).any(0)
        real = core.Plan.transfer

        def shifted(self, receiver, owner):
            n = self.sharding.length(owner)
            return [(a - 1, b - 1) if a > 0 else (a + 1, b + 1) if b < n else (a, b)
                    for a, b in real(self, receiver, owner)]
        core.Plan.transfer = shifted
        try:
            for strategy, fn in STRATEGIES.items():
                with Recorder() as rec, torch.no_grad():
                    fn(variant, *map(mine, (q, k, v)), sharding, causal=causal, backend="reference", **params)
                with pytest.raises(AssertionError, match="are not"):
                    check(rec, strategy, truth, f"mutated {strategy}")
        finally:
            core.Plan.transfer = real


@pytest.mark.parametrize("world", [2, 4])
def test_transfers_carry_only_the_keys_the_receiver_keeps(groups, world):
    groups(world).run(_sent_keys)


def test_pieces_merge_when_close_and_stay_few():
    """Fresh random key ranges: `split` covers every key of them and none past their ends, its pieces at least
    MIN_GAP apart and at most MAX_PIECES; below that many, exactly the runs of covered keys merged across gaps
    under MIN_GAP (brute force over the keys)."""
    from fivar.distributed import core
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))
    saved = core.MIN_GAP, core.MAX_PIECES
    try:
        for _ in range(300):
            n = int(torch.randint(1, 12, (), generator=gen))
            ranges = [(s, s + int(torch.randint(1, 20, (), generator=gen)))
                      for s in torch.randint(0, 200, (n,), generator=gen).tolist()]
            core.MIN_GAP, core.MAX_PIECES = (int(x) for x in (torch.randint(1, 30, (), generator=gen),
                                                                 torch.randint(1, 5, (), generator=gen)))
            got = core.split(ranges)
            covered = sorted({p for s, e in ranges for p in range(s, e)})
            assert set(covered) <= {p for s, e in got for p in range(s, e)}, (ranges, got)
            assert len(got) <= core.MAX_PIECES and all(a < b for a, b in got), (ranges, got)
            assert all(got[x + 1][0] - got[x][1] >= core.MIN_GAP for x in range(len(got) - 1)), (ranges, got)
            assert all(a in {s for s, _ in ranges} and b in {e for _, e in ranges} for a, b in got), (ranges, got)
            runs = []
            for p in covered:
                if runs and p - runs[-1][1] < core.MIN_GAP:
                    runs[-1][1] = p + 1
                else:
                    runs.append([p, p + 1])
            if len(runs) <= core.MAX_PIECES:
                assert got == [tuple(r) for r in runs], (ranges, got)
    finally:
        core.MIN_GAP, core.MAX_PIECES = saved


@pytest.mark.parametrize("seed", range(6))
def test_query_gradients_sum_each_rows_pairs_and_zero_rows_of_none(seed):
    """SpanSum (dq's, `query_grads`) against brute force, fresh random runs and pairs: a row's dq is the sum of the
    gradients of the pairs that compute it, zero where none does; float32 only over the span of rows that two pairs
    or more share. (The own shard's dK/dV, KeyGrads, are the same sums: the gloo tests' k/v gradients.)"""
    from types import SimpleNamespace

    from fivar.distributed.core import query_grads
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 40, (3,), generator=gen)]
    q_runs, at = [], 0
    for n in lengths:
        q_runs.append((1000 + at, 1000 + at + n, at))
        at += n
    pairs = {o: [] for o in range(2)}
    for i, (_, _, start) in enumerate(q_runs):
        for _ in range(int(torch.randint(0, 4, (), generator=gen))):
            lo = int(torch.randint(0, lengths[i], (), generator=gen))
            hi = lo + 1 + int(torch.randint(0, lengths[i] - lo, (), generator=gen))
            pairs[int(torch.randint(0, 2, (), generator=gen))].append((i, slice(start + lo, start + hi)))
    plan = SimpleNamespace(world=2, q_runs=q_runs, pairs_with=lambda o: [(i, r, 0, None, 0) for i, r in pairs[o]])
    q = torch.randn(at, 2, 4, dtype=torch.bfloat16, generator=gen)
    dq, want = query_grads(plan, q), torch.zeros(at, 2, 4, dtype=torch.float64)
    for o in range(2):
        for i, rows in pairs[o]:
            g = torch.randn(rows.stop - rows.start, 2, 4, generator=gen).to(torch.bfloat16)
            dq.add(rows, g)
            want[rows] += g.double()
    got = dq.result()
    assert got.dtype == q.dtype and torch.allclose(got.double(), want, atol=2e-2, rtol=1e-2)
    for i, (_, _, start) in enumerate(q_runs):  # float32 over exactly the span of rows two pairs share
        count = torch.zeros(at, dtype=torch.int64)
        for o in range(2):
            for j, r in pairs[o]:
                count[r] += j == i
        both = torch.nonzero(count >= 2).flatten()
        mine = [(lo, lo + acc.shape[0]) for lo, acc in dq.shared if start <= lo < start + lengths[i]]
        assert mine == ([(int(both[0]), int(both[-1]) + 1)] if both.numel() else [])
