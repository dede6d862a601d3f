"""FA2 prefill: fivar's cut of the installed FlashInfer's single-prefill launcher at its CTA-tile switch
(single_prefill_cut), its grouping of batch-prefill instantiations by CTA tile, and its KV tiles pinned at compile
time (csrc/fivar_pinned_kv_tiles.cuh) read FlashInfer's launcher text (include/flashinfer/attention/prefill.cuh and
utils.cuh, 0.7.2 and 0.7.4). Each is used only while that text has the form it relies on."""
from __future__ import annotations

import functools
import re

from ..paths import templates_dir
from ._base import Coupling, csrc_dir, include_dir, norm, safe

_SIGNATURE = (r"(template <uint32_t HEAD_DIM_QK[^>]*>\s*cudaError_t SinglePrefillWithKVCacheDispatched\("
              r"Params params, typename Params::DTypeO\* tmp,\s*cudaStream_t stream\))")


def _code_only(text: str) -> str:
    """C++ text without its string and character literals and comments (an error message may name cta_tile_q)."""
    return re.sub(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', "", text, flags=re.S)


def _utils() -> str:
    return (include_dir() / "flashinfer" / "utils.cuh").read_text()


def _prefill() -> str:
    return (include_dir() / "flashinfer" / "attention" / "prefill.cuh").read_text()


@functools.lru_cache(maxsize=None)
def dispatch_cta_tiles() -> tuple[int, ...]:
    """The cases of FlashInfer's DISPATCH_CTA_TILE_Q (include/flashinfer/utils.cuh)."""
    m = re.search(r"#define DISPATCH_CTA_TILE_Q\(cta_tile_q, CTA_TILE_Q, \.\.\.\)((?:[^\n]*\\\n)+)", _utils())
    return tuple(int(c) for c in re.findall(r"case (\d+):", m.group(1))) if m else ()


#: the preamble's tile choice, left out of the per-tile copy (its device queries would run on every launch)
_CTA_TILE_Q_STEP = re.compile(r"\n *uint32_t cta_tile_q =[^;]*;")
_FUNCTION = re.compile(_SIGNATURE + r" \{\n(.*?)\n  DISPATCH_CTA_TILE_Q\(cta_tile_q, CTA_TILE_Q, \{\n(.*?)\n  \}\);\n"
                       r"  return cudaSuccess;\n\}\n", re.S)


def _single_prefill_parts(prefill: str, host: str) -> tuple[tuple[str, str, str] | None, str | None]:
    """((signature, preamble, per-tile body) of FlashInfer's SinglePrefillWithKVCacheDispatched, None), or (None,
    why it is not of the form fivar cuts: a preamble choosing cta_tile_q, then DISPATCH_CTA_TILE_Q over a body,
    declared as defined in csrc/single_prefill.cu)."""
    fi = _FUNCTION.search(prefill)
    if not fi:
        return None, "prefill.cuh has no SinglePrefillWithKVCacheDispatched of the form fivar splits"
    sig, preamble, body = fi.groups()
    decl = re.search(_SIGNATURE + ";", host)
    if not decl or norm(decl.group(1)) != norm(sig):
        return None, "csrc/single_prefill.cu declares another SinglePrefillWithKVCacheDispatched"
    if len(_CTA_TILE_Q_STEP.findall(preamble)) != 1 or re.search(r"\bcta_tile_q\b", _code_only(body)):
        return None, "SinglePrefillWithKVCacheDispatched's body reads cta_tile_q or its preamble sets it otherwise"
    # the per-tile function runs the preamble again (but the tile choice): it must only declare and check
    code = _code_only(preamble)
    if re.search(r"\b(params|tmp|stream)\b(\.\w+|\[[^]]*\])*\s*([-+*/%&|^]|<<|>>)?=(?!=)|\+\+|--|\bstatic\b|"
                 r"\bcuda\w*\(|<<<", code):
        return None, "SinglePrefillWithKVCacheDispatched's preamble has effects the per-tile copy would repeat"
    if re.search(r"=|\.\.\.|//|/\*", _template_params_text(sig)):
        return None, "SinglePrefillWithKVCacheDispatched's template parameters have defaults, packs or comments"
    if not dispatch_cta_tiles():
        return None, "utils.cuh has no DISPATCH_CTA_TILE_Q of the expected form"
    return (sig, preamble, body), None


@functools.lru_cache(maxsize=None)
def _installed_single_prefill_parts():
    return _single_prefill_parts(_prefill(), (csrc_dir() / "single_prefill.cu").read_text())


@functools.lru_cache(maxsize=None)
@safe
def single_prefill_split_problem() -> str | None:
    """Why the installed FlashInfer's single-prefill launcher cannot be cut per CTA tile (single_prefill_cut), or
    None."""
    return _installed_single_prefill_parts()[1]


def _template_params_text(signature: str) -> str:
    return signature[signature.index("<") + 1:signature.index(">")]


def _template_params(signature: str) -> list[str]:
    """The template parameters of a `template <...> cudaError_t f(...)` signature (no defaults, packs or comments:
    _single_prefill_parts), as declared."""
    return [" ".join(p.split()) for p in _template_params_text(signature).split(",")]


_TILE_HEADER = """\
// fivar: ONE CTA_TILE_Q of FlashInfer {version}'s FA2 single-prefill launcher, SinglePrefillWithKVCacheDispatched
// (include/flashinfer/attention/prefill.cuh), so that each tile's kernels compile in a unit of their own. Cut from
// the installed text by fivar.flashinfer_compat.fa2_launchers.single_prefill_cut: FlashInfer's preamble (its
// declarations and checks, which have no other effect; not its tile choice), then its DISPATCH_CTA_TILE_Q body for
// this tile, token for token.
#pragma once
#include <flashinfer/attention/prefill.cuh>

namespace flashinfer {{

template <uint32_t CTA_TILE_Q, {params}>
cudaError_t fivar_single_prefill_tile(Params params, typename Params::DTypeO* tmp, cudaStream_t stream) {{
{tile_preamble}
  {{
{body}
  }}
  return cudaSuccess;
}}

}}  // namespace flashinfer
"""

_DISPATCH_HEADER = """\
// fivar: FlashInfer {version}'s SinglePrefillWithKVCacheDispatched with each DISPATCH_CTA_TILE_Q case calling
// fivar_single_prefill_tile (fivar_single_prefill_tile.cuh), instantiated in the kernel units, one unit per tile:
// FlashInfer's signature and preamble, token for token, so its checks and its tile choice (FA2DetermineCtaTileQ).
// Host code only: the module's host unit includes it.
#pragma once
// not prefill.cuh: it defines the function this replaces; the preamble's names come from these
#include <flashinfer/attention/mask.cuh>
#include <flashinfer/pos_enc.cuh>
#include <flashinfer/utils.cuh>

#include <sstream>

namespace flashinfer {{

template <uint32_t CTA_TILE_Q, {params}>
cudaError_t fivar_single_prefill_tile(Params params, typename Params::DTypeO* tmp, cudaStream_t stream);

{signature} {{
{preamble}
  DISPATCH_CTA_TILE_Q(cta_tile_q, CTA_TILE_Q, {{
    return fivar_single_prefill_tile<CTA_TILE_Q, {names}>(params, tmp, stream);
  }});
  return cudaSuccess;
}}

}}  // namespace flashinfer
"""


def single_prefill_cut() -> dict[str, str]:
    """The installed FlashInfer's single-prefill launcher cut at its CTA-tile switch: {header name: text} for the
    per-tile function (fivar_single_prefill_tile.cuh, included by each kernel unit) and the dispatcher
    (fivar_single_prefill_dispatch.cuh, in the host unit). Call only where single_prefill_split_problem() is None."""
    from ..jit.toolchain import flashinfer_version
    parts, why = _installed_single_prefill_parts()
    if parts is None:
        raise RuntimeError(why)
    sig, preamble, body = parts
    params = _template_params(sig)
    fields = dict(version=flashinfer_version(), params=", ".join(params), preamble=preamble, body=body,
                  tile_preamble=_CTA_TILE_Q_STEP.sub("", preamble),
                  signature=sig, names=", ".join(p.split()[-1] for p in params))
    return {"fivar_single_prefill_tile.cuh": _TILE_HEADER.format(**fields),
            "fivar_single_prefill_dispatch.cuh": _DISPATCH_HEADER.format(**fields)}


def single_prefill_tile_statements(flashinfer_unit: str, tile: int) -> list[str]:
    """FlashInfer's explicit instantiations of SinglePrefillWithKVCacheDispatched in one of its rendered kernel
    units, as instantiations of fivar_single_prefill_tile for `tile`: the same arguments, whatever the release."""
    return [f"template cudaError_t fivar_single_prefill_tile</*CTA_TILE_Q=*/{tile}, {' '.join(args.split())}>"
            f"({' '.join(fargs.split())});"
            for args, fargs in re.findall(r"^template cudaError_t SinglePrefillWithKVCacheDispatched<(.*?)>\((.*?)\);",
                                          flashinfer_unit, re.S | re.M)]


def inst_statements(text: str) -> list[str]:
    """The launcher instantiations (`template cudaError_t ...Dispatched<...>(...);`) in a kernel unit, normalised:
    fivar's per-tile batch-prefill units must instantiate exactly what FlashInfer's rendered ones do."""
    return sorted(norm(s) for s in re.findall(r"^template cudaError_t \w+Dispatched<.*?>\(.*?\);", text, re.S | re.M))


@functools.lru_cache(maxsize=None)
@safe
def batch_prefill_split_problem() -> str | None:
    """Why FlashInfer's batch-prefill instantiation templates cannot be grouped by tile, or None (each module's
    units are also checked statement for statement against FlashInfer's, fivar.jit.fa2_tile_split)."""
    from .templates import template_variables, variables_of
    ours = variables_of((templates_dir() / "fa2" / "batch_prefill_tile_inst.jinja").read_text())
    for name in ("batch_prefill_paged_kernel_inst.jinja", "batch_prefill_ragged_kernel_inst.jinja"):
        if "/*CTA_TILE_Q=*/" not in (csrc_dir() / name).read_text():
            return f"{name} names no /*CTA_TILE_Q=*/ in its instantiations"
        # a template parameter fivar's per-tile units do not pass (0.7.4's use_token_head_sf) changes the statements
        missing = sorted(template_variables(name) - ours)
        if missing:
            return f"{name} takes {', '.join(missing)}, which fivar's per-tile units do not pass"
    return None


# The steps of FlashInfer's launchers that fivar_pinned_kv_tiles.cuh repeats with the build's shared memory, and
# the dispatch that takes their result (prefill.cuh), whitespace aside: 0.7.2's, and 0.7.4's with its FP8
# token-head-scale terms (the unit then defines FIVAR_PINNED_TOKEN_HEAD_SF for the macro to pass them).
_DISPATCH_STEP = "DISPATCH_NUM_MMA_KV( min(static_cast<uint32_t>(max_num_mma_kv_smem), max_num_mma_kv_reg), NUM_MMA_KV, {"
_CTAS_PER_SM_STEPS = (
    "const int num_ctas_per_sm = max_smem_per_sm >= 2 * (kFixedSmem + kMinValidMmaKV * kKVSmemPerMmaKV) ? 2 : 1;",
    "const int max_smem_per_threadblock = min(max_smem_per_sm / num_ctas_per_sm, max_smem_per_block_optin);",
)
LAUNCHER_STEPS = {
    "0.7.2": (*_CTAS_PER_SM_STEPS,
              "const int max_num_mma_kv_smem = (max_smem_per_threadblock - static_cast<int>(kFixedSmem)) / "
              "static_cast<int>(kKVSmemPerMmaKV);",
              _DISPATCH_STEP),
    "token_head_sf": (
        "const bool kSmemFitsRepackWithScale = (kFixedSmem + kMinValidMmaKV * (kKVSmemPerMmaKV + kScaleSmemPerMmaKV))"
        " <= (uint32_t)max_smem_per_block_optin;",
        "const bool disable_repack = USE_TOKEN_HEAD_SF && !kSmemFitsRepackWithScale;",
        "const uint32_t kKVSmemPerMmaKVEffective = disable_repack ? kKVSmemPerMmaKVNoRepack : kKVSmemPerMmaKV;",
        *_CTAS_PER_SM_STEPS,
        "const int max_num_mma_kv_smem_occ = (max_smem_per_threadblock - static_cast<int>(kFixedSmem)) / "
        "static_cast<int>(kKVSmemPerMmaKVEffective);",
        "int max_num_mma_kv_smem = max_num_mma_kv_smem_occ;",
        "if (USE_TOKEN_HEAD_SF) {",
        "const int max_num_mma_kv_smem_scale = (max_smem_per_block_optin - static_cast<int>(kFixedSmem)) / "
        "static_cast<int>(kKVSmemPerMmaKVEffective + kScaleSmemPerMmaKV);",
        "max_num_mma_kv_smem = min(max_num_mma_kv_smem_occ, max_num_mma_kv_smem_scale);",
        _DISPATCH_STEP),
}
_DISPATCH_CASES = re.compile(r"#define DISPATCH_NUM_MMA_KV\(max_mma_kv, NUM_MMA_KV, \.\.\.\)((?:[^\n]*\\\n)+)")


def _launcher_form(launcher: str) -> str | None:
    """Which LAUNCHER_STEPS a launcher's text (up to its DISPATCH_NUM_MMA_KV) follows, in order, with nothing
    assigning max_num_mma_kv_smem again between its last step and the dispatch; or None."""
    for form, steps in LAUNCHER_STEPS.items():
        at, end = 0, 0
        for step in steps:
            at = launcher.find(norm(step), end)
            if at < 0:
                break
            if step == _DISPATCH_STEP and re.search(r"\bmax_num_mma_kv_smem\s*[-+*/]?=(?!=)", launcher[end:at]):
                break
            end = at + len(norm(step))
        else:
            return form
    return None


def pinned_launcher_form_in(prefill: str, utils: str) -> tuple[str | None, str | None]:
    """(the LAUNCHER_STEPS form every DISPATCH_NUM_MMA_KV of prefill.cuh follows, None; or None, why the pinned
    dispatch does not fit it): its launchers all in one form, and the macro's cases 8, 4, 2, 1. The per-tile
    single-prefill units carry the same launcher text (single_prefill_cut), so the same form."""
    m = _DISPATCH_CASES.search(utils)
    if not m or re.findall(r"NUM_MMA_KV = (\d+);", m.group(1)) != ["8", "4", "2", "1"]:
        return None, "DISPATCH_NUM_MMA_KV in utils.cuh is not the 8/4/2/1 dispatch fivar pins"
    # every launcher: from well before its DISPATCH_NUM_MMA_KV to it, the steps in order
    starts = [i.start() for i in re.finditer(r"DISPATCH_NUM_MMA_KV\(", prefill)]
    if not starts:
        return None, "prefill.cuh has no DISPATCH_NUM_MMA_KV"
    forms = set()
    for start in starts:
        form = _launcher_form(norm(prefill[max(0, start - 5000):start + 200]))
        if form is None:
            return None, "a DISPATCH_NUM_MMA_KV in prefill.cuh follows neither 0.7.2's nor 0.7.4's steps"
        forms.add(form)
    if len(forms) != 1:
        return None, "the DISPATCH_NUM_MMA_KV launchers in prefill.cuh follow different steps"
    return forms.pop(), None


def pinned_kv_tiles_problem_in(prefill: str, utils: str) -> str | None:
    """Why the pinned dispatch does not fit these launcher sources (prefill.cuh, utils.cuh), or None."""
    return pinned_launcher_form_in(prefill, utils)[1]


@functools.lru_cache(maxsize=None)
@safe
def pinned_kv_tiles_problem() -> str | None:
    """pinned_kv_tiles_problem_in for the installed FlashInfer."""
    return pinned_kv_tiles_problem_in(_prefill(), _utils())


@functools.lru_cache(maxsize=None)
def pinned_launcher_form() -> str | None:
    """The LAUNCHER_STEPS form of the installed FlashInfer's launchers (None where the pinned dispatch does not fit)."""
    return pinned_launcher_form_in(_prefill(), _utils())[0]


COUPLINGS = [
    Coupling("fa2_single_prefill_split", "SinglePrefillWithKVCacheDispatched's form (prefill.cuh: a preamble choosing "
             "cta_tile_q, then DISPATCH_CTA_TILE_Q over the body) and its declaration (csrc/single_prefill.cu)", "FA2 single prefill kernel units split per CTA tile",
             "one kernel unit per mask mode, FlashInfer's layout", single_prefill_split_problem),
    Coupling("fa2_batch_prefill_split", "the /*CTA_TILE_Q=*/ instantiations of batch_prefill_*_kernel_inst.jinja",
             "FA2 batch prefill kernel units split per CTA tile", "one kernel unit per mask mode, FlashInfer's layout",
             batch_prefill_split_problem),
    Coupling("fa2_pinned_kv_tiles", "the shared-memory steps before every DISPATCH_NUM_MMA_KV (prefill.cuh) and "
             "that macro's 8/4/2/1 cases (utils.cuh)", "FA2 prefill KV tiles pinned at compile time",
             "FlashInfer's run-time KV tile choice (4x the kernels per unit)", pinned_kv_tiles_problem),
]
