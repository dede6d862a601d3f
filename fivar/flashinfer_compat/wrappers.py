"""fivar runs its modules through FlashInfer's own Python wrappers (fivar.runtime.attention._attach): it sets the
private attributes FlashInfer's `jit_args` path sets, launches a single-prefill module's `run` with FlashInfer's argument order (the FA3
last-wave split), and a planned paged wrapper's module `paged_run` the way its `run` does (the direct paged run).
These checks read the installed wrappers' Python source."""
from __future__ import annotations

import functools
import inspect
import re

import torch

from ..errors import FivarError
from ._base import Coupling, norm, safe, warn_once

#: The attributes fivar sets on a wrapper, and the wrappers that must read them.
ATTACHED = ("_jit_module", "_jit_additional_tensor_names")
OPTIONAL_ATTACHED = ("_jit_additional_scalar_names", "_variant_owns_mask")  # set where the wrapper has them
#: A single-prefill module's run(...) as FlashInfer calls it.
RUN_ARGS = "q, k, v, tmp, o, lse, mask_mode, TensorLayout[kv_layout].value, window_left, *args,"
#: BatchPrefillWithPagedKVCacheWrapper.run's arguments to its module's paged_run on FA2/FA3, then the variant's.
PAGED_RUN_ARGS = ("run_args = [ self._float_workspace_buffer, self._int_workspace_buffer, self._plan_info, q, k_cache, "
                  "v_cache, self._qo_indptr_buf, self._paged_kv_indptr_buf, self._paged_kv_indices_buf, "
                  "self._paged_kv_last_page_len_buf, out, lse, mask_mode, TensorLayout[self._kv_layout].value, "
                  "window_left, enable_pdl, ]")
#: The rest of that run as the direct paged run mirrors it: a log2 LSE [tokens, heads] as the kernel writes it, the
#: variant's arguments after the known buffers, one module call. (Its zero-filled output the direct run leaves out:
#: the kernels write every row, fivar.flashinfer_compat.wrappers.DirectPagedRun.)
#: The module arguments that run fills from its own buffers (prepare_jit_additional_args' known names): a module
#: declaring one keeps the wrapper's run (fivar.runtime.launch.direct_paged_run).
#: The paged wrapper's `_backend` values (FlashInfer's own spelling) whose run DirectPagedRun mirrors.
DIRECT_RUN_BACKENDS = frozenset({"fa2", "fa3"})
PAGED_RUN_FILLED = frozenset({"maybe_custom_mask", "maybe_mask_indptr", "maybe_alibi_slopes", "maybe_prefix_len_ptr",
                              "maybe_token_pos_in_items_ptr", "maybe_max_item_len_ptr", "maybe_k_cache_sf",
                              "maybe_v_cache_sf"})
PAGED_RUN_STEPS = ('lse_base: str = "log2"', 'lse_layout: str = "NH"',
                   "prepare_jit_additional_args(", "run_args.extend(additional_args)",
                   "self._cached_module.paged_run(*run_args)")


def _source(obj) -> str:
    return inspect.getsource(obj)


@functools.lru_cache(maxsize=None)
@safe
def attach_problem() -> str | None:
    """Why fivar cannot point the installed wrappers at its own modules, or None."""
    import flashinfer
    from flashinfer import decode, prefill
    for fn, mod in (("get_batch_prefill_jit_module", prefill), ("get_batch_decode_jit_module", decode)):
        if not callable(getattr(mod, fn, None)):
            return f"flashinfer.{mod.__name__.rsplit('.', 1)[-1]} has no {fn}"
    for cls in (flashinfer.BatchPrefillWithRaggedKVCacheWrapper, flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                flashinfer.BatchDecodeWithPagedKVCacheWrapper):
        text = _source(cls)
        for attr in ATTACHED:
            if f"self.{attr} = " not in text or f"self.{attr}" not in text.split(f"self.{attr} = ", 1)[1]:
                return f"{cls.__name__} no longer sets and reads self.{attr}"
        if "self._cached_module = self._jit_module" not in text:
            return f"{cls.__name__} no longer plans and runs on self._jit_module"
    return None


@functools.lru_cache(maxsize=None)
@safe
def single_prefill_run_problem() -> str | None:
    """Why fivar cannot call a single-prefill module's run the way FlashInfer does, or None."""
    from flashinfer import prefill
    text = norm(_source(prefill.single_prefill_with_kv_cache_with_jit_module))
    if f"jit_module.run( {RUN_ARGS} )" not in text:
        return "single_prefill_with_kv_cache_with_jit_module calls its module's run with other arguments"
    return None


@functools.lru_cache(maxsize=None)
@safe
def paged_run_problem() -> str | None:
    """Why fivar cannot launch a planned paged wrapper's module the way the wrapper's run does, or None."""
    import flashinfer
    from flashinfer import prefill
    text = norm(_source(flashinfer.BatchPrefillWithPagedKVCacheWrapper.run))
    if PAGED_RUN_ARGS not in text:
        return "BatchPrefillWithPagedKVCacheWrapper.run passes its module's paged_run other arguments"
    missing = [step for step in PAGED_RUN_STEPS if step not in text]
    if missing:
        return f"BatchPrefillWithPagedKVCacheWrapper.run no longer does {missing[0]!r}"
    filled = set(re.findall(r'"(maybe_\w+)":', text))
    if filled != PAGED_RUN_FILLED:
        return f"BatchPrefillWithPagedKVCacheWrapper.run fills other module arguments ({', '.join(sorted(filled))})"
    if 'if lse_layout == "NH": if lse_base == "ln": lse.mul_(ln2) return lse' not in norm(_source(prefill._finish_lse)):
        return "flashinfer.prefill._finish_lse no longer hands a log2 [tokens, heads] LSE back as the kernel wrote it"
    return None


COUPLINGS = [
    Coupling("wrapper_jit_module", "the private attributes of FlashInfer's batch wrappers (_jit_module, "
             "_jit_additional_tensor_names, ...) that its jit_args path sets",
             "batch prefill and decode on fivar's modules", "none: the batch entry points refuse to run",
             attach_problem, required=True),
    Coupling("single_prefill_run", "a single-prefill module's run(...) argument order",
             "single prefill writing into the caller's `out` itself; the FA3 single-prefill last-wave split",
             "FlashInfer's single_prefill_with_kv_cache_with_jit_module and a copy into `out`; the last wave runs "
             "unsplit", single_prefill_run_problem),
    Coupling("paged_run_direct", "BatchPrefillWithPagedKVCacheWrapper.run's call of its module's paged_run "
             "(argument order, log2 LSE)",
             "planned paged runs and one-shot decode without the wrapper's per-call Python",
             "runs go through the wrapper's run", paged_run_problem),
]


# --- the adapters: fivar's only touches of the wrappers' private attributes, beside their checks above ----------

def _active(name: str) -> bool:
    """fivar.flashinfer_compat.active for this module's couplings (the package imports this module)."""
    coupling = next(c for c in COUPLINGS if c.name == name)
    why = coupling.check()
    if why is not None:
        warn_once(coupling, why)
    return why is None


def attach(wrapper, module, fmod, owns_mask: bool):
    """Point a FlashInfer wrapper at a module fivar built (FlashInfer would otherwise build its own).

    Sets the private attributes FlashInfer's `jit_args` path sets (checked: attach_problem).
    """
    why = attach_problem()
    if why:
        raise FivarError(f"fivar cannot run its modules through this FlashInfer's wrappers: {why}")
    from flashinfer.decode import get_batch_decode_jit_module
    from flashinfer.prefill import get_batch_prefill_jit_module
    t_names, _, s_names, _ = fmod.additional
    make = get_batch_decode_jit_module if fmod.op == "batch_decode" else get_batch_prefill_jit_module
    wrapper._jit_module = make(fmod.uri, module)
    wrapper._jit_additional_tensor_names = list(t_names)
    if hasattr(wrapper, "_jit_additional_scalar_names"):
        wrapper._jit_additional_scalar_names = list(s_names)
    if hasattr(wrapper, "_variant_owns_mask"):
        wrapper._variant_owns_mask = owns_mask
    if hasattr(wrapper, "_jit_use_token_head_sf"):  # 0.7.4: what plan() checks; fivar renders USE_TOKEN_HEAD_SF false
        wrapper._jit_use_token_head_sf = False
    return wrapper


class DirectPagedRun:
    """`wrapper.run(q, (k_cache, v_cache), *args, return_lse=...)` of a planned FA2/FA3 paged wrapper, as one call of
    its module's paged_run with the planned buffers bound once. FlashInfer's run re-derives them and checks options
    fivar never passes on every call: about half the host time of a one-shot decode, which at batch 32 x 32768 is
    longer than the kernel. Made by `direct_paged_run`; valid until the wrapper is planned again."""

    def __init__(self, wrapper, variant_name: str, device, rows: int | None = None, planned_rows: bool = False):
        from flashinfer.prefill import MaskMode, TensorLayout
        from flashinfer.utils import device_support_pdl
        w = wrapper
        owns_mask = w._custom_mask_buf is not None or getattr(w, "_variant_owns_mask", False)
        mask_mode = (MaskMode.CUSTOM if owns_mask else MaskMode.CAUSAL if w._causal else MaskMode.NON_CAUSAL).value
        self._name, self._rows = variant_name, w._qo_indptr_last if rows is None else rows
        # fixed rows (a CUDA-graph plan's, fivar.runtime.graph_verify): its steps' tokens fill a prefix of them, the
        # rest no query tile writes, so they start as zeros; planned_rows: padding tiles of no keys cover the rest
        self._alloc = torch.empty if rows is None or planned_rows else torch.zeros
        self._out_dtype = w._cached_o_data_type
        self._paged_run = w._cached_module.paged_run
        self._head = (w._float_workspace_buffer, w._int_workspace_buffer, w._plan_info)
        self._buffers = (w._qo_indptr_buf, w._paged_kv_indptr_buf, w._paged_kv_indices_buf,
                         w._paged_kv_last_page_len_buf)
        self._flags = (mask_mode, TensorLayout[w._kv_layout].value, w._window_left,
                       device_support_pdl(torch.device(device)))

    def __call__(self, q, k_cache, v_cache, args, return_lse: bool, into=None):
        """`into`: (out, lse or None) to write, contiguous, of q's rows (a part of a larger output); else new ones."""
        if q.shape[0] != self._rows:
            raise FivarError(f"variant '{self._name}': q has {q.shape[0]} rows, the plan's qo_indptr[-1] is "
                             f"{self._rows}")
        # not zero-filled (FlashInfer's run fills it: a kernel launch more, on the host and the GPU): every row lies in
        # a query tile, each tile gets at least one KV chunk (FA2's scheduler clamps a KV length to >= 1; its merge
        # writes rows of no chunk) and FA3 stores zeros for a tile with no keys. One exception, covered by its caller:
        # the FA2 block form's kCausal launch skips the rows of its second launch's blocks, which write_rows then
        # fills (fivar.runtime.attention). The LSE comes out log2 [tokens, heads], fivar's convention.
        if into is not None and self._alloc is torch.empty and into[0].is_contiguous() and \
                (into[1] is None or into[1].is_contiguous()):  # FA2's kernel assumes a contiguous output
            out, lse = into
        else:
            out = self._alloc(q.shape, dtype=self._out_dtype, device=q.device)
            lse = self._alloc(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        self._paged_run(*self._head, q, k_cache, v_cache, *self._buffers, out, lse, *self._flags, *args)
        return (out, lse) if return_lse else out


def direct_paged_run(wrapper, variant_name: str, device, args, rows: int | None = None,
                     planned_rows: bool = False) -> DirectPagedRun | None:
    """A DirectPagedRun of a planned paged wrapper, or None where the wrapper's own run must do the work: the installed
    FlashInfer's run is not the one it mirrors (fivar.flashinfer_compat: paged_run_direct), a backend other than
    FA2/FA3, options fivar does not set, or a module taking arguments the wrapper fills in (`args`: the variant's
    arguments as a run passes them; the wrapper appends derived scalars where fewer are given). `rows`: q's rows
    whatever the plan's qo_indptr[-1] (a CUDA-graph plan's fixed capacity; the rows past the plan's come out zeros);
    planned_rows: the plan's query tiles cover all `rows` (padding tiles of no keys write zeros past a step's)."""
    w = wrapper
    if not _active("paged_run_direct") or getattr(w, "_backend", None) not in DIRECT_RUN_BACKENDS:
        return None
    if w._jit_module is None or getattr(w, "_prefix_len_ptr", None) is not None or \
            getattr(w, "_eagle_verify_fp8kv_sm90_state", None) is not None or w._kv_layout != "NHD":
        return None
    tensors, scalars = list(w._jit_additional_tensor_names), list(getattr(w, "_jit_additional_scalar_names", []))
    if PAGED_RUN_FILLED.intersection(tensors) or len(args) != len(tensors) + len(scalars):
        return None
    return DirectPagedRun(w, variant_name, device, rows, planned_rows)


@functools.cache
def plan_takes_uniform_q_len() -> bool:
    """Whether this FlashInfer's paged prefill `plan` takes `uniform_q_len` (every request that many query rows: its
    FA2 CUDA-graph scheduler then sizes the query tile for them, not for the ragged worst case)."""
    import flashinfer
    return "uniform_q_len" in inspect.signature(flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan).parameters


def uniform_plan_kwargs(rows: int | None) -> dict:
    """A paged wrapper's plan kwargs promising every request `rows` query rows, where this FlashInfer's plan takes the
    promise; {} for None or an older plan."""
    return {"uniform_q_len": rows} if rows is not None and plan_takes_uniform_q_len() else {}


def plan_layout(wrapper) -> tuple:
    """A planned wrapper's launch layout (its plan_info: workspace offsets, padded grid, split): what a captured run
    replays with, the same for every plan of a `use_cuda_graph=True` wrapper (fivar.runtime.graph_verify)."""
    return tuple(getattr(wrapper, "_plan_info", None) or ())
