"""What a build compiles: the modules of each variant, op, dtype and head dim that the runtime would run on the
archs being built for (`fivar build`, the compile suite of the benchmark runner)."""
from __future__ import annotations

import os

#: the ops `fivar build` compiles unless told otherwise
DEFAULT_OPS = ("single_prefill", "batch_prefill", "batch_decode")


def build_capabilities() -> list:
    """The GPUs `build --targets auto` builds for: each arch of FLASHINFER_CUDA_ARCH_LIST (or --arch) when one is
    set, else the visible GPU (None); so `--arch 8.0 9.0a` builds what both would run."""
    from ..jit.toolchain import ensure_arch_env
    ensure_arch_env()  # no GPU and no arch list: one line asking for FLASHINFER_CUDA_ARCH_LIST or --arch
    text = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")  # checked: space-separated
    if not text:
        return [None]
    return [arch_capability(a) for a in text.split()]


def builds_sm90a(arch_list: str | None = None) -> bool:
    """Whether modules are built for sm_90a (what FA3 kernels need): `arch_list`, else FlashInfer's."""
    text = arch_list or os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    if text:
        return "9.0a" in text.split()
    from ..jit.toolchain import arch_tag
    return "90a" in arch_tag().split("_")


def arch_capability(arch_list: str) -> tuple[int, int]:
    """(major, minor) of a checked arch list: sm90 if it has 9.0a (what FA3 is built for), else its first arch."""
    archs = arch_list.split()
    if "9.0a" in archs:
        return 9, 0
    major, minor = archs[0].split(".")
    return int(major), int(minor.rstrip("abcdefghijklmnopqrstuvwxyz"))


def build_modules(variants, targets, ops, dtypes, head_dims) -> list:
    """The attention modules `fivar build` compiles for `variants` (targets: fa2/fa3/auto; auto: what
    backend='auto' runs on each arch being built for), in order, duplicates kept."""
    from ..jit.build import serving_modules
    from ..jit.targets import FA2, target_of
    from .attention import choose_target

    def targets_for(v, op):
        if "auto" not in targets:
            return list(targets)
        chosen = {choose_target(v, "auto", op, capability=c)[0] for c in build_capabilities()}
        if any(target_of(c).needs_sm90a for c in chosen) and not builds_sm90a():  # 9.0 without 9.0a: FA2
            chosen = {FA2.name if target_of(c).needs_sm90a else c for c in chosen}
        return sorted(({*targets} | chosen) - {"auto"})
    return [m for v in variants for op in ops for t in targets_for(v, op) for dt in dtypes for hd in head_dims
            if op != "batch_decode" or target_of(t).decodes for m in serving_modules(v, op, t, dt, hd)]
