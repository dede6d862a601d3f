"""Live variants by key: custom ops and compiled graphs carry a variant's `key` (a string, a constant to Dynamo)
and find the object here when they run."""
from __future__ import annotations

import itertools
import weakref

from ..errors import FivarError

_serials = itertools.count(1)
_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(variant) -> str:
    """A new key for `variant` (its name and a serial number), held weakly."""
    key = f"{variant.name}@{next(_serials)}"
    _live[key] = variant
    return key


def variant_by_key(key: str):
    """The live variant whose `key` this is."""
    variant = _live.get(key)
    if variant is None:
        raise FivarError(f"no live variant has the key {key!r} (the variant object was freed)")
    return variant
