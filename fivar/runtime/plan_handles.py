"""Every live plan by an int handle: a graph compiled with a plan's `.run` (fivar.runtime.ops' plan_run op) holds
the int as a constant, not the plan. Apart from fivar.runtime.ops so that making a plan does not import what that
module needs for torch.compile (Dynamo: seconds of a cold first call)."""
from __future__ import annotations

import itertools
import weakref

from ..errors import FivarError

_plans: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_plan_ids = itertools.count(1)


def register_plan(plan):
    """Give a plan the int the plan_run op knows it by (each plan's constructor calls it first), so a compiled graph
    reads `plan.op_handle` as a constant."""
    plan.op_handle = next(_plan_ids)
    _plans[plan.op_handle] = plan
    return plan


def plan_of(handle: int):
    """The live plan registered as `handle`."""
    plan = _plans.get(handle)
    if plan is None:  # the graph outlived its plan: say so, not a KeyError from inside the op
        raise FivarError(f"plan handle {handle} (a compiled graph's plan_run) names no live plan: the plan object was "
                         "freed; keep the plan referenced for as long as a compiled graph runs it")
    return plan


def plan_handle(plan) -> int:
    handle = getattr(plan, "op_handle", None)
    if handle is None:
        raise FivarError(f"variant '{plan.variant.name}': {type(plan).__name__} has no op handle (its constructor "
                         "calls fivar.runtime.plan_handles.register_plan), so torch.compile cannot call its run")
    return handle
