"""A fusion's JIT module: render csrc/fusion/*.cu.jinja, hash, and hand it to fivar.jit.build.FivarModule.

The module reuses all of fivar's build machinery (FlashInfer's gen_jit_spec + ninja under its file lock,
manifests, build records, the in-process cache, build_many): only the sources differ. The URI is
`fivar_<name>_fusion_<dtype>_hd<head_dim>_<hash12>` (hd0 for per-row fusions, whose row length is a
runtime size), hashed by the same helper as the attention modules.
"""
from __future__ import annotations

import functools

import jinja2

from ..errors import FivarError
from ..jit import toolchain
from ..jit.build import DTYPES, FivarModule, content_hash, uri_name
from ..paths import csrc_dir
from .spec import FusionSpec

NORM_ENUM = {None: "kNormNone", "rmsnorm": "kRMSNorm", "gemma": "kGemmaRMSNorm", "layernorm": "kLayerNorm"}
ROPE_ENUM = {None: "kRopeNone", "neox": "kRopeNeox", "gptj": "kRopeGptj"}
CTYPES = {"bf16": "nv_bfloat16", "fp16": "half"}
HEADER = "fivar_fusion.cuh"


@functools.lru_cache(maxsize=None)
def _env(directory: str) -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(directory), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def template_name(variant: FusionSpec) -> str:
    return "fusion_head.cu.jinja" if variant.is_head else "fusion_row.cu.jinja"


def render_sources(variant: FusionSpec, dtype: str | None = None) -> dict[str, str]:
    """file name -> text: the rendered kernel/binding source and the shared kernel header."""
    if not isinstance(variant, FusionSpec):
        raise FivarError(f"'{getattr(variant, 'name', variant)}' is not a fusion (fivar.FusionVariant)")
    dtype = dtype or variant.dtype
    if dtype not in CTYPES:
        raise FivarError(f"fusion '{variant.name}': dtype '{dtype}' is not supported (use one of {sorted(CTYPES)})")
    d = csrc_dir() / "fusion"
    text = _env(str(d)).get_template(template_name(variant)).render(
        name=variant.name, description=variant.describe(), dtype=dtype, ctype=CTYPES[dtype],
        head_dim=variant.head_dim or 0, rotary_dim=variant.rotary_dim or 0,
        norm=variant.norm is not None, layernorm=variant.norm == "layernorm", rope=variant.rope is not None,
        norm_enum=NORM_ENUM[variant.norm], rope_enum=ROPE_ENUM[variant.rope], residual=variant.residual,
        fp8=variant.fp8, computed_cos_sin=variant.cos_sin == "computed")
    return {f"fusion_{variant.name}.cu": text, HEADER: (d / HEADER).read_text()}


def gen_fusion_module(variant: FusionSpec, dtype: str | None = None) -> FivarModule:
    """The FivarModule of a fusion (not built yet: .build() / .load() / fivar.jit.build.build_many)."""
    sources = render_sources(variant, dtype)
    dtype = dtype or variant.dtype
    toolchain.ensure_arch_env()
    cuda_cflags: list[str] = []
    hd = variant.head_dim or 0
    uri = f"fivar_{uri_name(variant.name)}_fusion_{dtype}_hd{hd}_{content_hash(sources, cuda_cflags)}"
    return FivarModule(variant, "fusion", "fusion", dtype, hd, uri, sources, cuda_cflags, ())


_memo: dict[tuple, tuple] = {}


def fusion_module_for(variant: FusionSpec, dtype: str) -> FivarModule:
    """gen_fusion_module with a per-process memo (no re-rendering on the hot path)."""
    key = (id(variant), dtype)
    m = _memo.get(key)
    if m is None or m[0] is not variant:
        m = (variant, gen_fusion_module(variant, dtype))
        _memo[key] = m
    return m[1]


def dtype_of(t) -> str:
    for k, v in DTYPES.items():
        if v == t:
            return k
    raise FivarError(f"dtype {t} is not supported (use one of {sorted(DTYPES)})")
