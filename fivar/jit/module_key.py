"""What identifies a FlashInfer JIT module's form, the variant aside: one frozen value that a launch builds
(fivar.runtime.launch._module), the per-process memo keys on (fivar.jit.build.module_for), gen_module renders, and a
manifest records (`as_options`) and re-renders (`from_options`, fivar.jit.integrity). A new form is a field here
and its checks in `checked`, not a keyword threaded through every caller."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..codegen import fa3
from ..codegen.tile_list import runs_unmapped
from ..errors import FivarError
from ..flashinfer_layout import FA3_LAYOUT
from .targets import FA3, FLASHINFER_TARGETS, Target, target_of

OPS = ("single_prefill", "batch_prefill", "batch_decode")
TARGETS = FLASHINFER_TARGETS
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: KV-cache dtypes other than q's (FlashInfer's FA2 paged kernels read them and upcast in shared memory/registers);
#: the k/v scales are the runtime's (fivar.runtime.attention.fp8_scales).
KV_DTYPES = {"fp8e4m3": torch.float8_e4m3fn}
#: the ops that read a paged KV cache, so the only ones a KV dtype applies to
KV_DTYPE_OPS = ("batch_prefill", "batch_decode")
HEAD_DIMS = (64, 128, 256)

#: the fields that select a form beyond (op, target, dtype, head_dim), in the order a manifest lists them;
#: bounded_softmax is not among them: the manifest records it with the FA3 config it belongs to (manifest_options)
FORM_OPTIONS = ("kv_segments", "mask_free", "tile_list", "custom_mask", "kv_dtype")


def dtype_name(dt: torch.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dt:
            return k
    raise FivarError(f"dtype {dt} is not supported (use one of {sorted(DTYPES)})")


@dataclass(frozen=True)
class ModuleKey:
    """A module's form. `dtype` may be given as a torch dtype (stored as its name). `bounded_softmax`: FA3's
    bounded softmax (fivar.codegen.fa3.softmax_range) forced on or off; None: the config decides. `kv_segments`:
    FA2 batch prefill/decode over trimmed pages or query blocks, each key mapped back to its position
    (fivar.runtime.decode_pages, fivar.runtime.fa2_blocks); `mask_free`: that form with no mask (a causal batch of
    segments), or on FA3 alone, batch prefill of the variant's logits without its mask (the segments form,
    fivar.codegen.tile_list.runs_unmapped). `kv_dtype`: a KV cache of another dtype than q's (KV_DTYPES), FA2 paged
    ops only; None: q's dtype.
    `tile_list`: FA2 batch prefill of a mask in the tile-list form (fivar.codegen.fa2._tile_list_decl); on FA3 it
    follows from the variant, op and custom_mask (`checked`), and a given True is only checked. `custom_mask`: FA3
    batch prefill in the tile-list form whatever the mask, cut tiles read as bits (fivar.runtime.custom_mask)."""
    op: str = "single_prefill"
    target: str = "fa2"
    dtype: str = "bf16"
    head_dim: int = 128
    bounded_softmax: bool | None = None
    kv_segments: bool = False
    kv_dtype: str | None = None
    mask_free: bool = False
    tile_list: bool = False
    custom_mask: bool = False

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def kernels(self) -> Target:
        """The target this module is built for (fivar.jit.targets): what it can run and which forms it takes."""
        return target_of(self.target)

    @property
    def fa3(self) -> bool:
        """Built from FlashInfer's FA3 templates and layout (fivar.jit.build), else FA2's."""
        return self.kernels is FA3

    def replace(self, **changes) -> ModuleKey:
        return dataclasses.replace(self, **changes)

    def checked(self, variant) -> ModuleKey:
        """This key for `variant` with what follows from it resolved (FA3's tile-list form), or the one-line
        FivarError of an impossible combination."""
        name, op, target = variant.name, self.op, self.target
        if op not in OPS:
            raise FivarError(f"unknown op '{op}' (choose from {', '.join(OPS)})")
        if target not in TARGETS:
            raise FivarError(f"variant '{name}': target '{target}' is not available (have {TARGETS})")
        if self.dtype not in DTYPES:
            raise FivarError(f"dtype '{self.dtype}' is not supported (use one of {sorted(DTYPES)})")
        if self.head_dim not in HEAD_DIMS:
            raise FivarError(f"head_dim {self.head_dim} is not supported (use one of {HEAD_DIMS})")
        if self.kv_dtype is not None:
            if self.kv_dtype not in KV_DTYPES:
                raise FivarError(f"variant '{name}': kv_dtype '{self.kv_dtype}' is not supported (use one of "
                                 f"{sorted(KV_DTYPES)}, or None for q's dtype)")
            if not self.kernels.reads_fp8_kv or op not in KV_DTYPE_OPS:
                raise FivarError(f"variant '{name}': an FP8 KV cache runs on FA2's paged kernels (batch_prefill, "
                                 f"batch_decode); there is no {target} {op} module for it")
        if op == "batch_decode" and variant.sink is not None:  # its kernel calls no per-row hook (fivar.codegen.fa2)
            raise FivarError(f"variant '{name}': a sink runs decode on FA2 batch prefill; there is no "
                             "batch_decode module for it")
        if self.fa3 and op not in FA3_LAYOUT:
            raise FivarError(f"variant '{name}': FlashInfer has no FA3 kernel for {op}; use target fa2")
        t = self.kernels
        # every target reads a custom mask as bits of the listed tiles: batch prefill with q's dtype in the cache
        if self.custom_mask and (op != "batch_prefill" or self.kv_segments or self.kv_dtype or self.mask_free):
            raise FivarError(f"variant '{name}': the custom-mask form is FA2 or FA3 batch prefill in the tile-list form, "
                             f"with q's dtype in the cache")
        implied_tiles = self.custom_mask or (t.tile_lists_every_mask and fa3.uses_tile_list(variant, op)
                                             and not self.mask_free)
        if self.tile_list and not implied_tiles and (not t.keys_tile_list or op != "batch_prefill" or not variant.mask
                                                     or self.kv_segments or self.kv_dtype):
            raise FivarError(f"variant '{name}': tile_list=True asks for FA2 batch prefill of a mask in the "
                             f"tile-list form, with q's dtype in the cache (FA3's batch prefill takes it whenever the "
                             f"mask is more than a band); got {target} {op}")
        unmapped = t.tile_lists_every_mask and op == "batch_prefill" and not self.kv_segments and \
            variant.scans_mask and runs_unmapped(variant)
        if self.mask_free and not ((self.kv_segments and t.runs_key_segments) or unmapped):
            raise FivarError(f"variant '{name}': the mask-free form is FA2's key-segments form, or FA3 batch prefill "
                             "of a mask beyond a band keeping the same keys for every head, whose logits and sink read "
                             "no position or batch entry")
        # FA2 has no bounded softmax: a value given for it selects nothing (the FA2 config has no such field)
        resolved = self.replace(tile_list=self.tile_list or implied_tiles,
                                bounded_softmax=self.bounded_softmax if t.bounds_softmax else None)
        return resolved

    def uri_part(self) -> str:
        """What a module's URI says of its form (fivar.jit.build.gen_module: fivar_<name>_<this>_<content hash>)."""
        # (a custom mask's module is the bits-reading tile list every mask of the variant's logits shares)
        form = (("_kvsegfree" if self.mask_free and self.kv_segments else "_free" if self.mask_free
                 else "_kvseg" if self.kv_segments else "_tiles" if self.tile_list else "")
                + (f"_kv{self.kv_dtype}" if self.kv_dtype else ""))
        return f"{self.target}_{self.op}{form}_{self.dtype}_hd{self.head_dim}"

    def as_options(self) -> dict:
        """The form as a manifest's `options` record it: the fields set away from their defaults."""
        return {f: getattr(self, f) for f in FORM_OPTIONS if getattr(self, f)}

    @classmethod
    def from_options(cls, op: str, target: str, dtype: str, head_dim: int, options: dict) -> tuple[ModuleKey, dict]:
        """(key, rest): the key of gen_module's keyword options (or a manifest's `options`), and the options left,
        the target's config (fivar.jit.targets.Target.config_of)."""
        rest = dict(options)
        form = {f: rest.pop(f) for f in (*FORM_OPTIONS, "bounded_softmax") if f in rest}
        return cls(op, target, dtype, head_dim, **form), rest
