"""Tuning as configuration: one frozen dataclass per kernel family, and the only place fivar reads FIVAR_*.

A module is built from a config object. A field left None is chosen by the family's heuristic from the arch, head
dim, variant and shape (fivar.codegen.fa3.kernel_config for FA3; fivar.jit.build.gen_module for FA2's build
switches); a value given to gen_module(config=...) wins, then `override(...)` (a block of code forcing a choice,
for tests and benchmarks), then the FIVAR_* environment variable, then the heuristic. What a module was built
with is recorded in its manifest (`options`) and rendered by `fivar show --explain`, from the same objects.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from dataclasses import dataclass, fields

from .errors import FivarError


@dataclass(frozen=True)
class FA2BuildConfig:
    """How an FA2 module is compiled (same kernels, another compile time). None: the default in ENV's notes."""
    split_cta_tiles: bool | None = None  # one kernel unit per CTA tile (~0.7x the longest unit, ~1.8x the CPU)
    nvcc_split_compile: bool | None = None  # nvcc --split-compile: cicc/ptxas work on a unit's kernels in threads
    pin_kv_tiles: bool | None = None  # compile only the KV tile the archs' shared memory selects
    skip_unused_headers: bool | tuple[str, ...] | None = None  # leave out headers FlashInfer includes but hardly uses
    nvcc_parallel_passes: bool | None = None  # nvcc's host pass beside its device pass


@dataclass(frozen=True)
class FA3KernelConfig:
    """What an FA3 (Hopper) module's kernels do. None: fivar.codegen.fa3.kernel_config's heuristic."""
    exp2_emulated_of_8: int | None = None  # of every 8 score columns, how many compute exp2 on the FMA pipe
    cta_tile: str | None = None  # single prefill: "QxKV", "QxKV,QxKV" (non-causal, causal), "A|B" choices, "flashinfer"
    schedule: str | None = None  # single prefill: "grid" or "persistent", or "S,S" (non-causal, causal)
    bounded_softmax: bool | None = None  # a bounded transform's softmax takes its max from the bound (bf16)
    nvcc_parallel_passes: bool | None = None


@dataclass(frozen=True)
class TritonConfig:
    """What the Triton twin (templates/triton/attention.py.jinja) reads when it is imported."""
    autotune: bool = True  # False: one launch config per kernel instead of autotuning (much less compile time)
    tma: bool = True  # False: every K/V tile through pointers, also on Hopper (for comparison)
    gluon: bool = True  # False: the backward's dK/dV and dQ in the Triton kernels also on Hopper (for comparison)


@dataclass(frozen=True)
class RuntimeConfig:
    """Choices made per launch. wave_split: FA3 single prefill splits its last wave as planned (True), never
    (False), or "TxC" (T tail heads in C chunks wherever the split applies: for measuring the plan's cost model).
    cold_start: a default call whose FlashInfer modules are not built yet runs the Triton twin while they build in
    the background ("triton"), or waits for the build ("wait"; fivar.runtime.cold_start)."""
    wave_split: bool | str = True
    cold_start: str = "triton"


@dataclass(frozen=True)
class LoweringConfig:
    """How the compiled targets' IR passes rewrite a variant (fivar.spec.optimize). position_tables: which logits terms
    of only the head and kv_idx - q_idx become a per-call table (fivar.spec.positions): "costly" (a transcendental, a
    floor/int conversion, a gather whose index is itself gathered or costly), "all" (any such term of the distance,
    even `slope * distance`) or "off". training: the lowering the training module is generated from (the backward's
    derivative programs too): set through override(training=True) where that module is rendered and run
    (fivar.codegen.triton_bwd, fivar.runtime.autograd), never by the environment."""
    position_tables: str = "costly"
    training: bool = False


POSITION_TABLE_MODES = ("costly", "all", "off")


#: field -> the environment variable that overrides it (unset: the heuristic's choice)
ENV = {
    "split_cta_tiles": "FIVAR_SPLIT_CTA_TILES",
    "nvcc_split_compile": "FIVAR_NVCC_SPLIT_COMPILE",
    "pin_kv_tiles": "FIVAR_PIN_KV_TILES",
    "skip_unused_headers": "FIVAR_SKIP_UNUSED_HEADERS",
    "nvcc_parallel_passes": "FIVAR_NVCC_PARALLEL_PASSES",
    "exp2_emulated_of_8": "FIVAR_FA3_EXP2_EMULATION",
    "cta_tile": "FIVAR_FA3_CTA_TILE",
    "schedule": "FIVAR_FA3_SCHEDULE",
    "bounded_softmax": "FIVAR_FA3_BOUNDED_SOFTMAX",
    "wave_split": "FIVAR_FA3_WAVE_SPLIT",
    "cold_start": "FIVAR_COLD_START",
    "triton_autotune": "FIVAR_TRITON_AUTOTUNE",
    "triton_tma": "FIVAR_TRITON_TMA",
    "triton_gluon": "FIVAR_TRITON_GLUON",
    "position_tables": "FIVAR_POSITION_TABLES",
}
#: Where fivar finds variants and keeps its own cache (not tuning, but read here like every FIVAR_* variable).
VARIANT_PATH_ENV, CACHE_DIR_ENV = "FIVAR_VARIANT_PATH", "FIVAR_CACHE_DIR"
#: the user's settings that are not a cache: the cache-signing key and the keys whose archives are trusted
CONFIG_DIR_ENV = "FIVAR_CONFIG_DIR"

_overrides: contextvars.ContextVar[dict] = contextvars.ContextVar("fivar_config_overrides", default={})
_FIELDS = {f.name for cls in (FA2BuildConfig, FA3KernelConfig, RuntimeConfig, LoweringConfig) for f in fields(cls)} | {"triton_autotune", "triton_tma", "triton_gluon"}


@contextlib.contextmanager
def override(config=None, **values):
    """Within the block, modules are generated (and, through fivar's module memo, run) with these choices, above
    the environment: `override(exp2_emulated_of_8=4)`, `override(cta_tile="128x176")`, or
    `override(FA3KernelConfig(...))` (its non-None fields). The process environment is left alone."""
    if config is not None:
        values = {**{f.name: getattr(config, f.name) for f in fields(config) if getattr(config, f.name) is not None},
                  **values}
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise FivarError(f"fivar.config.override: unknown setting {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(_FIELDS))})")
    token = _overrides.set({**_overrides.get(), **values})
    try:
        yield
    finally:
        _overrides.reset(token)


def setting(name: str) -> tuple[str, str]:
    """(text, where) of a setting above the heuristic: an override() in force (where: the field's name), else its
    environment variable (where: the variable's name); text "" when neither says anything."""
    forced = _overrides.get()
    if name in forced:
        value = forced[name]
        text = ("1" if value else "0") if isinstance(value, bool) else \
            ",".join(value) if isinstance(value, (tuple, list)) else str(value)
        return text, name
    return os.environ.get(ENV[name], "").strip(), ENV[name]


#: How a boolean FIVAR_* variable may say on and off (any case); anything else is refused, never read as either.
ON_WORDS, OFF_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag(name: str, default: bool, who: str = "") -> bool:
    """A boolean setting: an override() or its environment variable (ON_WORDS, OFF_WORDS), `default` when neither
    says anything; any other text is one line naming the variable (`who`: a prefix such as the variant)."""
    text, where = setting(name)
    word = text.lower()
    if not word:
        return default
    if word in ON_WORDS or word in OFF_WORDS:
        return word in ON_WORDS
    raise FivarError(f"{who}{where}={text!r}: expected {'/'.join(ON_WORDS)} (on) or {'/'.join(OFF_WORDS)} (off); unset: "
                     f"{'on' if default else 'off'}")


def switch(name: str, given: bool | None = None, option: str | None = None) -> bool:
    """An on-by-default build switch: `given` (a config field or gen_module option) if set, else an override() or
    the environment variable (flag: unset is on; anything but an on or off word is refused, not read as on)."""
    if given is None:
        return flag(name, True)
    if not isinstance(given, bool):
        raise FivarError(f"{option or name}={given!r}: expected True or False")
    return given


def switched_off_by(name: str) -> str:
    """What turned a switch off when no config field did: `VAR=0` or `name=False` (an override())."""
    text, where = setting(name)
    return f"{where}={text}" if where == ENV[name] else f"{name}=False"


def nvcc_split_compile_threads() -> int | None:
    """FIVAR_NVCC_SPLIT_COMPILE: unset -> None (on, threads by core count); 1 -> off; N >= 2 -> N threads; an on
    word (yes, true, on) is unset's choice, an off word (no, false, off) is 1; 0 (no thread?) is refused."""
    text, where = setting("nvcc_split_compile")
    if not text or text.lower() in ON_WORDS[1:]:
        return None
    if text.lower() in OFF_WORDS[1:]:
        return 1
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise FivarError(f"{where}={text!r}: expected a thread count of at least 1 (1 or off turns nvcc's "
                         f"--split-compile off; unset or on: on, with threads by core count)")
    return int(text)


def fa2_build_config(given: FA2BuildConfig | None = None) -> FA2BuildConfig:
    """`given` with every None field resolved: overrides, then the environment, then the defaults (split_cta_tiles
    off: it pays only on hosts with cores to spare; every other switch on)."""
    given = given or FA2BuildConfig()
    threads = nvcc_split_compile_threads() if given.nvcc_split_compile is None else None
    return FA2BuildConfig(
        split_cta_tiles=(given.split_cta_tiles if given.split_cta_tiles is not None else
                         flag("split_cta_tiles", False)),
        nvcc_split_compile=(switch("nvcc_split_compile", given.nvcc_split_compile, "nvcc_split_compile")
                            if given.nvcc_split_compile is not None else threads != 1),
        pin_kv_tiles=switch("pin_kv_tiles", given.pin_kv_tiles, "pin_kv_tiles"),
        skip_unused_headers=(given.skip_unused_headers if given.skip_unused_headers is not None and
                             not isinstance(given.skip_unused_headers, bool) else
                             switch("skip_unused_headers", given.skip_unused_headers, "skip_unused_headers")),
        nvcc_parallel_passes=switch("nvcc_parallel_passes", given.nvcc_parallel_passes, "nvcc_parallel_passes"))


def triton_config() -> TritonConfig:
    """FIVAR_TRITON_AUTOTUNE=0, FIVAR_TRITON_TMA=0 and FIVAR_TRITON_GLUON=0 (or another off word) turn those off
    (read when a twin is imported)."""
    return TritonConfig(autotune=flag("triton_autotune", True), tma=flag("triton_tma", True),
                        gluon=flag("triton_gluon", True))


def lowering_config() -> LoweringConfig:
    """The lowering choices in force: an override(position_tables=...), else FIVAR_POSITION_TABLES, else "costly"."""
    text, where = setting("position_tables")
    if text and text not in POSITION_TABLE_MODES:
        raise FivarError(f"{where}={text!r}: expected one of {', '.join(POSITION_TABLE_MODES)}")
    return LoweringConfig(position_tables=text or LoweringConfig.position_tables,
                          training=bool(_overrides.get().get("training", False)))


def variant_path() -> list[str]:
    """FIVAR_VARIANT_PATH's directories (os.pathsep-separated), first first."""
    return [p for p in os.environ.get(VARIANT_PATH_ENV, "").split(os.pathsep) if p]


def cache_dir_setting() -> str | None:
    """FIVAR_CACHE_DIR, where given."""
    return os.environ.get(CACHE_DIR_ENV) or None


def config_dir_setting() -> str | None:
    """FIVAR_CONFIG_DIR, where given (else $XDG_CONFIG_HOME/fivar, else ~/.config/fivar: fivar.trust)."""
    return os.environ.get(CONFIG_DIR_ENV) or None


def state_key() -> tuple:
    """Everything above the heuristics that can change a generated module: the overrides in force and every
    FIVAR_* tuning variable (fivar.jit.build's module memo keys on it)."""
    forced = _overrides.get()
    return (tuple(sorted((k, repr(v)) for k, v in forced.items())),
            tuple(os.environ.get(v, "") for v in ENV.values()))


def describe(config) -> str:
    """One line of a config's fields: what --explain and the cache commands print."""
    return ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in fields(config))


def replace(config, **changes):
    return dataclasses.replace(config, **changes)
