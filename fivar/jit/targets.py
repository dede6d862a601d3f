"""fivar's kernel targets: FlashInfer's FA2 and FA3 templates and the Triton twin, one object each.

A target says what it can run, which config its modules build with, which code generator emits them, and the
per-target choices the runtime's forms make (fivar.runtime.forms, plans, fa3_tile_list): the rest of fivar asks a
target these questions instead of testing its name. Users still name targets by string ("fa2", "fa3", "triton",
and "auto" for fivar's choice) in every API and CLI option; target_of turns a name into its Target."""
from __future__ import annotations

from dataclasses import dataclass, fields
from types import ModuleType

from ..codegen import fa2, fa3, triton
from ..config import FA2BuildConfig, FA3KernelConfig
from ..errors import FivarError

#: The backend option that lets fivar choose the target (fivar.runtime.forms.choose_target).
AUTO = "auto"


@dataclass(frozen=True)
class Target:
    name: str
    label: str
    #: FlashInfer's JIT builds it: a module key, a plan step, host-side planning (the twin has none of these)
    is_flashinfer: bool
    #: its modules' build options (fivar.config); None for the twin, which builds through Triton
    config_class: type | None
    #: the code generator that emits its sources (fivar.codegen.fa2 / fa3 / triton)
    emitter: ModuleType
    #: built for sm_90a only (FA3's wgmma/TMA kernels): a plain 9.0 or pre-Hopper arch list cannot build it
    needs_sm90a: bool = False
    #: runs batch decode: FlashInfer has no FA3 decode kernel (backend auto then takes FA2's)
    decodes: bool = True
    #: reads an FP8 KV cache (FA2's paged kernels only)
    reads_fp8_kv: bool = False
    #: FA2 runs a masked variant in kCustom mode and applies `causal` inside the mask (a runtime flag)
    folds_causal_into_mask: bool = False
    #: FA2's batch kernels run over key segments mapped back to positions (trimmed decode pages, query blocks,
    #: causal segments: fivar.runtime.decode_pages, fa2_blocks, segments)
    runs_key_segments: bool = False
    #: FA2's kernels hold `window_left` unsigned: a band reaching right of the diagonal is clamped to 0
    window_left_unsigned: bool = False
    #: FA2's scheduler may split a request's keys into partials merged through their log-sum-exp
    splits_kv: bool = False
    #: FA2's single-prefill kernel visits every tile left of a window: a window runs as a batch of one instead
    windows_as_batch: bool = False
    #: FA3's non-causal single prefill may split its last wave (fivar.runtime.wave_split)
    splits_waves: bool = False
    #: FA3 runs every mask beyond a band in the tile-list form (FA2 but for one-query batches and FP8 caches)
    tile_lists_every_mask: bool = False
    #: a module key names the tile-list form (FA2); on FA3 it follows from the variant (ModuleKey.checked)
    keys_tile_list: bool = False
    #: FA2's query tile packs a GQA group's rows (fa2_blocks.tile_list_rows); FA3's holds one head's
    packs_query_heads: bool = False
    #: FA3's bounded softmax (fa3.softmax_range) may drop the running max
    bounds_softmax: bool = False
    #: FA3 modules take the longest to compile: the one a cold start's estimate is about
    compiles_slowest: bool = False
    #: requests (query tiles) a tile-list launch takes at most (None: any). FlashInfer's FA3 planner switches to its
    #: all-heads-alike schedule (a second kernel) past 4,096 works a head, ceil(rows / CTA_Q) + requests - 1, at most
    #: 2 x requests - 1 there: a batch of more runs as several launches, so the module holds only the per-head kernel
    tile_list_launch_requests: int | None = None

    def window_floor(self, variant) -> int | None:
        """The lowest `window_left` this target's kernels take for `variant` (fivar.runtime.forms._window_left),
        or None where it runs no window (-1): FA2's kernels hold it unsigned; FA3 applies a mask that is exactly
        the window as its own, negative edges included, and skips through a tile list's block map instead."""
        if not self.is_flashinfer:
            return None
        if self.window_left_unsigned:
            return 0
        if variant.scans_mask:
            return None
        return -(1 << 30) if fa3.runs_as_window(variant) else 0

    def config_of(self, options: dict):
        """This target's build config from gen_module's keyword options (a manifest's `options`): fields of the
        other target's config are not this one's, and are left out."""
        cls = self.config_class
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in options.items() if k in names}
        if cls is FA2BuildConfig and isinstance(values.get("skip_unused_headers"), list):
            values["skip_unused_headers"] = tuple(values["skip_unused_headers"])
        return cls(**values)


FA2 = Target("fa2", "FA2", is_flashinfer=True, config_class=FA2BuildConfig, emitter=fa2, reads_fp8_kv=True,
             folds_causal_into_mask=True, window_left_unsigned=True, runs_key_segments=True, splits_kv=True,
             windows_as_batch=True, keys_tile_list=True, packs_query_heads=True)
FA3 = Target("fa3", "FA3", is_flashinfer=True, config_class=FA3KernelConfig, emitter=fa3, needs_sm90a=True,
             decodes=False, splits_waves=True, tile_lists_every_mask=True,
             bounds_softmax=True, compiles_slowest=True, tile_list_launch_requests=2048)
TRITON = Target("triton", "Triton", is_flashinfer=False, config_class=None, emitter=triton)

TARGETS: dict[str, Target] = {t.name: t for t in (FA2, FA3, TRITON)}
#: the targets FlashInfer's JIT builds, by name (ModuleKey.target)
FLASHINFER_TARGETS: tuple[str, ...] = tuple(n for n, t in TARGETS.items() if t.is_flashinfer)


def target_of(name: str) -> Target:
    """The Target named `name`, or a one-line FivarError naming it."""
    t = TARGETS.get(name) if isinstance(name, str) else None
    if t is None:
        raise FivarError(f"unknown target {name!r} (choose from {', '.join(TARGETS)})")
    return t


def named(name) -> Target | None:
    """The Target named `name`, None for "auto" or any other name (the caller's checks report those)."""
    return TARGETS.get(name) if isinstance(name, str) else None


def runs_twin(backend) -> bool:
    """Whether a backend option names the Triton twin: no FlashInfer kernel, no plan step."""
    t = named(backend)
    return t is not None and not t.is_flashinfer
