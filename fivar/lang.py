"""The functions a variant's `logits`/`mask` may call.

fivar never runs these when it compiles a variant: it reads the function's source and maps each call
to the target's own operation. They are still real functions, so a variant's code also runs as plain
Python on numbers (and elementwise on torch tensors), which is how the tests get a reference that does
not go through fivar's compiler at all.
"""
from __future__ import annotations

import builtins
import math

try:  # torch is a hard dependency of fivar, but keep the DSL importable for docs tooling
    import torch
except ImportError:  # pragma: no cover
    torch = None


def _is_tensor(*xs) -> bool:
    return torch is not None and any(isinstance(x, torch.Tensor) for x in xs)


def tanh(x):
    return torch.tanh(x) if _is_tensor(x) else math.tanh(x)


def exp(x):
    return torch.exp(x) if _is_tensor(x) else math.exp(x)


def exp2(x):
    return torch.exp2(x) if _is_tensor(x) else 2.0 ** x


def log(x):
    return torch.log(x) if _is_tensor(x) else math.log(x)


def sigmoid(x):
    if _is_tensor(x):
        return torch.sigmoid(x)
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def sqrt(x):
    return torch.sqrt(x) if _is_tensor(x) else math.sqrt(x)


def abs(x):  # noqa: A001 - shadows the builtin on purpose, same meaning
    return torch.abs(x) if _is_tensor(x) else builtins.abs(x)


def floor(x):
    return torch.floor(x) if _is_tensor(x) else float(math.floor(x))


def minimum(a, b):
    if _is_tensor(a, b):
        return torch.minimum(torch.as_tensor(a), torch.as_tensor(b))
    return builtins.min(a, b)


def maximum(a, b):
    if _is_tensor(a, b):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return builtins.max(a, b)


def clamp(x, lo, hi):
    return minimum(maximum(x, lo), hi)


def where(cond, a, b):
    if _is_tensor(cond, a, b):
        return torch.where(torch.as_tensor(cond), torch.as_tensor(a), torch.as_tensor(b))
    return a if cond else b


#: name -> (arity, result kind); "float" results promote ints, "same" keeps the unified operand type.
FUNCTIONS = {
    "tanh": (1, "float"), "exp": (1, "float"), "exp2": (1, "float"), "log": (1, "float"),
    "sigmoid": (1, "float"), "sqrt": (1, "float"), "floor": (1, "float"),
    "abs": (1, "same"), "minimum": (2, "same"), "maximum": (2, "same"),
    "clamp": (3, "same"), "where": (3, "select"),
}
