"""Plans: FlashInfer's plan/run split for a variant. A plan validates and plans a batch layout once (the block
lowerings of masks beyond a band included: FA3's tile list, FA2's block form, trimmed decode pages), then runs it per
layer; one-shot calls keep theirs in a plan cache (fivar.runtime.attention)."""
from __future__ import annotations

import types

import torch

from ..codegen import fa2
from ..codegen.tile_list import runs_unmapped
from ..errors import FivarError
from ..jit.build import DTYPES, HEAD_DIMS, module_for
from ..jit.module_key import ModuleKey
from ..jit.targets import AUTO, FA2, named, runs_twin, target_of
from ..spec.inputs import check_lse
from .fp8_kv import ScaledArgs, check_q_dtype, check_scale, fp8_backend, plan_kv_dtype, scaled_output
from .plan_handles import register_plan
from . import fa2_blocks, mixed, segments
from .segments import mask_scan
from .custom_mask import causal_implied, check_custom_mask, paged_kv_lens
from .fa3_tile_list import TileListPrefill
from .launch import (_check_indptr, _check_pages, _check_qkv, _module, _paged_kv, _prepare, direct_paged_run,
                     release_wrapper, take_wrapper)
from .params import kernel_args
from .position_tables import max_lengths
from .rows import write_rows
from .forms import (_check_backend, _causal_flag, _paged_args, _window_left, _owns_mask, _kernel_causal,
                    _plan_causal, _split_kwargs, _decode_on_tensor_cores, trims_decode_pages, _trimmed_decode_pages)


class _OwnsWrapper:
    """A plan running one FlashInfer wrapper, taken with fivar.runtime.launch.take_wrapper."""

    kv_form = "paged"  # run(q, paged_kv_cache); fivar.runtime.ops' plan_run passes the caches as one pair
    _rest = None  # (wrapper, ScaledArgs) of a second launch writing the rows the first skips (fa2_blocks)
    _direct = (None, None)  # DirectPagedRun of the wrapper and of _rest's (a paged plan's; None: wrapper.run)
    _tiles = None  # the tile-list form of a paged plan, FA2 or FA3 (fivar.runtime.fa3_tile_list), which then runs it all
    _mixed = None  # a paged batch of short and long requests as two plans (fivar.runtime.mixed), which run it all

    def release(self):
        """Hand the wrapper on (the one-shot plan cache, on dropping this plan); the plan is unusable after."""
        for whole in (self._tiles, self._mixed):
            if whole is not None:
                whole.release()
                return
        release_wrapper(*self._release, self._wrapper)
        if self._rest is not None:
            release_wrapper(*self._release, self._rest[0])
        self._wrapper = self._rest = None
        self._direct = (None, None)

    def run(self, q, paged_kv_cache, *, return_lse=False, k_scale=None, v_scale=None):
        """A paged plan's run (decode's and paged prefill's; a ragged plan has its own). k_scale/v_scale: the cache
        holds k / k_scale and v / v_scale (an FP8 cache: fivar.runtime.fp8_kv)."""
        if torch.compiler.is_compiling():
            from . import ops
            _no_scales_compiled(self.variant, k_scale, v_scale)
            return ops.plan_run(self, q, *_paged_kv(self.variant, paged_kv_cache), return_lse)
        return_lse = check_lse(self.variant, return_lse)
        k_scale, v_scale = _run_scales(self, q, paged_kv_cache, k_scale, v_scale)
        k_cache, v_cache = _paged_kv(self.variant, paged_kv_cache)
        hq, hkv, d, page, dtype = self._shape
        if q.shape[1:] != (hq, d) or k_cache.shape[1:] != (page, hkv, d) or q.dtype != dtype:
            raise FivarError(f"variant '{self.variant.name}': inputs do not match the plan (q [*, {hq}, {d}], "
                             f"cache [*, {page}, {hkv}, {d}], {dtype}); got q {tuple(q.shape)}, cache "
                             f"{tuple(k_cache.shape)}, {q.dtype}")
        return scaled_output(self._launch(q, k_cache, v_cache, k_scale, return_lse), v_scale, return_lse)

    def _launch(self, q, k_cache, v_cache, k_scale: float, return_lse: bool, into=None):
        """The kernels, on inputs checked against the plan (by run, or by a one-shot call's key). `into`: (out, lse)
        to write where the launch can take them (a direct run of one launch); the result says where it went."""
        if self._tiles is not None:
            return self._tiles.run(q, k_cache, v_cache, return_lse, k_scale)
        if self._mixed is not None:
            return self._mixed.run(q, k_cache, v_cache, k_scale, return_lse)
        direct, rest_direct = self._direct
        result = _launch_one(direct, self._wrapper, self._args, q, k_cache, v_cache, k_scale, return_lse,
                             into if self._rest is None else None)
        if self._rest is not None:  # the blocks the first launch skipped: their rows, written over theirs
            wrapper, args = self._rest
            part = _launch_one(rest_direct, wrapper, args, q.index_select(0, self._rest_rows), k_cache, v_cache,
                               k_scale, return_lse)
            write_rows(result, self._rest_rows, part, return_lse)
        return result

    def invalidate(self):
        """Plan again from the current contents of the tensors this plan was made from (its indptrs, page table and
        tensor params): a plan reads them when it is made, so after writing any of them in place, call this (or make
        a new plan). The object stays the one to run (a torch.compile graph keeps its handle). If the new contents
        are refused, the plan stays as it was."""
        remake = self.__dict__.get("_remake")
        if remake is None:
            raise FivarError(f"variant '{self.variant.name}': only a plan of plan_ragged / plan_paged / plan_decode "
                             "can be planned again")
        fresh = remake()  # first: a refusal leaves this plan whole
        handle = self.op_handle
        self.release()
        self.__dict__.clear()
        self.__dict__.update(fresh.__dict__)
        self.op_handle, self._remake = handle, remake


def explicit_plan(make):
    """The plan `make()` returns (v.plan_ragged / plan_paged / plan_decode), which keeps `make` for invalidate()."""
    plan = make()
    plan._remake = make
    return plan


def _launch_one(direct, wrapper, args, q, k_cache, v_cache, k_scale: float, return_lse: bool, into=None):
    """One wrapper's launch: its direct run where it has one (fivar.flashinfer_compat.wrappers.DirectPagedRun), else its run."""
    if direct is not None:
        return direct(q, k_cache, v_cache, args(k_scale), return_lse, into)
    return wrapper.run(q, (k_cache, v_cache), *args(k_scale), return_lse=return_lse)


class DecodePlan(_OwnsWrapper):
    """The CUDA-core decode kernel, planned (the one-shot `batch_decode` keeps one per batch layout)."""

    def __init__(self, variant, kv_indptr, kv_indices, kv_last_page_len, *, num_qo_heads, num_kv_heads, head_dim,
                 page_size, dtype, sm_scale, device, params, kv_dtype=None):
        register_plan(self)
        self.variant = variant
        kv_name = plan_kv_dtype(variant, dtype, kv_dtype)
        self._kv_dtype = kv_dtype or dtype
        probe = torch.empty(1, num_qo_heads, head_dim, dtype=dtype, device=device)
        bound, sm_scale = _prepare(variant, params, probe, num_kv_heads, kv_indptr.numel() - 1, sm_scale)
        fmod = module_for(variant, ModuleKey("batch_decode", "fa2", dtype, head_dim, kv_dtype=kv_name))
        self._wrapper = take_wrapper("decode", fmod, device, owns_mask=bool(variant.mask))
        self._release = ("decode", fmod, device)
        self._wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                           q_data_type=dtype, kv_data_type=self._kv_dtype, o_data_type=dtype)
        self._args = ScaledArgs(lambda s: kernel_args(
            variant, bound, s, False if variant.mask else None,
            lengths=lambda: max_lengths(None, kv_indptr, kv_last_page_len, page_size)), sm_scale)
        self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)


def _no_scales_compiled(variant, k_scale, v_scale) -> None:
    # the plan_run op takes no scales; the one-shot entry points fold them in under torch.compile
    if k_scale is not None or v_scale is not None:
        raise FivarError(f"variant '{variant.name}': a plan's run(k_scale=, v_scale=) is not supported under "
                         "torch.compile; call v.decode / v.batch_prefill_paged with the scales instead")


def _run_scales(plan, q, paged_kv_cache, k_scale, v_scale) -> tuple[float, float]:
    """A planned run's scales, checked, and its cache's dtype against the plan's."""
    variant = plan.variant
    check_q_dtype(variant, q)
    k_cache, _ = _paged_kv(variant, paged_kv_cache)
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype != plan._kv_dtype:
        raise FivarError(f"variant '{variant.name}': the cache is {k_cache.dtype}, the plan was made for "
                         f"{plan._kv_dtype} (plan with kv_dtype={k_cache.dtype})")
    return check_scale(variant, "k_scale", k_scale), check_scale(variant, "v_scale", v_scale)


def decode_plan(variant, kv_indptr, kv_indices, kv_last_page_len, *, num_qo_heads, num_kv_heads, head_dim, page_size,
                dtype=None, sm_scale=None, backend="auto", device="cuda", params=None, kv_dtype=None):
    """What `batch_decode` runs, planned once: FA2's tensor-core paged kernel (one query per request; pages trimmed
    to the kept keys where the mask drops some) or its CUDA-core decode kernel, chosen as batch_decode chooses.
    backend="auto" is FA2 here, as for batch_decode: FA3's prefill kernel is no decode kernel."""
    backend = "fa2" if backend == "auto" else backend
    backend = fp8_backend(variant, backend, plan_kv_dtype(variant, dtype or torch.bfloat16, kv_dtype))
    if not isinstance(kv_indptr, torch.Tensor):  # its length and device are read next: named here, not a traceback
        _check_indptr(variant, "kv_indptr", kv_indptr, device)
    qo_indptr = torch.arange(kv_indptr.numel(), dtype=torch.int32, device=kv_indptr.device)
    t = named(backend)  # the CUDA-core decode kernel is FA2's: FA3 has none, the twin no plan step
    if t is None or not (t.is_flashinfer and t.decodes) or trims_decode_pages(variant) or \
            _decode_on_tensor_cores(variant, num_qo_heads, num_kv_heads):
        return PagedAttentionPlan(variant, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                  num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  page_size=page_size, dtype=dtype, kv_dtype=kv_dtype, causal=False, sm_scale=sm_scale,
                                  backend=backend, device=device, params=params or {})
    checked = types.SimpleNamespace()  # the planned entry points' checks, then the decode kernel's own plan
    dtype, _, kv_indptr = _plan_setup(checked, variant, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim,
                                      dtype, backend, device)
    kv_indices, kv_last_page_len = _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len, 1 << 62, page_size,
                                                checked.device)
    return DecodePlan(variant, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads=num_qo_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, dtype=dtype,
                      sm_scale=sm_scale, device=checked.device, params=params or {}, kv_dtype=kv_dtype)


def refuse_custom_mask(variant, target: str, kv_name) -> None:
    """A custom mask runs on FA2's and FA3's tile-list forms (bits) and the Triton twin; an FP8 cache (FA2's
    block form, which reads no bits) refuses it."""
    if kv_name is not None:
        raise FivarError(f"variant '{variant.name}': custom_mask runs on a bf16/fp16 cache (backends 'fa2', 'fa3', "
                         f"'triton'); an FP8 cache ({target_of(target).label}'s block form) does not take it")


def verify_target(target: str, backend: str, qo_lens: torch.Tensor, head_dim: int) -> str:
    """The target of a batch with a custom mask: with backend auto, FA2 where every request's queries fill at most a
    quarter of FA3's query tile. FA3 gives each query head of a request a tile of block_rows(head_dim) rows of its
    own; FA2's tile packs a GQA group's rows, so a verify step of a few drafts a request wastes little of it. The
    quarter is where FA2 won at GQA 32/8 (docs/serving.md); with no group to pack FA2 still picks a 16-row tile."""
    if backend != AUTO or target_of(target).packs_query_heads or qo_lens.numel() == 0:
        return target
    return FA2.name if bool(mixed.short_requests(qo_lens, head_dim).all()) else target


def tile_list_form(variant, target: str, one_query: bool = False, kv_dtype: str | None = None) -> bool:
    """Whether a batch of a mask beyond a band runs in the tile-list form (fivar.runtime.fa3_tile_list): always on
    FA3; on FA2 but for a batch of one query a request (decode's forms: trimmed pages, else the block form; the
    tile list where trimming would read the gaps between many runs, PagedAttentionPlan) and an FP8 cache (the block
    form, fivar.runtime.fa2_blocks: the tile-list module reads q's dtype)."""
    return variant.scans_mask and (target_of(target).tile_lists_every_mask or (not one_query and kv_dtype is None))


def _plan_setup(plan, variant, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim, dtype, backend,
                device):
    """The planned entry points' shared checks; sets plan.variant, .device, .target and .batch."""
    dtype = dtype or torch.bfloat16
    if dtype not in DTYPES.values():
        raise FivarError(f"variant '{variant.name}': dtype must be float16 or bfloat16, got {dtype}")
    if head_dim not in HEAD_DIMS or num_qo_heads % num_kv_heads:
        raise FivarError(f"variant '{variant.name}': head_dim must be one of {HEAD_DIMS} and num_qo_heads a "
                         f"multiple of num_kv_heads (got {head_dim}, {num_qo_heads}/{num_kv_heads})")
    plan.variant, plan.device = variant, torch.device(device)
    if runs_twin(backend):
        raise FivarError(f"variant '{variant.name}': a plan holds FlashInfer's planned kernels (fa2, fa3); the Triton "
                         f"twin has no plan step: call batch_prefill_ragged / decode with backend='triton' instead")
    if plan.device.type != "cuda" or not torch.cuda.is_available():
        raise FivarError(f"variant '{variant.name}': a plan runs FlashInfer's kernels on a CUDA GPU (device "
                         f"{str(plan.device)!r}{'' if torch.cuda.is_available() else ', and no GPU is visible'}); on "
                         f"the CPU use variant.reference(...), or the Triton twin (backend='triton') under "
                         f"TRITON_INTERPRET=1")
    plan.target = _check_backend(variant, backend, "batch_prefill", plan.device)
    qo_indptr = _check_indptr(variant, "qo_indptr", qo_indptr, plan.device)
    kv_indptr = _check_indptr(variant, "kv_indptr", kv_indptr, plan.device)
    plan.batch = qo_indptr.numel() - 1
    return dtype, qo_indptr, kv_indptr


class PagedAttentionPlan(_OwnsWrapper):
    """A planned paged batch: validate and plan once per batch layout, then `run(q, cache)` per layer.

    This is FlashInfer's plan/run split. A batch of one query per request on FA2 (decode) whose mask drops
    whole pages reads only the pages holding kept keys (fivar.runtime.decode_pages; `pages_read`: kept and total),
    as at most two runs a request; a mask keeping more runs than that (global keys, a dilated pattern) runs in the
    tile-list form, over only the tiles holding kept keys.
    A mask that is more than a band runs one request per query tile over its non-empty key tiles, the tile-list
    form (fivar.runtime.fa3_tile_list), on either target; on FA2 a batch of one query a request, or an FP8 cache,
    one request per query block over the pages it may keep (fivar.runtime.fa2_blocks). `keys_read`: keys read and
    the unsplit form's. A custom mask (custom_mask or packed_custom_mask with mask_indptr,
    fivar.runtime.custom_mask) runs the tile-list form (FA2 or FA3) whatever the variant's mask, the custom bits
    ANDed into the block map and the tiles' bits, unless its bits add nothing to causal (a chain of drafts:
    custom_mask.causal_implied), which then runs as causal with no bits (`reads_custom_mask` False).
    """

    def __init__(self, variant, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, num_qo_heads,
                 num_kv_heads, head_dim, page_size, dtype=None, causal=False, sm_scale=None, backend="auto",
                 device="cuda", params=None, kv_dtype=None, custom_mask=None, packed_custom_mask=None,
                 mask_indptr=None):
        register_plan(self)
        kv_name = plan_kv_dtype(variant, dtype or torch.bfloat16, kv_dtype)  # an FP8 cache: fivar.runtime.fp8_kv
        backend = fp8_backend(variant, backend, kv_name)
        dtype, qo_indptr, kv_indptr = _plan_setup(self, variant, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads,
                                                  head_dim, dtype, backend, device)
        # no cache to bound the page numbers by here (run takes it): int32 is the bound
        kv_indices, kv_last_page_len = _check_pages(variant, kv_indptr, kv_indices, kv_last_page_len, 1 << 62,
                                                    page_size, self.device)
        qo_lens, kv_lens = qo_indptr.diff().cpu(), paged_kv_lens(kv_indptr, kv_last_page_len, page_size)
        custom = check_custom_mask(variant, custom_mask, packed_custom_mask, mask_indptr, qo_lens, kv_lens,
                                   self.device)
        if custom is not None:  # bits adding nothing to causal (a chain of drafts): the band form, no bits read
            implied = causal_implied(custom, qo_lens, kv_lens, _kernel_causal(variant, causal))
            if implied is not None:
                custom, causal = None, implied
        self.reads_custom_mask = custom is not None
        if custom is None and mixed.splits(variant, backend, self.target, qo_lens, head_dim):
            def part(*meta, backend, params):  # the call's own arguments, over the part's requests
                return PagedAttentionPlan(variant, *meta, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                                          head_dim=head_dim, page_size=page_size, dtype=dtype, causal=causal,
                                          sm_scale=sm_scale, backend=backend, device=self.device, params=params,
                                          kv_dtype=kv_dtype)
            self._mixed = mixed.MixedPaged(part, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, head_dim,
                                           self.target, variant, params)
            self._kv_dtype, self.pages_read, self.keys_read = kv_dtype or dtype, None, None
            self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
            return
        self.target = verify_target(self.target, backend, qo_lens, head_dim)  # short requests alone: FA2
        if custom is not None:
            refuse_custom_mask(variant, self.target, kv_name)
        one_query = bool((qo_indptr.diff() == 1).all())
        runs_segments = target_of(self.target).runs_key_segments  # FA2's trimmed pages and block forms
        if not (runs_segments and one_query and trims_decode_pages(variant)):  # that form keeps the call's
            # one query per request sits at its last key (decode): causal drops nothing there, and a window form
            # then runs as the kernels' own window (kCausal with window_left), as stock decode does
            causal = _kernel_causal(variant, causal) or (one_query and fa2.window_form(variant))
        self._kv_dtype = kv_dtype or dtype
        probe = torch.empty(1, num_qo_heads, head_dim, dtype=dtype, device=self.device)
        bound, sm_scale = _prepare(variant, params or {}, probe, num_kv_heads, self.batch, sm_scale)
        lengths = lambda q=qo_indptr, k=kv_indptr, p=kv_last_page_len: max_lengths(q, k, p, page_size)  # noqa: E731
        kv_segments, self.pages_read, self.keys_read = None, None, None
        self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
        trimmed = None
        if runs_segments and trims_decode_pages(variant) and one_query:
            # one query per request (decode): read only the pages holding kept keys, in the key-segments form
            trimmed = _trimmed_decode_pages(variant, bound, kv_indptr, kv_indices.to(self.device),
                                            kv_last_page_len.to(self.device), page_size, num_qo_heads, num_kv_heads)
        # more than two runs of kept pages a request: the hull's gaps cost more than the tile list's planning
        scattered = trimmed is not None and variant.scans_mask and kv_name is None and trimmed.tile_list_reads_less()
        if tile_list_form(variant, self.target, one_query, kv_name) or custom is not None or scattered:
            self._tiles = TileListPrefill(  # fivar.runtime.fa3_tile_list
                variant, qo_indptr, kv_indptr, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, dtype=dtype, causal=causal, bound=bound, sm_scale=sm_scale, device=self.device,
                pages=(kv_indices, page_size), kv_last_page_len=kv_last_page_len, target=self.target, custom=custom)
            self.keys_read = self._tiles.keys_read
            return
        block_causal, rest_segments = False, None  # FA2's block form: a kCausal launch, and a kCustom one for the rest
        if trimmed is not None:
            kv_indptr, kv_indices, kv_last_page_len = trimmed.kv_indptr, trimmed.kv_indices, trimmed.kv_last_page_len
            kv_segments = trimmed.segments
            self.pages_read = (trimmed.pages_read, trimmed.pages_total)
            block_causal = trimmed.causal  # one run of pages a request: kCausal (fivar.runtime.decode_pages)
        elif runs_segments and variant.scans_mask:
            # a mask that is more than a band: one request per query block over the keys it may keep
            kv_h, last_h = kv_indptr.long().cpu(), kv_last_page_len.long().cpu()
            n_pages = kv_h.diff()
            kv_lens = (n_pages - 1).clamp(min=0) * page_size + torch.where(n_pages > 0, last_h, 0)
            pages = kv_indices.long().cpu()
            rows = fa2_blocks.block_rows(num_qo_heads // num_kv_heads, head_dim)
            layout = fa2_blocks.block_layout(
                variant.ir.mask, qo_indptr, kv_lens, [pages[kv_h[b]:kv_h[b + 1]] for b in range(self.batch)],
                last_h, page_size, scalars=bound.scalars, tensors=bound.tensors, num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads, causal=causal, rows=rows, head_dim=head_dim,
                # KV blocks no longer than a block's rows: a block's first `rows` keys are masked in its kCausal launch
                kv_block=page_size * max(1, min(fa2_blocks.RAGGED_KV_BLOCK, rows) // page_size))
            block_causal = bool(layout.causal_mode.any())
            if layout.keys_read < layout.keys_total or block_causal:  # else the plain form is faster
                qo_indptr, kv_indptr = layout.qo_indptr.to(self.device), layout.kv_indptr.to(self.device)
                kv_indices, kv_last_page_len = layout.kv_indices, layout.kv_last_page_len
                kv_segments = layout.launch_table(block_causal)
                if block_causal and not bool(layout.causal_mode.all()):
                    rest_segments = layout.subset(~layout.causal_mode)
                self.keys_read = (layout.keys_read, layout.keys_total)
        fmod = _module(variant, ModuleKey("batch_prefill", self.target, dtype, head_dim,
                                          kv_segments=kv_segments is not None, kv_dtype=kv_name), bound, sm_scale)
        # trimmed pages: the kernel's positions are local, the window would be measured from the wrong key
        window_left = _window_left(variant, self.target, bound) if kv_segments is None else -1
        self._release = ("paged", fmod, self.device)
        planned = [t.to(self.device) for t in (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)]

        def launch(owns_mask: bool, plan_causal: bool, table, split: dict, indptrs=planned):
            wrapper = take_wrapper("paged", fmod, self.device, owns_mask)
            wrapper.plan(*indptrs, num_qo_heads, num_kv_heads, head_dim, page_size, causal=plan_causal,
                         window_left=window_left, q_data_type=dtype, kv_data_type=self._kv_dtype, o_data_type=dtype,
                         **split)
            args = ScaledArgs(lambda s: (kernel_args(variant, bound, s, _causal_flag(variant, self.target, causal),
                                                     tables={fa2.KV_SEGMENTS: table.to(self.device)},
                                                     lengths=lengths)
                                         if table is not None else
                                         _paged_args(variant, self.target, bound, s, causal, qo_indptr, kv_indptr,
                                                     kv_last_page_len, page_size)), sm_scale)
            return wrapper, args

        if block_causal:  # kCausal over every row: the blocks it can run (fa2_blocks), or trimmed decode pages
            self._wrapper, self._args = launch(False, True, kv_segments, _split_kwargs(variant, "fa2", True))
            if rest_segments is not None:  # then kCustom over copies of the other blocks' rows, written over theirs
                sub, rows = rest_segments
                self._rest = launch(True, False, sub.segments, _split_kwargs(variant, "fa2", True), indptrs=[
                    t.to(self.device) for t in (sub.qo_indptr, sub.kv_indptr, sub.kv_indices, sub.kv_last_page_len)])
                self._rest_rows = rows.to(self.device)
        else:  # the blocks apply causal themselves: FA3's would align the diagonal to each block
            self._wrapper, self._args = launch(
                _owns_mask(variant, self.target, causal, window_left),
                _plan_causal(variant, self.target, causal, window_left), kv_segments,
                _split_kwargs(variant, self.target, causal, window_left))
        self._direct = tuple(None if launched is None else
                             direct_paged_run(launched[0], variant.name, self.device, args=launched[1](1.0))
                             for launched in ((self._wrapper, self._args), self._rest))
        self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)


class RaggedAttentionPlan(_OwnsWrapper):
    """A planned ragged batch (`v.plan_ragged`): plan once per batch layout, then `run(q, k, v)` per layer.

    For a mask that is more than a band, planning is where the block lowering happens: the tile-list form (the
    device block map, fivar.runtime.fa3_tile_list), on FA2 after the segments form where a causal batch's mask cuts
    it into documents (fivar.runtime.segments).
    """

    kv_form = "ragged"  # run(q, k, v)

    def __init__(self, variant, qo_indptr, kv_indptr, *, num_qo_heads, num_kv_heads, head_dim, dtype=None,
                 causal=False, sm_scale=None, backend="auto", device="cuda", params=None):
        register_plan(self)
        dtype, qo_indptr, kv_indptr = _plan_setup(self, variant, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads,
                                                  head_dim, dtype, backend, device)
        causal = _kernel_causal(variant, causal)
        if kv_indptr.numel() != qo_indptr.numel():
            raise FivarError(f"variant '{variant.name}': qo_indptr and kv_indptr must have the same length")
        self._tokens = (int(qo_indptr[-1]), int(kv_indptr[-1]))
        probe = torch.empty(1, num_qo_heads, head_dim, dtype=dtype, device=self.device)
        bound, sm_scale = _prepare(variant, params or {}, probe, num_kv_heads, self.batch, sm_scale)
        self._shape = (num_qo_heads, num_kv_heads, head_dim, dtype)
        self._tile_list = None
        self.segments = None  # the segments form: how many requests it runs
        if variant.scans_mask and (target_of(self.target).runs_key_segments or runs_unmapped(variant)) \
                and self._plan_segments(variant, bound, sm_scale, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads,
                                        head_dim, dtype, causal):
            return
        if tile_list_form(variant, self.target):
            self._tile_list = TileListPrefill(
                variant, qo_indptr, kv_indptr, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, dtype=dtype, causal=causal, bound=bound, sm_scale=sm_scale, device=self.device,
                target=self.target)
            return
        fmod = _module(variant, ModuleKey("batch_prefill", self.target, dtype, head_dim), bound, sm_scale)
        window_left = _window_left(variant, self.target, bound)
        self._wrapper = take_wrapper("ragged", fmod, self.device,
                                     _owns_mask(variant, self.target, causal, window_left))
        self._release = ("ragged", fmod, self.device)
        self._wrapper.plan(qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim,
                           causal=_plan_causal(variant, self.target, causal, window_left),
                           window_left=window_left, q_data_type=dtype,
                           kv_data_type=dtype, o_data_type=dtype,
                           **_split_kwargs(variant, self.target, causal, window_left))
        self._args = kernel_args(variant, bound, sm_scale, _causal_flag(variant, self.target, causal),
                                 lengths=lambda: max_lengths(qo_indptr, kv_indptr))

    def _plan_segments(self, variant, bound, sm_scale, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim,
                       dtype, causal) -> bool:
        """Causal: when the mask cuts the batch into segments (documents, chunks), a request of FlashInfer's ragged
        kernel per segment in kCausal mode (fivar.runtime.segments), as stock FlashInfer runs documents, no mask
        evaluated: on FA2 the struct's key segments map each request back to its positions; on FA3 the mask-free
        kernel of the logits (bits_kernel), which reads no position (runs_unmapped). False when the mask is more
        than that on this batch, or the call is not causal."""
        if not causal:
            return False
        fa2_form = target_of(self.target).runs_key_segments
        max_qo_len = int(qo_indptr.diff().max()) if qo_indptr.numel() > 1 else 0
        _, kind, runs = mask_scan(variant, bound, qo_indptr, kv_indptr, max_qo_len, num_qo_heads, num_kv_heads,
                                  sm_scale, self.device)
        if kind != 1:
            return False
        layout = segments.segment_layout(runs, qo_indptr, kv_indptr)
        if layout is None:
            return False
        tables = {fa2.KV_SEGMENTS: layout.segments.to(self.device)} if fa2_form else None
        fmod = _module(variant, ModuleKey("batch_prefill", self.target, dtype, head_dim, kv_segments=fa2_form,
                                          mask_free=True), bound, sm_scale)
        self._wrapper = take_wrapper("ragged", fmod, self.device, False)
        self._release = ("ragged", fmod, self.device)
        self._wrapper.plan(layout.qo_indptr.to(self.device), layout.kv_indptr.to(self.device), num_qo_heads,
                           num_kv_heads, head_dim, causal=True, q_data_type=dtype, kv_data_type=dtype,
                           o_data_type=dtype, **_split_kwargs(variant, self.target, True))
        self._args = kernel_args(fmod.kernel_variant, bound, sm_scale, None,  # kCausal is the whole mask
                                 tables=tables, lengths=lambda: max_lengths(qo_indptr, kv_indptr))
        self.segments = layout.qo_indptr.numel() - 1
        return True

    def run(self, q, k, v, *, return_lse=False):
        if torch.compiler.is_compiling():
            from . import ops
            return ops.plan_run(self, q, k, v, return_lse)
        return_lse = check_lse(self.variant, return_lse)
        _check_qkv(self.variant, q, k, v)
        hq, hkv, d, dtype = self._shape
        if (q.shape[0], k.shape[0]) != self._tokens or q.shape[1:] != (hq, d) or k.shape[1:] != (hkv, d) \
                or q.dtype != dtype or k.dtype != dtype:
            raise FivarError(f"variant '{self.variant.name}': inputs do not match the plan (q [{self._tokens[0]}, "
                             f"{hq}, {d}], k/v [{self._tokens[1]}, {hkv}, {d}], {dtype}); got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, {q.dtype}")
        if self._tile_list is not None:
            return self._tile_list.run(q, k, v, return_lse=return_lse)
        return self._wrapper.run(q, k, v, *self._args, return_lse=return_lse)

    def release(self):
        if self._tile_list is not None:
            self._tile_list.release()
            return
        _OwnsWrapper.release(self)
