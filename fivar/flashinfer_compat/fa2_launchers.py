"""FA2 prefill: fivar's cut of FlashInfer's single-prefill launcher (templates/fa2/single_prefill_{tile,dispatch}.cuh),
its grouping of batch-prefill instantiations by CTA tile, and its KV tiles pinned at compile time
(csrc/fivar_pinned_kv_tiles.cuh) repeat FlashInfer's launcher text (FlashInfer 0.7.2,
include/flashinfer/attention/prefill.cuh and utils.cuh). Each is used only while that text matches, token for token."""
from __future__ import annotations

import functools
import re

from ..paths import templates_dir
from ._base import Coupling, csrc_dir, include_dir, norm, safe

_SIGNATURE = (r"(template <uint32_t HEAD_DIM_QK[^>]*>\s*cudaError_t SinglePrefillWithKVCacheDispatched\("
              r"Params params, typename Params::DTypeO\* tmp,\s*cudaStream_t stream\))")


#: a C++ string literal: its text is an error message, never code, so the copy may word it as fivar's own
_STRING_LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"')


def _code(text: str) -> str:
    """`norm(text)` with every string literal emptied: what the copied launcher body must match."""
    return norm(_STRING_LITERAL.sub('""', text))


def _utils() -> str:
    return (include_dir() / "flashinfer" / "utils.cuh").read_text()


def _prefill() -> str:
    return (include_dir() / "flashinfer" / "attention" / "prefill.cuh").read_text()


@functools.lru_cache(maxsize=None)
def dispatch_cta_tiles() -> tuple[int, ...]:
    """The cases of FlashInfer's DISPATCH_CTA_TILE_Q (include/flashinfer/utils.cuh)."""
    m = re.search(r"#define DISPATCH_CTA_TILE_Q\(cta_tile_q, CTA_TILE_Q, \.\.\.\)((?:[^\n]*\\\n)+)", _utils())
    return tuple(int(c) for c in re.findall(r"case (\d+):", m.group(1))) if m else ()


@functools.lru_cache(maxsize=None)
@safe
def single_prefill_split_problem() -> str | None:
    """Why fivar's cut of FlashInfer's single-prefill launcher does not fit the installed FlashInfer, or None.

    templates/fa2/single_prefill_tile.cuh and single_prefill_dispatch.cuh carry FlashInfer's text (0.7.2,
    prefill.cuh's SinglePrefillWithKVCacheDispatched); this compares them token for token (whitespace and the text
    of string literals aside) with the installed prefill.cuh, and fivar's dispatcher signature with the declaration
    in csrc/single_prefill.cu."""
    prefill, host = _prefill(), (csrc_dir() / "single_prefill.cu").read_text()
    tile = (templates_dir() / "fa2" / "single_prefill_tile.cuh").read_text()
    dispatch = (templates_dir() / "fa2" / "single_prefill_dispatch.cuh").read_text()
    fi = re.search(_SIGNATURE + r" \{\n(.*?)\n  DISPATCH_CTA_TILE_Q\(cta_tile_q, CTA_TILE_Q, \{\n(.*?)\n  \}\);\n"
                   r"  return cudaSuccess;\n\}\n", prefill, re.S)
    if not fi:
        return "prefill.cuh has no SinglePrefillWithKVCacheDispatched of the form fivar splits"
    fi_sig, fi_preamble, fi_body = fi.groups()
    decl = re.search(_SIGNATURE + ";", host)
    ours_sig = re.search(_SIGNATURE + " {", dispatch)
    ours_preamble = re.search(r"// ---- BEGIN FlashInfer preamble[^\n]*\n(.*?)\n  // ---- END FlashInfer preamble",
                              dispatch, re.S)
    ours_body = re.search(r"// ---- BEGIN FlashInfer DISPATCH_CTA_TILE_Q body[^\n]*\n  \{\n(.*?)\n  \}\n"
                          r"  // ---- END FlashInfer DISPATCH_CTA_TILE_Q body", tile, re.S)
    tile_locals = re.search(r"cudaError_t fivar_single_prefill_tile\([^)]*\) \{\n(.*?)\n  // ---- BEGIN", tile, re.S)
    if not (decl and ours_sig and ours_preamble and ours_body and tile_locals):
        return "fivar's single-prefill templates or FlashInfer's single_prefill.cu lack the expected markers"
    if not norm(fi_sig) == norm(decl.group(1)) == norm(ours_sig.group(1)):
        return "the signature of SinglePrefillWithKVCacheDispatched changed"
    if norm(fi_preamble) != norm(ours_preamble.group(1)):
        return "the preamble of SinglePrefillWithKVCacheDispatched changed"
    if _code(fi_body) != _code(ours_body.group(1)):
        return "the DISPATCH_CTA_TILE_Q body of SinglePrefillWithKVCacheDispatched changed"
    fi_lines = {line.strip() for line in fi_preamble.splitlines()}
    if any(line.strip() not in fi_lines for line in tile_locals.group(1).splitlines()):
        return "a local the tile function copies from FlashInfer's preamble changed"
    if not dispatch_cta_tiles():
        return "utils.cuh has no DISPATCH_CTA_TILE_Q of the expected form"
    return None


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


def pinned_launcher_form_in(prefill: str, utils: str, tile_template: str = "") -> tuple[str | None, str | None]:
    """(the LAUNCHER_STEPS form every DISPATCH_NUM_MMA_KV of these sources follows, None; or None, why the pinned
    dispatch does not fit them): prefill.cuh's launchers, all in one form, and the macro's cases 8, 4, 2, 1.
    fivar's single-prefill launcher (its tile template, 0.7.2's text) counts only where prefill.cuh is in 0.7.2's
    form: elsewhere its body differs from FlashInfer's, so the split that compiles it is off
    (single_prefill_split_problem)."""
    m = _DISPATCH_CASES.search(utils)
    if not m or re.findall(r"NUM_MMA_KV = (\d+);", m.group(1)) != ["8", "4", "2", "1"]:
        return None, "DISPATCH_NUM_MMA_KV in utils.cuh is not the 8/4/2/1 dispatch fivar pins"
    forms: dict[str, str] = {}  # form -> where first seen
    for name, text in (("prefill.cuh", prefill), ("fivar's single-prefill launcher", tile_template)):
        # every launcher: from well before its DISPATCH_NUM_MMA_KV to it, the steps in order
        starts = [i.start() for i in re.finditer(r"DISPATCH_NUM_MMA_KV\(", text)]
        if name == "prefill.cuh" and not starts:
            return None, "prefill.cuh has no DISPATCH_NUM_MMA_KV"
        if name != "prefill.cuh" and set(forms) != {"0.7.2"}:
            break
        for start in starts:
            form = _launcher_form(norm(text[max(0, start - 5000):start + 200]))
            if form is None:
                return None, f"a DISPATCH_NUM_MMA_KV in {name} follows neither 0.7.2's nor 0.7.4's steps"
            forms.setdefault(form, name)
    if len(forms) != 1:
        return None, f"the DISPATCH_NUM_MMA_KV launchers in {' and '.join(sorted(set(forms.values())))} follow " \
                     f"different steps"
    return next(iter(forms)), None


def pinned_kv_tiles_problem_in(prefill: str, utils: str, tile_template: str = "") -> str | None:
    """Why the pinned dispatch does not fit these launcher sources (prefill.cuh, utils.cuh and fivar's copy of the
    single-prefill launcher), or None."""
    return pinned_launcher_form_in(prefill, utils, tile_template)[1]


def _tile_template() -> str:
    return (templates_dir() / "fa2" / "single_prefill_tile.cuh").read_text()


@functools.lru_cache(maxsize=None)
@safe
def pinned_kv_tiles_problem() -> str | None:
    """pinned_kv_tiles_problem_in for the installed FlashInfer."""
    return pinned_kv_tiles_problem_in(_prefill(), _utils(), _tile_template())


@functools.lru_cache(maxsize=None)
def pinned_launcher_form() -> str | None:
    """The LAUNCHER_STEPS form of the installed FlashInfer's launchers (None where the pinned dispatch does not fit)."""
    return pinned_launcher_form_in(_prefill(), _utils(), _tile_template())[0]


COUPLINGS = [
    Coupling("fa2_single_prefill_split", "SinglePrefillWithKVCacheDispatched's text (prefill.cuh) and its declaration "
             "(csrc/single_prefill.cu), token for token", "FA2 single prefill kernel units split per CTA tile",
             "one kernel unit per mask mode, FlashInfer's layout", single_prefill_split_problem),
    Coupling("fa2_batch_prefill_split", "the /*CTA_TILE_Q=*/ instantiations of batch_prefill_*_kernel_inst.jinja",
             "FA2 batch prefill kernel units split per CTA tile", "one kernel unit per mask mode, FlashInfer's layout",
             batch_prefill_split_problem),
    Coupling("fa2_pinned_kv_tiles", "the shared-memory steps before every DISPATCH_NUM_MMA_KV (prefill.cuh) and "
             "that macro's 8/4/2/1 cases (utils.cuh)", "FA2 prefill KV tiles pinned at compile time",
             "FlashInfer's run-time KV tile choice (4x the kernels per unit)", pinned_kv_tiles_problem),
]
