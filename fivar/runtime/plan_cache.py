"""The plans behind the one-shot calls (`v.prefill`, `v.batch_prefill_*`, `v.decode`), kept between calls.

A one-shot call used to validate, plan (FlashInfer's scheduler, a host copy of the indptrs, for a mask that is more
than a band the mask pre-pass) and launch every time: for the layers of one model step, which share one batch
layout, all but the first plan were waste (a chunked mask at S=8192: 2.4 ms a call against 0.12 ms planned).
Here the plan is kept under a key of everything it depends on, and a later call with the same key only launches.

The key holds values (shapes, dtypes, devices, scalar params, flags) and tensors by identity and version
counter: `t._version` moves on every in-place write through torch, so a tensor changed in place (an indptr, a
document-id table) is never served the plan made from its old contents. A tensor is held weakly: once the
caller drops it, entries keyed on it are dropped too (its id may then be reused by another tensor).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch


def tensor_key(t: torch.Tensor) -> tuple:
    # a tensor's dtype and device never change, and an entry whose tensor died is dropped (its weak reference):
    # identity, version, storage and shape say all the rest
    return ("tensor", id(t), t._version, t.data_ptr(), t.shape)


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


class PlanCache:
    """A small LRU of plans. `get(parts, make)`: the plan for `parts` (a tuple of call arguments), made by
    `make()` on a miss. Plans own device memory (a FlashInfer wrapper's workspace), hence the small capacity.
    `recorded`: the values are device work on tensor contents (a mask pre-pass's ranges), which a CUDA graph must
    record: while one is captured, `get` makes them afresh and keeps nothing (see `capturing`)."""

    def __init__(self, capacity: int = 8, on_evict=None, recorded: bool = False):
        self.capacity, self.on_evict, self.recorded = capacity, on_evict, recorded
        self._entries: OrderedDict = OrderedDict()  # key -> (plan, weakrefs of the key's tensors)
        self.hits = self.misses = 0

    def key(self, parts: tuple) -> tuple:
        return value_key(parts)

    def lookup(self, parts: tuple, key: tuple | None = None):
        key = self.key(parts) if key is None else key
        entry = self._entries.get(key)
        if entry is not None:
            plan, refs = entry
            for r in refs:
                if r() is None:
                    break
            else:
                self._entries.move_to_end(key)
                self.hits += 1
                return plan
            self._drop(key)  # a keyed tensor died: its id may now name another tensor
        return None

    def get(self, parts: tuple, make):
        if self.recorded and capturing():
            return make()
        key = self.key(parts)  # before make(): the versions the plan is made from
        plan = self.lookup(parts, key)
        if plan is not None:
            return plan
        self.misses += 1
        plan = make()
        refs = [weakref.ref(t) for t in _tensors(parts)]
        self._entries[key] = (plan, refs)
        while len(self._entries) > self.capacity:
            self._drop(next(iter(self._entries)))
        return plan

    def _drop(self, key):
        plan, _ = self._entries.pop(key)
        if self.on_evict is not None:
            self.on_evict(plan)

    def clear(self):
        for key in list(self._entries):
            self._drop(key)

    def __len__(self):
        return len(self._entries)
