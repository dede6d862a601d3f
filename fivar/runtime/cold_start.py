"""A cold first call does not wait for nvcc: the Triton twin runs it while the FlashInfer modules build.

A default call (backend="auto") whose FA2/FA3 modules are not built yet starts building them in the background (one
thread running fivar.jit.build.build_many, once per module set, a line on stderr saying what and for how long) and
runs on the Triton twin, which compiles in seconds; once the build is done, the calls run the modules. Asking for a
backend by name always runs it (and waits for its build); `fivar.config.override(cold_start="wait")` or
FIVAR_COLD_START=wait makes default calls wait too (benchmarks, `fivar check`, the tests). Plans (`v.plan_*`) always
wait: they hold their modules for their lifetime.
"""
from __future__ import annotations

import sys
import threading
import time

from .. import config
from ..errors import FivarError
from ..jit.targets import AUTO, named, target_of

#: cold_start's values: run the Triton twin while building, or wait for the build
MODES = ("triton", "wait")
#: the Triton twin's dtypes (fp16/bf16 only)
_TWIN_DTYPES = ("float16", "bfloat16")
#: The stand-in's Triton settings (fivar.config.override keywords): one launch config per kernel, not every
#: autotuning candidate, since it serves only until the modules are ready
STAND_IN = {"triton_autotune": False}


class _Build:
    """One background build of a call's modules."""

    def __init__(self, variant, what: str, modules: list):
        self.modules, self.what, self.variant = modules, what, variant
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name=f"fivar-build-{variant.name}", daemon=True)

    def _run(self):
        from ..jit.build import build_many
        _lower_priority()
        try:
            build_many(self.modules)
        except BaseException as e:  # said by the call that next needs the module (it builds, and fails, itself)
            self.error = e

    @property
    def done(self) -> bool:
        return not self.thread.is_alive()


#: How much lower the background build's compilers run than the caller: the twin's compile, and the user's own work,
#: come first on cores that nvcc's jobs would otherwise all take
BUILD_NICENESS = 10


def _lower_priority() -> None:
    """Lowers the calling thread's CPU priority by BUILD_NICENESS; the compilers it starts inherit it. On Linux a
    priority is per thread (the caller's other threads keep theirs); elsewhere the call is skipped."""
    import os
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + BUILD_NICENESS))
    except OSError:  # a sandbox refusing it: the build runs at the caller's priority
        pass


_builds: dict[tuple, _Build] = {}
_ready: set[tuple] = set()
_lock = threading.Lock()


def mode() -> str:
    text, where = config.setting("cold_start")
    text = text.lower() or "triton"
    if text not in MODES:
        raise FivarError(f"{where}={text!r}: expected {' or '.join(MODES)}")
    return text


def _expected(modules) -> str:
    """The records' estimate for the slowest of the modules (fivar.jit.progress.expected_text), as a clause."""
    from ..jit.progress import expected_text
    slowest = [m for m in modules if target_of(m.target).compiles_slowest]
    return "; " + expected_text((slowest or modules)[0]) if modules else ""


def runs_triton(variant, op: str, target: str, backend: str, q, params=None, sm_scale=None,
                causal: bool | None = None) -> bool:
    """Whether this one-shot call runs on the Triton twin because its `target` modules are still building: only a
    default call (backend "auto") on a CUDA device with q in fp16/bf16, in mode "triton". Starts the build the first
    time (and says so); False once it is done, or if it failed (the call then builds, and reports, itself).
    `params`, `sm_scale`, `causal`: the call's, which rule out modules it never runs (call_modules): the build leaves
    them to a call that needs them."""
    t = named(target)
    if backend != AUTO or t is None or not t.is_flashinfer or getattr(q, "device", None) is None \
            or q.device.type != "cuda" or str(q.dtype).removeprefix("torch.") not in _TWIN_DTYPES:
        return False
    every = (id(variant), op, target, str(q.dtype), q.shape[-1], config.state_key())
    if every in _ready:  # every module a build of the op compiles is built: no form to pick (the common case)
        return False
    form = softmax_form(variant, q, params, sm_scale)
    key = every + (form, causal is False)
    if key in _ready:
        return False
    with _lock:
        build = _builds.get(key)
        if build is None:
            if mode() == "wait":
                return False
            if all(m.manifest_ok() for m in call_modules(variant, op, target, q)):
                _ready.add(every)
                return False
            modules = call_modules(variant, op, target, q, form, causal)
            if all(m.manifest_ok() for m in modules):
                _ready.add(key)
                return False
            build = _builds[key] = _Build(variant, f"{target} {op}", modules)
            print(f"fivar: variant '{variant.name}': building {len(modules)} {target} module(s) for {op} in the "
                  f"background{_expected(modules)}; the Triton twin runs these calls until they are ready "
                  "(FIVAR_COLD_START=wait waits instead)", file=sys.stderr, flush=True)
            build.thread.start()
            return True
    if not build.done:
        return True
    _ready.add(key)
    if build.error is None:
        print(f"fivar: variant '{variant.name}': {build.what} ready after {time.perf_counter() - build.started:.0f} s;"
              f" calls run on {target} from now", file=sys.stderr, flush=True)
    return False


def call_modules(variant, op, target, q, bounded: bool | None = None, causal: bool | None = None) -> list:
    """A call's modules: what a build of (op, target) compiles, less the softmax form `bounded` (softmax_form of
    the call's params) rules out, and for a call that is not causal the mask-free modules (the segments a causal
    batch of documents runs, fivar.runtime.plans)."""
    from ..jit.build import dtype_name, serving_modules
    modules = serving_modules(variant, op, target, dtype_name(q.dtype), q.shape[-1])
    if bounded is not None:
        modules = [m for m in modules if m.options.get("bounded_softmax", bounded) is bounded]
    if causal is False:
        modules = [m for m in modules if not m.options.get("mask_free")]
    return modules


def softmax_form(variant, q, params=None, sm_scale=None) -> bool | None:
    """Whether these params run FA3's bounded softmax (fivar.runtime.launch.runs_bounded_softmax); None where the
    variant has one form, or the params cannot tell before the call's own checks (which then report them)."""
    from ..codegen.fa3 import softmax_range
    from ..jit.build import dtype_name
    from ..spec.inputs import check_sm_scale, checked_scalar
    from ..spec.params import Scalar
    from .launch import runs_bounded_softmax
    dtype = dtype_name(q.dtype)
    if softmax_range(variant, dtype) is None:
        return None
    given = params or {}
    try:
        scalars = {n: p.default if given.get(n) is None else checked_scalar(variant, n, given[n])
                   for n, p in variant.params.items() if isinstance(p, Scalar)}
        return runs_bounded_softmax(variant, dtype, scalars, check_sm_scale(variant.name, sm_scale, q.shape[-1]))
    except (FivarError, KeyError, TypeError, ValueError, ArithmeticError):
        return None


def building(variant) -> bool:
    """Whether a background build of the variant's modules (of any object of its spec: the same key) is still running
    (its calls meanwhile run the twin)."""
    return any(b.variant.key == variant.key and not b.done for b in list(_builds.values()))


def wait_for_builds(timeout: float | None = None) -> None:
    """Block until every background build has finished (a script about to exit, a benchmark about to time)."""
    for build in list(_builds.values()):
        build.thread.join(timeout)
