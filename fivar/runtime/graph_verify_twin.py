"""The Triton twin's CUDA-graph verify plan (backend="triton" of `plan_paged(..., cuda_graph=True)`): the same
contract as fivar.runtime.graph_verify's GraphVerifyPlan, over the twin's device-tensor launch."""
from __future__ import annotations

import torch

from ..errors import FivarError
from ..jit.build import DTYPES
from ..spec.inputs import check_lse
from . import position_tables
from .custom_mask import check_custom_mask, paged_kv_lens
from .graph_verify import _check_run, _check_step, _check_uniform, _limits, _refuse_step_mask
from .launch import _check_indptr, _check_pages, _paged_kv, _prepare
from .plan_handles import register_plan
from .rows import indptr


class TwinGraphVerifyPlan:
    """The Triton twin's verify step for CUDA graphs (backend="triton"): the twin's paged prefill reads its lengths,
    page table and custom mask through device tensors, so the graph holds one launch over max_batch requests and a
    grid of max_qo_len rows; `plan` writes the step into those tensors (a request past the step's has no queries and
    no keys: its programs return at once) and, for a mask beyond a band, the twin's block map of the step into fixed
    buffers. Runs on the CPU too under TRITON_INTERPRET=1 (float16), where there is nothing to capture."""

    kv_form = "paged"

    def __init__(self, variant, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, max_batch: int | None = None,
                 max_qo_len: int | None = None, max_pages: int | None = None, dtype=None, causal: bool = False,
                 sm_scale=None, device="cuda", params=None, kv_dtype=None, custom_mask=None, packed_custom_mask=None,
                 mask_indptr=None, uniform_qo_len: bool = False):
        import os
        from ..codegen.triton import kernel_arg_values
        from ..jit.triton_module import load_triton_module
        from .triton_attention import TRITON_HEAD_DIMS
        register_plan(self)
        self.variant, self.device = variant, torch.device(device)
        name = variant.name
        dtype = dtype or torch.bfloat16
        interpreted = self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if dtype not in DTYPES.values() or (kv_dtype is not None and kv_dtype != dtype) or \
                (interpreted and dtype != torch.float16):
            raise FivarError(f"variant '{name}': the twin's verify plan runs float16 or bfloat16 with the cache in q's "
                             f"dtype (float16 on the CPU), got {dtype}{f' and a {kv_dtype} cache' if kv_dtype else ''}")
        if head_dim not in TRITON_HEAD_DIMS or num_qo_heads % num_kv_heads:
            raise FivarError(f"variant '{name}': head_dim must be one of {TRITON_HEAD_DIMS} and num_qo_heads a multiple "
                             f"of num_kv_heads (got {head_dim}, {num_qo_heads}/{num_kv_heads})")
        if not (interpreted or (self.device.type == "cuda" and torch.cuda.is_available())):
            raise FivarError(f"variant '{name}': a CUDA-graph verify plan needs a CUDA GPU (device "
                             f"{str(self.device)!r}; the twin runs on the CPU under TRITON_INTERPRET=1)")
        qo_h = _check_indptr(variant, "qo_indptr", qo_indptr, "cpu")
        kv_h = _check_indptr(variant, "kv_indptr", kv_indptr, "cpu")
        max_batch, max_qo_len, max_pages = _limits(variant, qo_h, kv_h, max_batch, max_qo_len, max_pages)
        self.max_batch, self.max_qo_len, self.max_pages = max_batch, max_qo_len, max_pages
        self.max_tokens, self._max_kv = max_batch * max_qo_len, max_pages * page_size
        self._shape = (num_qo_heads, num_kv_heads, head_dim, page_size, dtype)
        probe = torch.empty(1, num_qo_heads, head_dim, dtype=dtype, device=self.device)
        bound, sm_scale = _prepare(variant, params or {}, probe, num_kv_heads, max_batch, sm_scale)
        bound = position_tables.bind(variant, bound, (max_qo_len, self._max_kv))
        self._causal = bool(causal)
        self._module = load_triton_module(variant)
        self._args = kernel_arg_values(variant, bound, sm_scale)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.qo_indptr = torch.zeros(max_batch + 1, **i32)
        self.kv_indptr = torch.zeros(max_batch + 1, **i32)  # the requests' key counts, as an indptr
        self.page_indptr = torch.zeros(max_batch + 1, **i32)
        self.kv_indices = torch.zeros(max_pages, **i32)
        # each request's bits from a byte of its own: sum ceil(qo * kv / 8) <= max_qo_len * keys / 8 + max_batch
        self.mask = torch.zeros(max_qo_len * self._max_kv // 8 + max_batch, dtype=torch.uint8, device=self.device)
        self.mask_indptr = torch.zeros(max_batch + 1, **i32)
        self._rows = torch.arange(self.max_tokens, device=self.device)
        self._uniform = _check_uniform(variant, uniform_qo_len)  # checked on each step; the grid is the same
        self._map = None  # the block map's fixed buffers (a mask beyond a band)
        self._used = (0, 0)  # mask bytes and cut tiles the last step wrote
        self.batch = 0
        self.maskless = all(m is None for m in (custom_mask, packed_custom_mask, mask_indptr))
        self.plan(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask=custom_mask,
                  packed_custom_mask=packed_custom_mask, mask_indptr=mask_indptr)

    @property
    def page_size(self) -> int:
        return self._shape[3]

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, custom_mask=None, packed_custom_mask=None,
             mask_indptr=None) -> None:
        """This step's lengths, page table and custom mask, written into the plan's tensors (outside the graph)."""
        from .custom_mask import mask_indptr_for
        v, name = self.variant, self.variant.name
        if self.maskless:
            _refuse_step_mask(v, (custom_mask, packed_custom_mask, mask_indptr))
        qo, kv = _check_step(v, qo_indptr, kv_indptr, self.max_batch, self.max_qo_len, self.max_pages,
                             self._uniform)
        batch, pages = qo.numel() - 1, int(kv[-1])
        page_size = self.page_size
        kv_indices, last = _check_pages(v, kv, kv_indices, kv_last_page_len, 1 << 62, page_size, self.device)
        kv_lens = paged_kv_lens(kv, last, page_size)
        custom = check_custom_mask(v, custom_mask, packed_custom_mask, mask_indptr, qo.diff(), kv_lens, self.device)
        pad = self.max_batch - batch  # padding requests: no queries, no keys, no pages, no mask bytes
        mask_ind = mask_indptr_for(qo.diff(), kv_lens)
        n_bytes = int(mask_ind[-1])

        def padded(t):
            return torch.cat([t.long(), t[-1:].long().expand(pad)]).to(torch.int32)
        self.qo_indptr.copy_(padded(qo))
        self.kv_indptr.copy_(padded(indptr(kv_lens)))
        self.page_indptr.copy_(padded(kv))
        self.kv_indices[:pages].copy_(kv_indices[:pages])
        self.kv_indices[pages:].zero_()
        self.mask_indptr.copy_(padded(mask_ind))
        if custom is None:  # every pair kept: the mask and causal decide
            self.mask[:n_bytes].fill_(0xFF)
        else:
            self.mask[:n_bytes].copy_(custom.packed[:n_bytes])
        self.mask[n_bytes:self._used[0]].zero_()
        n_cut = self._used[1]
        if hasattr(self._module, "block_map"):  # the twin's map of the step, at the plan's grid
            hq, hkv = self._shape[:2]
            fresh = self._module.block_map(self.qo_indptr, self.kv_indptr, self.max_qo_len, self._max_kv, hq,
                                           hq // hkv, self._causal, self._args)
            if self._map is None:  # the map's shapes follow from the plan's grid; its cut tiles are bounded by
                # max(1, ceil(kv / keys)) a row of tiles, as the tile list's (capacity)
                heads, n_q = fresh.tiles.shape[1:3]
                cap = heads * n_q * (self._max_kv // fresh.block[1] + self.max_batch)
                self._map = fresh._replace(**{f: getattr(fresh, f).clone() for f in ("tiles", "counts", "slots",
                                                                                    "kinds")},
                                           bits=fresh.bits.new_zeros(cap, fresh.block[0]))
            n_cut = fresh.bits.shape[0]
            if n_cut > self._map.bits.shape[0]:  # bounded as graph_verify.capacity bounds the tile list's
                raise FivarError(f"variant '{name}': this step's block map has {n_cut} cut tiles, the plan's buffer "
                                 f"{self._map.bits.shape[0]} (a fivar bug)")
            for field in ("tiles", "counts", "slots", "kinds"):
                getattr(self._map, field).copy_(getattr(fresh, field))
            self._map.bits[:n_cut].copy_(fresh.bits)
            self._map.bits[n_cut:self._used[1]].zero_()
        self._used, self.batch = (n_bytes, n_cut), batch

    def run(self, q, paged_kv_cache, *, return_lse: bool = False):
        """As GraphVerifyPlan.run: q [max_batch * max_qo_len, Hq, D], the step's tokens first; zeros past them."""
        from .triton_attention import _check_inputs
        if torch.compiler.is_compiling():  # under torch.compile: the plan_run custom op (fivar.runtime.ops)
            from . import ops
            return ops.plan_run(self, q, *_paged_kv(self.variant, paged_kv_cache), return_lse)
        return_lse = check_lse(self.variant, return_lse)
        k_cache, v_cache = _paged_kv(self.variant, paged_kv_cache)
        _check_inputs(self.variant, q, k_cache, v_cache, paged=True)
        _check_run(self, q, k_cache, check_kv_dtype=False)
        result = self._module.prefill(q, k_cache, v_cache, self.qo_indptr, self.kv_indptr, self.max_qo_len,
                                      self._causal, self._args, return_lse, plan=self._map,
                                      custom=(self.mask, self.mask_indptr),
                                      pages=(self.kv_indices, self.page_indptr, self._max_kv))
        past = self._rows >= self.qo_indptr[-1]  # rows no program writes: zeros, on the device (no sync)
        out, lse = result if return_lse else (result, None)
        out.masked_fill_(past[:, None, None], 0)
        if return_lse:
            lse.masked_fill_(past[:, None], 0)
        return result
