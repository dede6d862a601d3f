"""What every FlashInfer module's sources share, whichever target renders them (fivar.jit.fa2_sources,
fivar.jit.fa3_sources): FlashInfer's template arguments for a variant struct, the mask-mode dispatch, fivar's csrc
headers a source includes, and FlashInfer's host sources as one host-only translation unit."""
from __future__ import annotations

import dataclasses
import re

from ..codegen import fa2
from ..config import FA2BuildConfig, FA3KernelConfig
from ..paths import csrc_dir
from .module_key import DTYPES, KV_DTYPES, ModuleKey


@dataclasses.dataclass(frozen=True)
class Rendered:
    """One module's sources as a target renders them, before its URI."""
    sources: dict[str, str]
    cuda_cflags: list[str]
    additional: tuple        # the struct's additional params (names and types), as FivarModule records them
    built: FA2BuildConfig | FA3KernelConfig  # the config resolved for this module (its manifest's options)


def flashinfer_kwargs(variant, key: ModuleKey, decl) -> dict:
    """FlashInfer's template arguments for the struct `decl` (fa2/fa3.variant_decl's) of `variant` in form `key`."""
    from flashinfer.jit.attention.utils import generate_additional_params
    from flashinfer.jit.utils import dtype_map

    t_names, t_types, s_names, s_types = decl.additional
    params_decl, func_params, params_setter = generate_additional_params(
        t_names, t_types, s_names, s_types, is_sm90_template=key.fa3)
    tdt = DTYPES[key.dtype]
    return dict(
        variant_decl=decl.source, variant_name=fa2.struct_name(variant),
        dtype_q=dtype_map[tdt], dtype_kv=dtype_map[KV_DTYPES[key.kv_dtype] if key.kv_dtype else tdt],
        dtype_o=dtype_map[tdt], idtype="int32_t",
        head_dim_qk=key.head_dim, head_dim_vo=key.head_dim, pos_encoding_mode="PosEncodingMode::kNone",
        # A left band in the mask: FA3's sliding-window schedule skips the KV tiles left of it (the tile-list
        # form skips them through its block map; the window would be measured from the tile, not the request)
        use_sliding_window="true" if (key.fa3 and variant.kv_band.left is not None and not key.tile_list)
        else "false",
        use_logits_soft_cap="false", use_fp16_qk_reduction="false",
        additional_params_decl=params_decl, additional_func_params=func_params,
        additional_params_setter=params_setter, require_fp4_kv_cache=False,
        paged_kv_stride_mode="runtime", same_kv_strides_values=["true", "false"],
    )


def mask_mode_units(inst_t: str, modes: list[str], kwargs: dict) -> dict[str, str]:
    """FlashInfer's kernel-instantiation template `inst_t` rendered once per mask mode the module compiles."""
    from flashinfer.jit.utils import mask_mode_literal

    from ..flashinfer_compat.templates import render_template

    stem = inst_t.removesuffix("_inst.jinja")
    return {f"{stem}_mask_{fa2.MASK_CODES[mode]}.cu": render_template(
        inst_t, mask_mode=mask_mode_literal[fa2.MASK_CODES[mode]], **kwargs) for mode in modes}


def dispatch_override(config: str, variant, mask_modes: list[str]) -> str:
    """The config's mask-mode dispatch narrowed to the modes the module compiles (none for an op without one)."""
    m = re.search(r"#define DISPATCH_context\(([^)]*)\)", config)
    if not m or "mask_mode" not in config.split("#define DISPATCH_context", 1)[1].split("\n\n", 1)[0]:
        return ""  # this op has no mask-mode dispatch (decode)
    args = ", ".join(a.strip() for a in m.group(1).split(",") if a.strip() != "...")
    return fa2.render("fa2/dispatch.inc.jinja", dispatch_args=args, mask_modes=mask_modes,
                      variant_name=fa2.struct_name(variant))


def fivar_headers(source: str) -> dict[str, str]:
    """fivar's own headers (csrc/) that `source` includes, directly or through each other: copied into the
    module's sources, so hashed into its URI (an edit to one rebuilds exactly the modules that include it)."""
    found: dict[str, str] = {}
    todo = re.findall(r'#include "(fivar_\w+\.cuh)"', source)
    while todo:
        name = todo.pop()
        if name not in found:
            found[name] = (csrc_dir() / name).read_text()
            todo += re.findall(r'#include "(fivar_\w+\.cuh)"', found[name])
    return dict(sorted(found.items()))


def add_host_sources(sources: dict[str, str], host_files: list[str], includes: tuple[str, ...] = ()) -> None:
    """FlashInfer's host files of the op into `sources`: its headers as they are, its .cu files as one unit."""
    from flashinfer.jit import env as jit_env

    for host in host_files:
        if not host.endswith(".cu"):
            sources[host] = (jit_env.FLASHINFER_CSRC_DIR / host).read_text()
    host_units = [h for h in host_files if h.endswith(".cu")]
    sources[host_unit_name(host_units)] = host_unit(
        {h: (jit_env.FLASHINFER_CSRC_DIR / h).read_text() for h in host_units}, includes)


def host_unit_name(host_units: list[str]) -> str:
    """The one host translation unit keeps the binding's name (its object is what the cache tools name)."""
    return next(h for h in host_units if h.endswith("_jit_binding.cu"))


def host_unit(texts: dict[str, str], includes: tuple[str, ...] = ()) -> str:
    """FlashInfer's host sources for one op (the launcher wrapper and the tvm-ffi binding) as ONE
    translation unit whose text is hidden from nvcc's device pass.

    Compile time, not behaviour: each separate host .cu costs a full nvcc run (host preprocessing,
    cudafe++ and g++ over FlashInfer's and tvm-ffi's headers, plus a device pass that preprocesses the
    same headers and runs cicc). These files define no kernels and launch none of their own: compiled
    separately (FlashInfer 0.7.2, every op and target here) their cubins hold only unused internal-linkage
    header constants (libcu++ CPO objects; curand tables for FA3) and no function. Guarding them with
    `#ifndef __CUDA_ARCH__` drops those from the device pass, and nvcc derives the host-side registration
    from that pass, so host and device stay consistent; every kernel unit is untouched (same text, same
    flags), so the kernels' SASS is unchanged. Measured alone on a 2-core box (bf16, hd128), two host
    units -> one: FA2 single_prefill 5.6 + 6.3 s -> 4.4 s, batch_prefill 6.7 + 15.2 -> 12.2 s,
    batch_decode 7.0 + 8.2 -> 8.4 s; FA3 single_prefill 34.6 + 33.0 -> 23.7 s, batch_prefill
    38.7 + 35.9 -> 28.8 s.
    """
    # The binding goes first: it declares the entry points without the default arguments that some
    # definitions carry (batch_prefill.cu's plan/workspace_size), and tvm-ffi's export macro rejects a
    # function whose default arguments are visible. Defaults added by the later definition are legal C++.
    order = sorted(texts, key=lambda n: not n.endswith("_jit_binding.cu"))
    # this text is hashed into every module's URI: kept byte for byte (the function once lived in fivar.jit.build),
    # so moving code leaves every cache valid
    parts = ["// fivar: FlashInfer's " + ", ".join(order) + " in one host-only translation unit "
             "(see fivar.jit.build._host_unit).", "#ifndef __CUDA_ARCH__"]
    for inc in includes:  # fivar's host-side definitions these sources call (see fivar.jit.fa2_tile_split)
        parts += [f"// ---- {inc} ----", f'#include "{inc}"']
    for name in order:
        text = texts[name]
        parts += [f"// ---- {name} ----", text.rstrip("\n")]
    parts += ["#endif  // __CUDA_ARCH__", ""]
    return "\n".join(parts)
