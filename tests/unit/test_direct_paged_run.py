"""A planned paged run calls its module's paged_run directly (fivar.flashinfer_compat.wrappers.DirectPagedRun): it must hand the
module exactly what FlashInfer's own wrapper.run hands it, and step aside wherever the wrapper would do more.

The wrapper here is the installed FlashInfer's class with its planned state set by hand and a module that records
its calls, so both runs execute on the CPU with no kernel."""
import random

import pytest
import torch

from fivar.errors import FivarError
from fivar.flashinfer_compat import wrappers
from fivar.runtime.launch import direct_paged_run


class _Recorder:
    def __init__(self):
        self.calls = []

    def paged_run(self, *args):
        self.calls.append(args)


def _planned_wrapper(rng, *, owns_mask, causal, window_left, tensor_names, scalar_names, backend="fa2",
                     custom_mask=False, o_dtype=torch.bfloat16):
    from flashinfer import BatchPrefillWithPagedKVCacheWrapper
    w = BatchPrefillWithPagedKVCacheWrapper.__new__(BatchPrefillWithPagedKVCacheWrapper)
    batch = rng.randint(1, 5)
    pages = [rng.randint(1, 4) for _ in range(batch)]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    state = dict(
        _float_workspace_buffer=torch.empty(16, dtype=torch.uint8),
        _int_workspace_buffer=torch.empty(16, dtype=torch.uint8),
        _plan_info=[rng.randint(0, 99) for _ in range(5)], _qo_indptr_buf=i32(list(range(batch + 1))),
        _paged_kv_indptr_buf=i32([sum(pages[:b]) for b in range(batch + 1)]),
        _paged_kv_indices_buf=i32(rng.sample(range(64), sum(pages))),
        _paged_kv_last_page_len_buf=i32([rng.randint(1, 16) for _ in range(batch)]),
        _kv_layout="NHD", _backend=backend, _jit_module=object(), _cached_module=_Recorder(),
        _jit_additional_tensor_names=list(tensor_names), _jit_additional_scalar_names=list(scalar_names),
        _custom_mask_buf=torch.ones(4, dtype=torch.uint8) if custom_mask else None, _variant_owns_mask=owns_mask,
        _causal=causal, _window_left=window_left,
        _qo_indptr_last=batch, _cached_o_data_type=o_dtype, _cached_q_data_type=torch.bfloat16,
        _cached_kv_data_type=torch.bfloat16, _prefix_len_ptr=None, _eagle_verify_fp8kv_sm90_state=None,
        _logits_soft_cap=None, _sm_scale=None, _rope_scale=None, _rope_theta=None, _token_pos_in_items_ptr=None,
        _max_item_len_ptr=None, _mask_indptr_buf=None, _token_pos_in_items_len=0)
    for name, value in state.items():
        setattr(w, name, value)
    return w


def _same_call(direct, theirs):
    assert len(direct) == len(theirs)
    for i, (a, b) in enumerate(zip(direct, theirs)):
        if isinstance(b, torch.Tensor) and i in (10, 11):  # out and lse: fresh per call, alike in kind
            assert a is not b and a.shape == b.shape and a.dtype == b.dtype and a.device == b.device, i
        elif isinstance(b, torch.Tensor):
            assert a is b, i
        else:
            assert type(a) is type(b) and a == b, (i, a, b)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize("mask", ["owned", "custom buffer", "causal", "none"])
def test_direct_run_hands_the_module_what_the_wrappers_run_does(mask, backend, pdl, monkeypatch):
    import flashinfer.prefill
    import flashinfer.utils
    for module in (flashinfer.prefill, flashinfer.utils):  # both sides ask the device; the CPU would say False
        monkeypatch.setattr(module, "device_support_pdl", lambda device: pdl)
    rng = random.Random(f"{mask} {backend} {pdl}")
    names = [f"t{i}" for i in range(rng.randint(0, 2))]
    scalars = [f"s{i}" for i in range(rng.randint(1, 3))]
    w = _planned_wrapper(rng, owns_mask=mask == "owned", causal=mask == "causal", custom_mask=mask == "custom buffer",
                         window_left=rng.choice([-1, 7, 4096]), tensor_names=names, scalar_names=scalars,
                         backend=backend, o_dtype=rng.choice([torch.bfloat16, torch.float16]))
    args = [torch.randn(4) for _ in names] + [rng.choice([0.5, 3, 1e-3]) for _ in scalars]
    direct = direct_paged_run(w, "v", "cpu", args)
    assert direct is not None
    q = torch.randn(w._qo_indptr_last, 4, 64, dtype=torch.bfloat16)
    cache = torch.randn(64, 16, 2, 64, dtype=torch.bfloat16)
    for return_lse in (False, True):
        theirs = w.run(q, (cache, cache), *args, return_lse=return_lse)
        mine = direct(q, cache, cache, args, return_lse)
        _same_call(w._cached_module.calls[-1], w._cached_module.calls[-2])
        if return_lse:
            assert mine[1].shape == theirs[1].shape == (q.shape[0], 4) and mine[1].dtype == torch.float32
        else:
            assert mine.shape == theirs.shape and mine.dtype == theirs.dtype == w._cached_o_data_type
    with pytest.raises(FivarError, match="variant 'v'.*rows"):
        direct(q[:-1] if q.shape[0] > 1 else torch.cat([q, q]), cache, cache, args, False)


def test_the_wrappers_run_is_kept_where_it_does_more(monkeypatch):
    rng = random.Random(0)
    make = lambda **kw: _planned_wrapper(rng, owns_mask=True, causal=False, window_left=-1, **kw)  # noqa: E731
    plain = dict(tensor_names=["t"], scalar_names=["s"])
    assert direct_paged_run(make(**plain), "v", "cpu", [torch.ones(1), 1.0]) is not None
    # the wrapper would fill a known buffer in, or derive the scalars it was not given
    assert direct_paged_run(make(tensor_names=["maybe_alibi_slopes"], scalar_names=["s"]), "v", "cpu", [1.0]) is None
    assert direct_paged_run(make(**plain), "v", "cpu", [torch.ones(1)]) is None
    assert direct_paged_run(make(**plain, backend="cudnn"), "v", "cpu", [torch.ones(1), 1.0]) is None
    w = make(**plain)
    w._prefix_len_ptr = torch.zeros(1)
    assert direct_paged_run(w, "v", "cpu", [torch.ones(1), 1.0]) is None
    # a FlashInfer whose run calls the module otherwise turns the direct run off
    monkeypatch.setattr(wrappers, "PAGED_RUN_ARGS", wrappers.PAGED_RUN_ARGS.replace("out, lse", "lse, out"))
    wrappers.paged_run_problem.cache_clear()
    try:
        assert "other arguments" in wrappers.paged_run_problem()
        assert direct_paged_run(make(**plain), "v", "cpu", [torch.ones(1), 1.0]) is None
    finally:
        monkeypatch.undo()
        wrappers.paged_run_problem.cache_clear()
    # so does one that fills a module argument fivar does not know of
    monkeypatch.setattr(wrappers, "PAGED_RUN_FILLED", wrappers.PAGED_RUN_FILLED - {"maybe_k_cache_sf"})
    wrappers.paged_run_problem.cache_clear()
    try:
        assert "fills other module arguments" in wrappers.paged_run_problem()
    finally:
        monkeypatch.undo()
        wrappers.paged_run_problem.cache_clear()


def test_fixed_rows_take_q_of_that_many_rows_and_zero_the_rest():
    """rows= (a CUDA-graph plan's capacity): q of those rows whatever the plan's qo_indptr[-1], the buffers and plan
    handed on as without it, and the output and LSE start as zeros (no query tile writes the rows past the plan's)."""
    rng = random.Random(1)
    w = _planned_wrapper(rng, owns_mask=False, causal=False, window_left=-1, tensor_names=["t"], scalar_names=["s"])
    args = [torch.randn(3), 2.0]
    rows = w._qo_indptr_last + rng.randint(1, 9)
    direct = direct_paged_run(w, "v", "cpu", args, rows=rows)
    plain = direct_paged_run(w, "v", "cpu", args)
    q = torch.randn(rows, 4, 64, dtype=torch.bfloat16)
    cache = torch.randn(64, 16, 2, 64, dtype=torch.bfloat16)
    out, lse = direct(q, cache, cache, args, True)
    assert out.shape == q.shape and lse.shape == (rows, 4) and not out.any() and not lse.any()
    plain(q[:w._qo_indptr_last], cache, cache, args, True)
    fixed, planned = w._cached_module.calls[-2:]
    assert fixed[3] is q and len(fixed) == len(planned)
    for i, (a, b) in enumerate(zip(fixed, planned)):  # the rest as the plan's own rows have it
        if i not in (3, 10, 11):
            assert a is b if isinstance(b, torch.Tensor) else (type(a) is type(b) and a == b), i
    with pytest.raises(FivarError, match="variant 'v'.*rows"):
        direct(q[:w._qo_indptr_last], cache, cache, args, False)


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_run_into_given_rows_hands_the_module_those_tensors(return_lse):
    """into= (a part of a larger output, fivar.runtime.mixed): the module writes the given out and LSE themselves,
    nothing else changes in its call; a fixed-rows run (zeros past the plan's rows) keeps allocating its own."""
    rng = random.Random(2)
    w = _planned_wrapper(rng, owns_mask=False, causal=True, window_left=-1, tensor_names=["t"], scalar_names=["s"])
    args = [torch.randn(3), 2.0]
    direct = direct_paged_run(w, "v", "cpu", args)
    rows = w._qo_indptr_last
    q = torch.randn(rows, 4, 64, dtype=torch.bfloat16)
    cache = torch.randn(64, 16, 2, 64, dtype=torch.bfloat16)
    whole_out = torch.empty(rows + 5, 4, 64, dtype=torch.bfloat16)
    whole_lse = torch.empty(rows + 5, 4)
    into = (whole_out[3:3 + rows], whole_lse[3:3 + rows] if return_lse else None)
    got = direct(q, cache, cache, args, return_lse, into)
    direct(q, cache, cache, args, return_lse)
    given, plain = w._cached_module.calls[-2:]
    assert given[10] is into[0] and (given[11] is into[1] if return_lse else given[11] is None)
    assert (got[0] if return_lse else got) is into[0]
    for i, (a, b) in enumerate(zip(given, plain)):
        if i not in (10, 11):
            assert a is b or a == b, i
    fixed = direct_paged_run(w, "v", "cpu", args, rows=rows + 2)
    q2 = torch.randn(rows + 2, 4, 64, dtype=torch.bfloat16)
    out = fixed(q2, cache, cache, args, False, (torch.ones_like(q2), None))
    assert not out.any()
    # an `into` that is not contiguous (every other head of a wider output) is not handed on: FA2 assumes contiguity
    permuted = torch.empty(rows, 8, 64, dtype=torch.bfloat16)[:, ::2]
    got = direct(q, cache, cache, args, False, (permuted, None))
    assert got is not permuted and got.is_contiguous() and w._cached_module.calls[-1][10] is got
