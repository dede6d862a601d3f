"""The plans behind the one-shot calls (`v.prefill`, `v.batch_prefill_*`, `v.decode`), kept between calls.

A one-shot call used to validate, plan (FlashInfer's scheduler, a host copy of the indptrs, for a mask that is more
than a band the mask pre-pass) and launch every time: for the layers of one model step, which share one batch
layout, all but the first plan were waste (a chunked mask at S=8192: 2.4 ms a call against 0.12 ms planned).
Here the plan is kept under a key of everything it depends on, and a later call with the same key only launches.

The key holds values (shapes, dtypes, devices, scalar params, flags) and tensors by identity and version counter,
so an in-place write through torch (`copy_`, indexing, an optimizer step) makes the next call plan again. The version
counter misses writes that bypass it (`.numpy()`, `.data`, DLPack, a kernel of another library, a CUDA-graph
replay). For host tensors, and tensors with no version counter (made under inference mode), an entry also keeps a copy
of their contents and a hit compares it (a memcmp on the host; for a device tensor without a version counter, one
device-to-host copy, a stream sync). Device tensors with a version counter are not compared: that would cost a sync
on every call (measured on an H200: 0.1-0.5 ms a call exposed, up to 1.35x a short kernel's time). After writing a
device tensor behind its version counter, call `fivar.invalidate_plans()` (or use an explicit plan and its
`invalidate()`), as with FlashInfer's own plans.
A key whose compared tensors hold more than CONTENT_LIMIT bytes is not kept: its plan serves one call. A tensor is
held weakly: once the caller drops it, entries keyed on it are dropped too (its id may then be reused by another
tensor). While a CUDA graph is captured nothing is compared (no sync allowed there: the plan a capture uses is the one
it records).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch


#: The most bytes of tensor contents an entry keeps a copy of (a document-id table of 32 x 32768 int32 ids is 4 MiB):
#: past that, comparing would cost about what planning again does, and the copies would hold that much memory.
CONTENT_LIMIT = 4 << 20


#: Every PlanCache, so that `invalidate_plans` reaches them all.
_CACHES: "weakref.WeakSet[PlanCache]" = weakref.WeakSet()


def invalidate_plans() -> None:
    """Drop every kept one-shot plan: the next calls plan from their tensors' current contents. For device tensors
    written behind their version counter (`.data`, DLPack, another library's kernel), which the caches cannot see."""
    for cache in list(_CACHES):
        cache.clear()


def _versioned(t: torch.Tensor) -> bool:
    try:
        t._version
        return True
    except RuntimeError:  # an inference-mode tensor keeps no version counter
        return False


def compared(t: torch.Tensor) -> bool:
    """Whether a kept plan compares this tensor's contents on a hit: a host tensor (a memcmp), or a device tensor
    without a version counter (a sync, the only way to see its writes)."""
    return t.device.type == "cpu" or not _versioned(t)


def tensor_key(t: torch.Tensor) -> tuple:
    # a tensor's dtype and device never change, and an entry whose tensor died is dropped (its weak reference):
    # identity, version, storage and shape say all the rest but the contents, which the entry compares
    try:
        version = t._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter: its contents still decide
        version = None
    return ("tensor", id(t), version, t.data_ptr(), t.shape)


class Hashed(tuple):
    """A tuple of hashable values that value_key keeps as it is (no walk through its items)."""


def _same(x):
    return x


def _typed(x):
    return (type(x), x)


def _items(x) -> tuple:
    # value_key of each item with its dispatch inlined (one call an item, not two): a one-shot call's parts are a
    # tuple of about ten items, keyed on every call
    return tuple([(_KEY_OF.get(type(i)) or _key_of_type(type(i)))(i) for i in x])


def _tuple(x):
    return ("tuple",) + _items(x)


def _list(x):
    return ("list",) + _items(x)


def _dict(x):
    return ("dict",) + tuple(sorted(zip(x.keys(), _items(x.values())))) if x else ("dict",)


#: How each type is keyed, found by one dict lookup of the exact type: value_key runs on every one-shot call, and a
#: chain of isinstance tests per item made a third of its time.
#: Hashed, str, None, dtype, device, Size: hashable and equal only to their kind, kept as they are; int, float and
#: bool with their type (1, 1.0 and True stay apart).
_KEY_OF = {torch.Tensor: tensor_key, Hashed: _same, str: _same, type(None): _same, torch.dtype: _same,
           torch.device: _same, torch.Size: _same,
           int: _typed, float: _typed, bool: _typed, tuple: _tuple, list: _list, dict: _dict}


def _key_of_type(kind: type):
    """The keyer of a type not in _KEY_OF (a subclass, a variant object): found once, then kept there."""
    if issubclass(kind, torch.Tensor):
        f = tensor_key
    else:
        f = next((_KEY_OF[base] for base in kind.__mro__[1:] if base in _KEY_OF and base not in (int, float, bool)),
                 _typed)
    _KEY_OF[kind] = f
    return f


def value_key(x) -> tuple | object:
    """A hashable key of a call argument: a tensor by identity and version, containers item by item, numbers with
    their type (1, 1.0 and True stay apart); anything else as (its type, itself)."""
    f = _KEY_OF.get(type(x))
    return (f or _key_of_type(type(x)))(x)


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream. A result served from a cache then is not
    recorded, so a replay would not recompute it from the tensors' contents at replay time."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.numel() and t.stride(0) != 1:  # a strided view (one element keeps its stride through .contiguous())
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def _host_bytes(ts: list) -> bytes:
    """The tensors' contents back to back, on the host: one copy (a device's tensors: one device-to-host copy)."""
    if len(ts) == 1 and ts[0].device.type == "cpu":
        return _flat(ts[0]).numpy().tobytes()
    return torch.cat([_flat(t) for t in ts]).cpu().numpy().tobytes()


class Contents:
    """Copies of tensors' contents on the host (bytes: compared by memcmp; torch.equal on the CPU was 10x slower), a
    CPU tensor's on its own, a device's tensors in one, to tell whether the same tensors still hold them."""

    def __init__(self, tensors: list):
        groups: dict = {}
        for i, t in enumerate(tensors):
            if compared(t):
                groups.setdefault(t.device if t.device.type != "cpu" else i, []).append(i)
        self._groups = [(tensors[idx[0]].device.type, idx, _host_bytes([tensors[i] for i in idx]))
                        for idx in groups.values()]

    @staticmethod
    def fits(tensors: list) -> bool:
        """Whether copies of these tensors' contents are kept (dense, on a real device, CONTENT_LIMIT bytes in all)."""
        if any(t.layout != torch.strided or t.device.type == "meta" for t in tensors):
            return False
        return sum(t.numel() * t.element_size() for t in tensors if compared(t)) <= CONTENT_LIMIT

    def matches(self, tensors: list) -> bool:
        """Whether `tensors` (the ones copied, in order) hold the copied contents. A CUDA device's tensors are one
        device-to-host copy (a stream sync), skipped while a CUDA graph is being captured (no sync allowed there; the
        contents a capture sees are not what a replay reads anyway)."""
        for kind, idx, copy in self._groups:
            if kind == "cuda" and capturing():
                continue
            if _host_bytes([tensors[i] for i in idx]) != copy:
                return False
        return True


class PlanCache:
    """A small LRU of plans. `get(parts, make)`: the plan for `parts` (a tuple of call arguments), made by
    `make()` on a miss. Plans own device memory (a FlashInfer wrapper's workspace), hence the small capacity.
    `recorded`: the values are device work on tensor contents (a mask pre-pass's ranges), which a CUDA graph must
    record: while one is captured, `get` makes them afresh and keeps nothing (see `capturing`)."""

    def __init__(self, capacity: int = 8, on_evict=None, recorded: bool = False):
        self.capacity, self.on_evict, self.recorded = capacity, on_evict, recorded
        self._entries: OrderedDict = OrderedDict()  # key -> (plan, weakrefs of the key's tensors, their Contents)
        self._passing: list = []  # plans of keys too large to keep: released on the next call (their launch is queued)
        self.hits = self.misses = 0
        _CACHES.add(self)

    def key(self, parts: tuple) -> tuple:
        return value_key(parts)

    def lookup(self, parts: tuple, key: tuple | None = None):
        if self._passing:
            self._release_passing()
        key = self.key(parts) if key is None else key
        entry = self._entries.get(key)
        if entry is not None:
            plan, refs, contents = entry
            tensors = [r() for r in refs]
            # a keyed tensor died (its id may now name another tensor), or one was written without its version moving
            if all(t is not None for t in tensors) and contents.matches(tensors):  # `in` would call Tensor.__eq__
                self._entries.move_to_end(key)
                self.hits += 1
                return plan
            self._drop(key)
        return None

    def get(self, parts: tuple, make):
        if self.recorded and capturing():
            return make()
        key = self.key(parts)  # before make(): the versions the plan is made from
        plan = self.lookup(parts, key)
        if plan is not None:
            return plan
        self.misses += 1
        tensors = list(_tensors(parts))
        if not Contents.fits(tensors):
            plan = make()
            if self.on_evict is not None:
                self._passing.append(plan)
            return plan
        contents = Contents(tensors)  # before make(), as the key
        plan = make()
        self._entries[key] = (plan, [weakref.ref(t) for t in tensors], contents)
        while len(self._entries) > self.capacity:
            self._drop(next(iter(self._entries)))
        return plan

    def _drop(self, key):
        plan = self._entries.pop(key)[0]
        if self.on_evict is not None:
            self.on_evict(plan)

    def _release_passing(self):
        passing, self._passing = self._passing, []
        for plan in passing:
            self.on_evict(plan)

    def clear(self):
        for key in list(self._entries):
            self._drop(key)
        self._release_passing()

    def __len__(self):
        return len(self._entries)
