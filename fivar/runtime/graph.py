"""Decode plans for CUDA graphs: fixed-capacity page-table buffers, re-planned outside the graph, replayed inside.

A CUDA graph replays kernel launches with the arguments they were captured with, so everything a decode step
reads that changes between steps has to sit at a fixed address: FlashInfer's `use_cuda_graph=True` wrappers take
preallocated indptr / indices / last-page-length buffers, and their `plan` copies each step's page table into them
(and its split-KV schedule into their workspace) on the host side of the graph. `GraphDecodePlan` holds one such
wrapper running the variant's module:

    plan = v.plan_decode(kv_indptr, kv_indices, kv_last_page_len, cuda_graph=True, max_batch=64, max_pages=4096,
                         num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)
    q = torch.empty(64, 32, 128, ...)              # static input: the graph reads this tensor
    out = plan.run(q, cache)                       # warm up (builds/loads the module) on the side
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = plan.run(q, cache)
    for step ...:
        plan.plan(kv_indptr, kv_indices, kv_last_page_len)   # new lengths and page table: outside the graph
        q.copy_(new_q)                                       # into the static input
        g.replay()                                           # out[:batch] holds this step's attention

Keep the plan alive as long as the graph may replay: the graph holds only the raw addresses of the plan's
buffers and workspaces. The graph's batch is `max_batch` rows: a step with fewer requests is padded with requests
of one key (page 0, whose output rows are ignored), as serving engines pad to a captured batch size. Params are
bound at plan creation: scalars are baked into the captured launch, tensor params are read through their pointers
(update them in place). Which kernel runs follows `decode`: the tensor-core paged kernel when a KV head serves >= 4
query heads (or without softmax), else FlashInfer's CUDA-core decode kernel.
"""
from __future__ import annotations

import torch

from ..errors import FivarError
from ..jit.build import DTYPES, HEAD_DIMS, module_for
from ..jit.module_key import ModuleKey
from ..jit.targets import runs_twin
from ..spec.inputs import check_lse
from ..codegen import fa2
from .attention import _decode_on_tensor_cores, _owns_mask, _paged_args, _split_kwargs, _window_left, choose_target
from .launch import _check_indptr, _integer, _module, _paged_kv, _prepare, _workspace, attach
from . import position_tables
from .plan_handles import register_plan
from .params import kernel_args


def _check_step_tensors(variant, kv_indices, kv_last_page_len) -> None:
    for arg, t in (("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
        if not (_integer(t) and t.dim() == 1):
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise FivarError(f"variant '{variant.name}': {arg} must be a 1-D int32 tensor, got {got}")


def check_graph_plan(variant, dtype, head_dim: int, num_qo_heads: int, num_kv_heads: int, device, what: str) -> None:
    """What every CUDA-graph plan of FlashInfer's kernels (`what`: decode, verify) needs: a float16/bfloat16 q, a head
    dim FlashInfer builds, whole GQA groups, and a CUDA GPU; else one line naming the variant."""
    name = variant.name
    if dtype not in DTYPES.values():
        raise FivarError(f"variant '{name}': dtype must be float16 or bfloat16, got {dtype}")
    if head_dim not in HEAD_DIMS or num_qo_heads % num_kv_heads:
        raise FivarError(f"variant '{name}': head_dim must be one of {HEAD_DIMS} and num_qo_heads a multiple of "
                         f"num_kv_heads (got {head_dim}, {num_qo_heads}/{num_kv_heads})")
    if device.type != "cuda" or not torch.cuda.is_available():
        raise FivarError(f"variant '{name}': a CUDA-graph {what} plan needs a CUDA GPU (device "
                         f"{str(device)!r}{'' if torch.cuda.is_available() else ', and none is visible'})")


class GraphDecodePlan:
    """Decode over a paged KV cache with buffers of fixed capacity (this module's docstring)."""

    kv_form = "paged"  # run(q, paged_kv_cache), as fivar.runtime.ops' plan_run calls it

    def __init__(self, variant, kv_indptr, kv_indices, kv_last_page_len, *, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, max_batch: int | None = None, max_pages: int | None = None,
                 dtype=None, sm_scale=None, backend: str = "auto", device="cuda", params=None):
        import flashinfer
        register_plan(self)
        self.variant, self.device = variant, torch.device(device)
        name = variant.name
        dtype = dtype or torch.bfloat16
        check_graph_plan(variant, dtype, head_dim, num_qo_heads, num_kv_heads, self.device, "decode")
        if runs_twin(backend):
            raise FivarError(f"variant '{name}': cuda_graph=True plans hold FlashInfer's kernels; the Triton twin "
                             "has no plan step (capture its decode directly, its launches take device tensors)")
        choose_target(variant, backend, "batch_decode", self.device)  # names fa3 (no decode kernel) and typos
        batch = _check_indptr(variant, "kv_indptr", kv_indptr, "cpu").numel() - 1
        _check_step_tensors(variant, kv_indices, kv_last_page_len)  # before any module is built
        self.max_batch = int(max_batch if max_batch is not None else batch)
        self.max_pages = int(max_pages if max_pages is not None else kv_indices.numel())
        if self.max_batch < 1 or self.max_pages < 1:
            raise FivarError(f"variant '{name}': max_batch and max_pages must be positive, got {self.max_batch}, "
                             f"{self.max_pages}")
        self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
        self.tensor_cores = _decode_on_tensor_cores(variant, num_qo_heads, num_kv_heads)  # as batch_decode chooses
        probe = torch.empty(1, num_qo_heads, head_dim, dtype=dtype, device=self.device)
        bound, sm_scale = _prepare(variant, params or {}, probe, num_kv_heads, self.max_batch, sm_scale)
        # replays change the lengths: position tables cover the capacity (fivar.runtime.position_tables)
        bound = position_tables.bind(variant, bound, (1, self.max_pages * page_size))
        # a window's left edge skips the pages left of it; other masks read every page (no trimming in a graph)
        self._window_left = _window_left(variant, "fa2", bound) if self.tensor_cores else -1
        # a decode query sits at its last key: causal drops nothing, and a window form runs as the kernel's window
        self._causal = self.tensor_cores and self._window_left >= 0 and fa2.window_form(variant)
        i32 = dict(dtype=torch.int32, device=self.device)
        self._kv_indptr = torch.zeros(self.max_batch + 1, **i32)
        self._kv_indices = torch.zeros(self.max_pages + self.max_batch, **i32)  # room for the padding requests
        self._last_page_len = torch.ones(self.max_batch, **i32)
        if self.tensor_cores:
            fmod = _module(variant, ModuleKey("batch_prefill", "fa2", dtype, head_dim), bound, sm_scale)
            self._qo_indptr = torch.arange(self.max_batch + 1, **i32)
            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                _workspace(self.device, "fa2"), kv_layout="NHD", use_cuda_graph=True, qo_indptr_buf=self._qo_indptr,
                paged_kv_indptr_buf=self._kv_indptr, paged_kv_indices_buf=self._kv_indices,
                paged_kv_last_page_len_buf=self._last_page_len, backend="fa2")
            self._args = _paged_args(variant, "fa2", bound, sm_scale, self._causal, self._qo_indptr, self._kv_indptr,
                                     self._last_page_len, page_size)
        else:
            fmod = module_for(variant, ModuleKey("batch_decode", "fa2", dtype, head_dim))
            self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                _workspace(self.device, "fa2"), kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=False,
                paged_kv_indptr_buffer=self._kv_indptr, paged_kv_indices_buffer=self._kv_indices,
                paged_kv_last_page_len_buffer=self._last_page_len, backend="fa2")
            self._args = kernel_args(variant, bound, sm_scale, False if variant.mask else None)
        attach(self._wrapper, fmod.load(), fmod, owns_mask=_owns_mask(variant, "fa2", self._causal, self._window_left)
                if self.tensor_cores else bool(variant.mask))
        self.batch = 0
        self.plan(kv_indptr, kv_indices, kv_last_page_len)

    @property
    def page_size(self) -> int:
        return self._shape[3]

    def plan(self, kv_indptr, kv_indices, kv_last_page_len) -> None:
        """This step's page table (host work and copies into the fixed buffers): call it outside the graph, before
        each replay. Up to max_batch requests and max_pages pages."""
        name = self.variant.name
        indptr = _check_indptr(self.variant, "kv_indptr", kv_indptr, "cpu").long()
        batch, pages = indptr.numel() - 1, int(indptr[-1])
        if batch > self.max_batch or pages > self.max_pages:
            raise FivarError(f"variant '{name}': this step has {batch} requests over {pages} pages; the plan was made "
                             f"for at most max_batch={self.max_batch} and max_pages={self.max_pages}")
        _check_step_tensors(self.variant, kv_indices, kv_last_page_len)
        # host copies in their own dtypes (an int64 entry past int32 would wrap into range), checked, then int32
        indices, last = kv_indices[:pages].cpu(), kv_last_page_len.cpu()
        if last.numel() != batch or (indices.numel() and not 0 <= int(indices.min()) <= int(indices.max()) < 2**31) \
                or bool((indptr.diff() < 1).any()) \
                or (batch and not (1 <= int(last.min()) and int(last.max()) <= self.page_size)):
            raise FivarError(f"variant '{name}': a decode step needs one kv_last_page_len per request (1..page_size), "
                             "at least one page per request and page numbers in 0..2**31-1")
        indices, last = indices.to(torch.int32), last.to(torch.int32)
        pad = self.max_batch - batch  # padding requests: one key each, in page 0; their rows are ignored
        indptr = torch.cat([indptr, pages + torch.arange(1, pad + 1)]).to(torch.int32)
        indices = torch.cat([indices, torch.zeros(pad, dtype=torch.int32)])
        last = torch.cat([last, torch.ones(pad, dtype=torch.int32)])
        hq, hkv, d, page_size, dtype = self._shape
        if self.tensor_cores:
            self._wrapper.plan(self._qo_indptr.cpu(), indptr, indices, last, hq, hkv, d, page_size,
                               causal=self._causal, window_left=self._window_left, q_data_type=dtype,
                               kv_data_type=dtype,
                               o_data_type=dtype, **_split_kwargs(self.variant, "fa2"))
        else:
            self._wrapper.plan(indptr, indices, last, hq, hkv, d, page_size, q_data_type=dtype, kv_data_type=dtype,
                               o_data_type=dtype)
        self.batch = batch

    def run(self, q, paged_kv_cache, *, return_lse: bool = False):
        """q [max_batch, Hq, D] (rows past this step's batch are padding); capture this call in the graph. Returns
        [max_batch, Hq, D] (and the LSE [max_batch, Hq] with return_lse)."""
        if torch.compiler.is_compiling():  # under torch.compile: the plan_run custom op (fivar.runtime.ops)
            from . import ops
            return ops.plan_run(self, q, *_paged_kv(self.variant, paged_kv_cache), return_lse)
        return_lse = check_lse(self.variant, return_lse)
        k_cache, v_cache = _paged_kv(self.variant, paged_kv_cache)
        hq, hkv, d, page, dtype = self._shape
        if q.shape != (self.max_batch, hq, d) or k_cache.shape[1:] != (page, hkv, d) or q.dtype != dtype \
                or k_cache.dtype != dtype:
            raise FivarError(f"variant '{self.variant.name}': inputs do not match the plan (q [{self.max_batch}, {hq}, "
                             f"{d}] (max_batch rows), cache [*, {page}, {hkv}, {d}], {dtype}); got q {tuple(q.shape)}, "
                             f"cache {tuple(k_cache.shape)}, {q.dtype}")
        return self._wrapper.run(q, (k_cache, v_cache), *self._args, return_lse=return_lse)
