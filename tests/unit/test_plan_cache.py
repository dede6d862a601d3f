"""The one-shot calls' plan cache (fivar.runtime.plan_cache): a plan is reused only for the same key, and a tensor
changed in place, replaced, or freed is never served a plan made from its old contents."""
import gc

import pytest
import torch

import fivar
from fivar.runtime import attention
from fivar.runtime.plan_cache import Hashed, PlanCache, value_key


def _make_counter():
    made = []

    def make():
        made.append(object())
        return made[-1]
    return made, make


def test_same_key_is_one_plan_and_in_place_writes_replan():
    cache = PlanCache()
    made, make = _make_counter()
    indptr = torch.tensor([0, 5, 9], dtype=torch.int32)
    doc = torch.zeros(2, 9, dtype=torch.int32)
    parts = lambda: ("ragged", "v", True, 0.5, {"doc": doc, "w": 4}, indptr)  # noqa: E731
    first = cache.get(parts(), make)
    assert cache.get(parts(), make) is first and len(made) == 1
    doc[0, 3] = 1  # a tensor param changed in place: its version moves
    second = cache.get(parts(), make)
    assert second is not first and len(made) == 2
    indptr[1] = 4  # an indptr changed in place
    assert cache.get(parts(), make) is not second and len(made) == 3
    assert cache.get(("ragged", "v", True, 0.5, {"doc": doc, "w": 5}, indptr), make) is made[-1] and len(made) == 4
    assert cache.get(("ragged", "v", False, 0.5, {"doc": doc, "w": 5}, indptr), make) is made[-1] and len(made) == 5


def test_equal_contents_in_a_new_tensor_replan_and_freed_tensors_drop_their_plans():
    cache = PlanCache()
    made, make = _make_counter()
    a = torch.tensor([0, 3], dtype=torch.int32)
    cache.get(("x", a), make)
    b = a.clone()
    cache.get(("x", b), make)  # identity, not contents: a new tensor is a new key
    assert len(made) == 2 and len(cache) == 2
    del a
    gc.collect()
    c = torch.tensor([0, 3], dtype=torch.int32)
    cache.get(("x", c), make)  # whatever id c got, the plan keyed on the dead tensor is never served
    assert len(made) == 3


def test_keys_keep_numbers_of_other_types_and_other_shapes_apart():
    """1, 1.0 and True are different params (a float's plan is not an int's); a data tensor's shape, stride and
    dtype are part of the key (fivar.runtime.attention._shapes); a dict's order is not."""
    keys = {value_key(("x", 1)), value_key(("x", 1.0)), value_key(("x", True))}
    assert len(keys) == 3
    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    shapes = lambda t: Hashed((t.shape, t.stride(), t.dtype, t.device))  # noqa: E731
    assert value_key(shapes(a)) != value_key(shapes(b)) != value_key(shapes(b.t()))
    assert value_key(shapes(a)) != value_key(shapes(a.half()))
    assert value_key({"w": 3, "s": 2.0}) == value_key({"s": 2.0, "w": 3}) != value_key({"s": 2.0, "w": 4})


def test_data_tensor_keys_see_each_tensors_shape_stride_and_dtype():
    """fivar.runtime.attention._shapes: a change to any one tensor's shape, stride or dtype is another key; equal
    layouts are one key."""
    from fivar.runtime.attention import _shapes
    a, b = torch.zeros(4, 8), torch.zeros(8, 4)
    base = value_key(_shapes(a, a, a))
    assert value_key(_shapes(torch.ones(4, 8), torch.ones(4, 8), torch.ones(4, 8))) == base
    others = [_shapes(*(t if i == j else a for i in range(3))) for j in range(3) for t in (b, b.t(), a.half())]
    keys = {value_key(x) for x in others}
    assert len(keys) == len(others) and base not in keys


def test_capacity_is_least_recently_used():
    cache = PlanCache(capacity=2)
    made, make = _make_counter()
    for k in ("a", "b", "a", "c"):
        cache.get((k,), make)
    assert len(made) == 3 and len(cache) == 2
    cache.get(("a",), make)
    assert len(made) == 3  # "a" was used last before "c": kept; "b" went
    cache.get(("b",), make)
    assert len(made) == 4


class _FakePlan:
    made = 0

    def __init__(self, variant, qo_indptr, kv_indptr, **kw):
        type(self).made += 1
        self.kw = kw

    def run(self, q, k, v, return_lse=False):
        return q


@pytest.fixture
def fake_ragged(monkeypatch):
    """The one-shot ragged call's wiring on the CPU: its checks pass CPU tensors, its plan is a counter."""
    _FakePlan.made = 0
    monkeypatch.setattr(attention, "RaggedAttentionPlan", _FakePlan)
    monkeypatch.setattr(attention, "_check_qkv", lambda *a, **k: None)
    monkeypatch.setattr(attention, "_check_backend", lambda *a, **k: "fa2")
    monkeypatch.setattr(attention, "_one_shot", PlanCache())
    return _FakePlan


def test_one_shot_call_plans_once_per_key(fake_ragged):
    v = fivar.load("document_mask")
    q = torch.zeros(12, 4, 64)
    k = torch.zeros(12, 2, 64)
    qo = torch.tensor([0, 5, 12], dtype=torch.int32)
    kv = torch.tensor([0, 5, 12], dtype=torch.int32)
    doc = torch.zeros(2, 7, dtype=torch.int32)
    call = lambda: v.batch_prefill_ragged(q, k, k, qo, kv, causal=True, backend="fa2", doc_ids=doc)  # noqa: E731
    call()
    call()
    assert fake_ragged.made == 1
    doc[1, 4] = 1  # the document ids changed in place: a new plan
    call()
    assert fake_ragged.made == 2
    kv[1] = 6  # an indptr changed in place
    call()
    assert fake_ragged.made == 3
    v.batch_prefill_ragged(q, k, k, qo, kv, causal=False, backend="fa2", doc_ids=doc)
    assert fake_ragged.made == 4
    v.batch_prefill_ragged(q[:, :2], k, k, qo, kv, causal=False, backend="fa2", doc_ids=doc)  # another shape
    assert fake_ragged.made == 5


def test_dropped_plans_are_released_once():
    released = []
    cache = PlanCache(capacity=2, on_evict=released.append)
    made, make = _make_counter()
    a = torch.zeros(2)
    cache.get(("x", a), make)
    cache.get(("y",), make)
    cache.get(("z",), make)  # evicts the oldest
    assert released == [made[0]]
    del a
    gc.collect()
    cache.lookup(("x", torch.zeros(2)))  # nothing of x is left to drop
    assert released == [made[0]]
    cache.clear()
    assert sorted(map(id, released)) == sorted(map(id, made)) and len(cache) == 0


def test_recorded_values_are_made_afresh_while_a_cuda_graph_is_captured(monkeypatch):
    """A cache of device work on tensor contents (`recorded`) serves nothing during capture, so the graph records
    the work; a plan cache (FlashInfer's plans cannot be made inside a capture) still serves its plans."""
    from fivar.runtime import plan_cache
    t = torch.zeros(3)
    made = []
    recorded, plans = PlanCache(recorded=True), PlanCache()
    for cache in (recorded, plans):
        cache.get(("x", t), lambda: made.append(1) or len(made))
    monkeypatch.setattr(plan_cache, "capturing", lambda: True)
    assert [recorded.get(("x", t), lambda: made.append(1) or len(made)) for _ in range(2)] == [3, 4]
    assert plans.get(("x", t), lambda: made.append(1) or len(made)) == 2
    assert len(recorded) == 1 and recorded.hits == 0


def _numpy_write(t):
    t.numpy()[1] += 1


def _data_write(t):
    t.data[1] += 1


def _view_of_data_write(t):
    t.data.view(-1)[1:2].add_(1)  # a view of .data: its own counter moves, not t's


@pytest.mark.parametrize("write", [_numpy_write, _data_write, _view_of_data_write], ids=["numpy", "data", "view"])
@pytest.mark.parametrize("which", ["param", "indptr"])
def test_writes_past_the_version_counter_replan(write, which):
    """A write through .numpy(), .data or a view of it keeps the tensor's _version: the key's identity and version
    match, so the plan's contents are compared, and the changed tensor gets a new plan."""
    cache = PlanCache()
    made, make = _make_counter()
    indptr = torch.tensor([0, 5, 9], dtype=torch.int32)
    doc = torch.randint(0, 4, (2, 9), dtype=torch.int32)
    parts = lambda: ("ragged", "v", {"doc": doc}, indptr)  # noqa: E731
    first = cache.get(parts(), make)
    assert cache.get(parts(), make) is first
    t = doc if which == "param" else indptr
    version = t._version
    write(t.view(-1) if which == "param" else t)
    assert t._version == version
    assert cache.get(parts(), make) is not first and len(made) == 2 and len(cache) == 1
    assert cache.get(parts(), make) is made[-1]


@pytest.mark.parametrize("n", [1, 3])
def test_strided_views_of_one_or_more_elements_are_keyed_by_their_contents(n):
    """A strided host view (every other element; one element of it keeps its stride through .contiguous()) is
    copied and compared like a dense tensor: the same contents hit, a write through .numpy() replans."""
    cache = PlanCache()
    made, make = _make_counter()
    base = torch.randint(1, 16, (2 * n + 1,), dtype=torch.int64)
    view = base[::2][:n]
    parts = lambda: ("decode", view)  # noqa: E731
    first = cache.get(parts(), make)
    assert cache.get(parts(), make) is first
    base.numpy()[2 * (n - 1)] += 1  # the view's last element, past its version counter
    assert cache.get(parts(), make) is not first and len(made) == 2


def test_inference_mode_tensors_are_keyed_by_their_contents():
    """A tensor made under torch.inference_mode has no version counter (reading it raised): its contents decide."""
    cache = PlanCache()
    made, make = _make_counter()
    with torch.inference_mode():
        t = torch.tensor([0, 3, 7], dtype=torch.int32)
    first = cache.get(("x", t), make)
    assert cache.get(("x", t), make) is first
    with torch.inference_mode():
        t[1] = 4
    assert cache.get(("x", t), make) is not first and len(made) == 2


def test_keys_past_the_content_limit_are_not_kept_and_their_plans_are_released(monkeypatch):
    """A key holding more tensor bytes than CONTENT_LIMIT is not kept (comparing would cost what planning does): its
    plan serves one call and is released on the next (its launch is queued by then), or on clear()."""
    from fivar.runtime import plan_cache
    monkeypatch.setattr(plan_cache, "CONTENT_LIMIT", 64)
    released = []
    cache = PlanCache(on_evict=released.append)
    made, make = _make_counter()
    small, big = torch.zeros(16, dtype=torch.int32), torch.zeros(17, dtype=torch.int32)  # 64 and 68 bytes
    assert cache.get(("x", small), make) is cache.get(("x", small), make) and len(made) == 1
    first = cache.get(("x", big), make)
    assert len(cache) == 1 and released == []
    second = cache.get(("x", big), make)
    assert second is not first and released == [first]
    cache.clear()
    assert released == [first, made[0], second]


def test_one_shot_call_replans_after_a_write_through_numpy(fake_ragged):
    """The one-shot entry point's key: doc_ids and an indptr written through .numpy() between calls plan again."""
    v = fivar.load("document_mask")
    q, k = torch.zeros(12, 4, 64), torch.zeros(12, 2, 64)
    qo, kv = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 5, 12], dtype=torch.int32)
    doc = torch.zeros(2, 7, dtype=torch.int32)
    call = lambda: v.batch_prefill_ragged(q, k, k, qo, kv, causal=True, backend="fa2", doc_ids=doc)  # noqa: E731
    call()
    call()
    assert fake_ragged.made == 1
    doc.numpy()[1, 4] = 1
    call()
    assert fake_ragged.made == 2
    kv.numpy()[1] = 6
    call()
    call()
    assert fake_ragged.made == 3


class _Explicit(attention._OwnsWrapper):
    """A plan that records the indptr contents it was made from, and refuses a negative entry like a real one."""
    released: list = []

    def __init__(self, variant, indptr):
        from fivar.runtime.plan_handles import register_plan
        register_plan(self)
        self.variant = variant
        if bool((indptr < 0).any()):
            raise fivar.FivarError(f"variant '{variant.name}': indptr must not be negative")
        self.planned = indptr.tolist()

    def release(self):
        type(self).released.append(self.planned)


def test_invalidate_plans_again_from_the_current_contents():
    """plan.invalidate() on an explicit plan: the same object (and torch.compile handle) now holds a plan of the
    tensors' current contents, and the old one is released; new contents it refuses leave it as it was."""
    v = fivar.load("softcap")
    _Explicit.released = []
    indptr = torch.randint(0, 50, (4,), dtype=torch.int32).sort().values
    plan = attention.explicit_plan(lambda: _Explicit(v, indptr))
    handle, old = plan.op_handle, indptr.tolist()
    indptr.numpy()[2] += 3
    plan.invalidate()
    assert plan.planned == indptr.tolist() != old and plan.op_handle == handle
    assert _Explicit.released == [old]
    indptr.numpy()[0] = -1
    with pytest.raises(fivar.FivarError, match="indptr must not be negative"):
        plan.invalidate()
    assert plan.planned[0] != -1 and _Explicit.released == [old]
    with pytest.raises(fivar.FivarError, match="only a plan of plan_ragged / plan_paged / plan_decode"):
        _Explicit(v, indptr.abs()).invalidate()


def test_invalidate_plans_drops_every_kept_plan_and_device_tensors_are_keyed_by_version():
    """fivar.invalidate_plans() empties every plan cache (the one-shot calls plan again); a host tensor's contents are
    compared on a hit, a device tensor's are not (a sync a call) unless it has no version counter."""
    from fivar.runtime.plan_cache import compared
    caches = [PlanCache(capacity=4), PlanCache(capacity=4, recorded=True)]
    t = torch.arange(8, dtype=torch.int32)
    for c in caches:
        c.get((t, 1), lambda: object())
        assert len(c) == 1
    fivar.invalidate_plans()
    assert [len(c) for c in caches] == [0, 0]
    made = []
    caches[0].get((t, 1), lambda: made.append(1))
    assert made == [1]
    assert compared(t) and compared(torch.empty(2, device="meta")) is False
    with torch.inference_mode():
        assert compared(torch.empty(2, device="meta"))  # no version counter: only its contents can tell


def test_a_freed_plans_handle_is_one_clear_error():
    """A compiled graph holds a plan's int handle: while the plan lives the handle finds it; once the plan is freed,
    a run through the handle is one FivarError saying so, not a KeyError from inside the op."""
    import gc

    from fivar.runtime.plan_handles import plan_handle, plan_of
    v = fivar.load("softcap")
    plan = _Explicit(v, torch.tensor([0, 3], dtype=torch.int32))
    handle = plan_handle(plan)
    assert plan_of(handle) is plan
    del plan
    gc.collect()
    with pytest.raises(fivar.FivarError, match=f"plan handle {handle} .*names no live plan.*keep the plan referenced"):
        plan_of(handle)
