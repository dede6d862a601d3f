"""From a variant to a loaded FlashInfer JIT module.

One `gen_module(variant, op, target, dtypes, head_dim)` renders every source of the module, derives a
content-hashed URI from them (plus flags, FlashInfer/nvcc versions and target archs), writes them into
FlashInfer's generated-sources dir and returns a `FivarModule` wrapping FlashInfer's `JitSpec`. Building
runs FlashInfer's ninja under its file lock; loading goes through an in-process cache keyed by URI.
Since the URI covers everything that goes into the .so, an edited variant or a new toolchain gets a new
URI (never a stale library), and an unchanged one hits the existing build.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import torch

from ..codegen import fa2
from ..errors import FivarBuildError, FivarError
from ..paths import csrc_dir
from . import toolchain

OPS = ("single_prefill", "batch_prefill", "batch_decode")
TARGETS = ("fa2",)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HEAD_DIMS = (64, 128, 256)

#: Per op: FlashInfer's config template, kernel-instantiation templates (rendered per mask mode unless
#: the op has none), host sources, and the name the host sources include the config as.
_FA2_LAYOUT = {
    "single_prefill": ("single_prefill_customize_config.jinja", ["single_prefill_kernel_inst.jinja"],
                       ["single_prefill.cu", "single_prefill_jit_binding.cu"], "single_prefill_config.inc"),
    "batch_prefill": ("batch_prefill_customize_config.jinja",
                      ["batch_prefill_paged_kernel_inst.jinja", "batch_prefill_ragged_kernel_inst.jinja"],
                      ["batch_prefill.cu", "batch_prefill_jit_binding.cu", "batch_prefill_paged.cuh"],
                      "batch_prefill_config.inc"),
    "batch_decode": ("batch_decode_customize_config.jinja", ["batch_decode_kernel_inst.jinja"],
                     ["batch_decode.cu", "batch_decode_jit_binding.cu"], "batch_decode_config.inc"),
}

_loaded: dict[str, object] = {}  # URI -> loaded module (the in-process cache)


def dtype_name(dt: torch.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dt:
            return k
    raise FivarError(f"dtype {dt} is not supported (use one of {sorted(DTYPES)})")


@dataclass
class FivarModule:
    variant: object
    op: str
    target: str
    dtype: str
    head_dim: int
    uri: str
    sources: dict[str, str]  # file name -> content
    cuda_cflags: list[str]
    additional: tuple
    spec: object = field(default=None, repr=False)

    @property
    def gen_dir(self) -> Path:
        from flashinfer.jit import env as jit_env
        return jit_env.FLASHINFER_GEN_SRC_DIR / self.uri

    @property
    def build_dir(self) -> Path:
        from flashinfer.jit import env as jit_env
        return jit_env.FLASHINFER_JIT_DIR / self.uri

    @property
    def library_path(self) -> Path:
        return self.build_dir / f"{self.uri}.so"

    def jit_spec(self):
        if self.spec is None:
            from flashinfer.jit.core import gen_jit_spec
            self.gen_dir.mkdir(parents=True, exist_ok=True)
            for name, text in self.sources.items():
                _write_if_different(self.gen_dir / name, text)
            paths = [self.gen_dir / n for n in self.sources if n.endswith(".cu")]
            self.spec = gen_jit_spec(self.uri, paths, extra_cuda_cflags=self.cuda_cflags or None,
                                      extra_ldflags=toolchain.link_flags() or None)
        return self.spec

    @property
    def manifest_path(self) -> Path:
        return self.build_dir / "fivar_manifest.json"

    def manifest_ok(self) -> bool:
        """The library fivar recorded after its last successful build is still there, unchanged.

        Trusting this (instead of asking ninja) is safe because the URI already hashes every input.
        """
        try:
            man = json.loads(self.manifest_path.read_text())
            st = self.library_path.stat()
        except (OSError, ValueError):
            return False
        return man.get("uri") == self.uri and man.get("so_size") == st.st_size and \
            man.get("so_mtime_ns") == st.st_mtime_ns

    def write_manifest(self, seconds: float) -> None:
        st = self.library_path.stat()
        man = {"uri": self.uri, "variant": self.variant.name, "op": self.op, "target": self.target,
               "dtype": self.dtype, "head_dim": self.head_dim, "so_size": st.st_size,
               "so_mtime_ns": st.st_mtime_ns, "compile_seconds": round(seconds, 3),
               "flashinfer": toolchain.flashinfer_version(), "nvcc": toolchain.nvcc_version(),
               "arch": toolchain.arch_tag(), "created": time.time()}
        _write_if_different(self.manifest_path, json.dumps(man, indent=1))

    def build(self) -> str:
        """Compile if needed. Returns 'memory', 'disk' or 'cold' (what it took to get the library)."""
        if self.uri in _loaded:
            return "memory"
        if self.manifest_ok():
            return "disk"
        spec = self.jit_spec()
        from filelock import FileLock
        t0 = time.perf_counter()
        try:
            with FileLock(spec.lock_path, thread_local=False):
                if self.manifest_ok():  # another process finished it while we waited
                    return "disk"
                spec.build()
                self.write_manifest(time.perf_counter() - t0)
        except OSError as e:
            raise FivarError(f"variant '{self.variant.name}': cannot write the JIT cache at {self.build_dir} "
                             f"({e.strerror}); set FLASHINFER_WORKSPACE_BASE to a writable directory") from None
        except Exception as e:  # ninja/nvcc failure on sources fivar accepted: a fivar bug, say so plainly
            log = self.build_dir / "fivar_build_error.log"
            try:
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(str(e))
            except OSError:
                pass
            raise FivarBuildError(
                f"variant '{self.variant.name}': compiling {self.uri} failed. fivar accepted this spec, "
                f"so this is a fivar bug; please report it with the log at {log}") from None
        return "cold"

    def load(self):
        mod = _loaded.get(self.uri)
        if mod is None:
            self.build()
            try:
                mod = self.jit_spec().load()
            except Exception as e:
                raise FivarError(f"variant '{self.variant.name}': loading {self.library_path} failed: "
                                 f"{e}") from None
            _loaded[self.uri] = mod
        return mod


def _write_if_different(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic: concurrent builders never see a torn file


def _render_flashinfer(name: str, **kwargs) -> str:
    from flashinfer.jit import env as jit_env
    return jinja2.Template((jit_env.FLASHINFER_CSRC_DIR / name).read_text()).render(**kwargs)


def _dispatch_override(config: str, variant) -> str:
    m = re.search(r"#define DISPATCH_context\(([^)]*)\)", config)
    if not m or "mask_mode" not in config.split("#define DISPATCH_context", 1)[1].split("\n\n", 1)[0]:
        return ""  # this op has no mask-mode dispatch (decode)
    args = ", ".join(a.strip() for a in m.group(1).split(",") if a.strip() != "...")
    return fa2.render("fa2/dispatch.inc.jinja", dispatch_args=args, mask_modes=fa2.mask_modes(variant),
                      variant_name=fa2.struct_name(variant))


def gen_module(variant, op: str = "single_prefill", target: str = "fa2", dtype: str = "bf16",
               head_dim: int = 128) -> FivarModule:
    if op not in OPS:
        raise FivarError(f"unknown op '{op}' (choose from {', '.join(OPS)})")
    if target not in TARGETS:
        raise FivarError(f"variant '{variant.name}': target '{target}' is not available (have {TARGETS})")
    if dtype not in DTYPES:
        raise FivarError(f"dtype '{dtype}' is not supported (use one of {sorted(DTYPES)})")
    if head_dim not in HEAD_DIMS:
        raise FivarError(f"head_dim {head_dim} is not supported (use one of {HEAD_DIMS})")
    toolchain.ensure_arch_env()
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.attention.utils import generate_additional_params
    from flashinfer.jit.utils import dtype_map, mask_mode_literal

    decl = fa2.variant_decl(variant)
    t_names, t_types, s_names, s_types = decl.additional
    params_decl, func_params, params_setter = generate_additional_params(t_names, t_types, s_names, s_types)
    tdt = DTYPES[dtype]
    kwargs = dict(
        variant_decl=decl.source, variant_name=fa2.struct_name(variant),
        dtype_q=dtype_map[tdt], dtype_kv=dtype_map[tdt], dtype_o=dtype_map[tdt], idtype="int32_t",
        head_dim_qk=head_dim, head_dim_vo=head_dim, pos_encoding_mode="PosEncodingMode::kNone",
        use_sliding_window="false", use_logits_soft_cap="false", use_fp16_qk_reduction="false",
        additional_params_decl=params_decl, additional_func_params=func_params,
        additional_params_setter=params_setter, require_fp4_kv_cache=False,
        paged_kv_stride_mode="runtime", same_kv_strides_values=["true", "false"],
    )
    config_t, inst_ts, host_files, config_name = _FA2_LAYOUT[op]
    config = _render_flashinfer(config_t, **kwargs)
    sources = {config_name: config + _dispatch_override(config, variant),
               "fivar_ops.cuh": (csrc_dir() / "fivar_ops.cuh").read_text()}
    has_mask_dispatch = op != "batch_decode"
    for inst_t in inst_ts:
        stem = inst_t.removesuffix("_inst.jinja")
        if has_mask_dispatch:
            for mode in fa2.mask_modes(variant):
                code = fa2.MASK_CODES[mode]
                sources[f"{stem}_mask_{code}.cu"] = _render_flashinfer(
                    inst_t, mask_mode=mask_mode_literal[code], **kwargs)
        else:
            sources[f"{stem}.cu"] = _render_flashinfer(inst_t, **kwargs)
    for host in host_files:
        sources[host] = (jit_env.FLASHINFER_CSRC_DIR / host).read_text()

    cuda_cflags: list[str] = []
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    for item in (cuda_cflags, toolchain.arch_flags(), toolchain.flashinfer_version(), toolchain.nvcc_version(),
                 os.environ.get("FLASHINFER_JIT_DEBUG", ""), os.environ.get("FLASHINFER_JIT_LINEINFO", "")):
        h.update(repr(item).encode() + b"\0")
    uri = f"fivar_{variant.name}_{target}_{op}_{dtype}_hd{head_dim}_{h.hexdigest()[:12]}"
    return FivarModule(variant, op, target, dtype, head_dim, uri, sources, cuda_cflags, decl.additional)


def module_for(variant, op, target, dtype, head_dim) -> FivarModule:
    """gen_module with a per-process memo, so repeated calls skip rendering and hashing."""
    key = (id(variant), op, target, dtype, head_dim)
    m = _memo.get(key)
    if m is None or m[0] is not variant:
        m = (variant, gen_module(variant, op, target, dtype, head_dim))
        _memo[key] = m
    return m[1]


_memo: dict[tuple, tuple] = {}


def build_many(modules: list[FivarModule], parallel: bool = True) -> list[tuple[str, float]]:
    """Build modules, all cold compiles in one parallel ninja. Returns (cold|disk|memory, seconds) each."""
    from flashinfer.jit.core import build_jit_specs
    results: dict[str, tuple[str, float]] = {}
    for m in modules:
        if m.uri in _loaded:
            results[m.uri] = ("memory", 0.0)
        elif m.manifest_ok():
            results[m.uri] = ("disk", 0.0)
    todo = list({m.uri: m for m in modules if m.uri not in results}.values())
    if parallel and len(todo) > 1:
        t0 = time.perf_counter()
        try:
            build_jit_specs([m.jit_spec() for m in todo], skip_prebuilt=False)
        except Exception:
            pass  # the per-module builds below name the module that failed
        secs = time.perf_counter() - t0
        for m in todo:
            if m.library_path.exists():
                m.write_manifest(secs)
                results[m.uri] = ("cold", secs)
    for m in modules:
        if m.uri not in results:
            t0 = time.perf_counter()
            kind = m.build()
            results[m.uri] = (kind, time.perf_counter() - t0)
    return [results[m.uri] for m in modules]
