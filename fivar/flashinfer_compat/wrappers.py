"""fivar runs its modules through FlashInfer's own Python wrappers (fivar.runtime.attention._attach): it sets the
private attributes FlashInfer's `jit_args` path sets, launches a single-prefill module's `run` with FlashInfer's argument order (the FA3
last-wave split), and a planned paged wrapper's module `paged_run` the way its `run` does (the direct paged run).
These checks read the installed wrappers' Python source."""
from __future__ import annotations

import functools
import inspect
import re

from ._base import Coupling, norm, safe

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
#: the kernels write every row, fivar.runtime.launch.DirectPagedRun.)
#: The module arguments that run fills from its own buffers (prepare_jit_additional_args' known names): a module
#: declaring one keeps the wrapper's run (fivar.runtime.launch.direct_paged_run).
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
    Coupling("fa3_wave_split_launch", "a single-prefill module's run(...) argument order",
             "the FA3 single-prefill last-wave split", "the last wave runs unsplit", single_prefill_run_problem),
    Coupling("paged_run_direct", "BatchPrefillWithPagedKVCacheWrapper.run's call of its module's paged_run "
             "(argument order, log2 LSE)",
             "planned paged runs and one-shot decode without the wrapper's per-call Python",
             "runs go through the wrapper's run", paged_run_problem),
]
