"""From a variant to a loaded FlashInfer JIT module.

One `gen_module(variant, op, target, dtypes, head_dim)` renders every source of the module, derives a
content-hashed URI from them (plus flags, FlashInfer/nvcc versions and target archs), writes them into
FlashInfer's generated-sources dir and returns a `FivarModule` wrapping FlashInfer's `JitSpec`. Building
runs FlashInfer's ninja under the module's own lock (fivar.jit.locks), and the manifest it then writes
(fivar.jit.manifest) is what later loads trust; loading goes through an in-process cache keyed by URI.
Since the URI covers everything that goes into the .so, an edited variant or a new toolchain gets a new
URI (never a stale library), and an unchanged one hits the existing build.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time

import torch

from .. import config as fivar_config
from ..codegen import fa2, fa3
from ..codegen.tile_list import bits_kernel, reads_bits, runs_unmapped
from ..config import FA2BuildConfig, FA3KernelConfig
from ..errors import FivarError
from . import locks, progress, records, toolchain
from ..flashinfer_compat import jit_log
from ..flashinfer_compat.templates import render_template as _render_flashinfer  # noqa: F401 (re-exported)
from .fa2_sources import fa2_sources
from .fa2_tile_split import _inst_statements, _single_prefill_split_problem, _split_warned  # noqa: F401
from .fa3_sources import fa3_sources
from .sources import fivar_headers  # noqa: F401 (re-exported)
from .targets import target_of
from .module_key import (DTYPES, FORM_OPTIONS, HEAD_DIMS, KV_DTYPE_OPS, KV_DTYPES, OPS,  # noqa: F401 (re-exported)
                         TARGETS, ModuleKey, dtype_name)
from .module import (FivarModule, _VERIFIED, _loaded, _sha256, _verified, check_buildable_paths, library_verified,
                     unsafe_in_build_files, variant_file_sha256)

log = logging.getLogger("fivar")


jit_log.install()  # before fivar first imports FlashInfer: its log on a read-only workspace


def kv_dtype_name(dt: torch.dtype, q_dtype: torch.dtype) -> str | None:
    """gen_module's `kv_dtype` for a cache of dtype `dt` read with queries of `q_dtype`: None when they match."""
    if dt == q_dtype:
        return None
    for k, v in KV_DTYPES.items():
        if v == dt:
            return k
    raise FivarError(f"KV-cache dtype {dt} is not supported with q {q_dtype} (use q's dtype, or one of "
                     f"{', '.join(str(v) for v in KV_DTYPES.values())})")


def gen_module(variant, op: str | ModuleKey = "single_prefill", target: str = "fa2", dtype: str = "bf16",
               head_dim: int = 128, *, config: FA2BuildConfig | FA3KernelConfig | None = None,
               **options) -> FivarModule:
    """All sources of one module of the form `op`, a ModuleKey (fivar.jit.module_key: what each form is), or
    given as (op, target, dtype, head_dim) and the key's form fields as keywords (kv_segments, mask_free,
    tile_list, kv_dtype, custom_mask, bounded_softmax). FA3 batch prefill of a mask that is more than a band is the
    tile-list form (fivar.runtime.fa3_tile_list): the paged kernel alone, with no mask mode but kNone (causal is the
    block map's). `config`: the target's tuning (fivar.config.FA2BuildConfig or FA3KernelConfig; a None field is
    chosen by fivar.config's overrides, the environment, then the heuristic).
    `options`: beside the form, the config's fields as keywords (what a manifest records), over `config`'s:
      FA2: split_cta_tiles (one kernel unit per CTA tile, _fa2_tile_split: same kernels, another URI; ~0.7x the
      longest unit for ~1.8x the CPU, so off by default), nvcc_split_compile (toolchain.split_compile_flags),
      pin_kv_tiles (fivar.jit.pinned_kv_tiles), skip_unused_headers (fivar.jit.unused_headers: True, False or a
      list of header names).
      FA3: exp2_emulated_of_8 (fivar.codegen.fa3.exp2_emulated_of_8), cta_tile ("QxKV", "QxKV,QxKV" non-causal then
      causal, "A|B" per-launch choices, or "flashinfer"; fa3.cta_tiles), bounded_softmax (the key's;
      fa3.softmax_range), schedule ("grid", "persistent" or "grid,persistent"; fa3.schedules).
      Both: nvcc_parallel_passes (toolchain.parallel_passes_flags).
    FA3 units keep FlashInfer's other flags: they hold one kernel each (fa3.tile_units), and their time is
    cudafe++ and cicc's front end, which --split-compile does not touch."""
    if isinstance(op, ModuleKey):
        key = op
        if "bounded_softmax" in options or set(options) & set(FORM_OPTIONS):
            raise TypeError("gen_module() takes the form as a ModuleKey or as keywords, not both")
    else:
        key, options = ModuleKey.from_options(op, target, dtype, head_dim, options)
    known = {f for cls in (FA2BuildConfig, FA3KernelConfig) for f in cls.__dataclass_fields__}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"gen_module() got unexpected keyword argument(s) {', '.join(unknown)}")
    user_variant, key = variant, key.checked(variant)
    variant = rendered_from(variant, key)
    shared = variant is not user_variant
    op, target, dtype, head_dim, on_fa3 = key.op, key.target, key.dtype, key.head_dim, key.fa3
    if key.bounded_softmax is not None:
        options["bounded_softmax"] = key.bounded_softmax
    cta_tile, schedule = options.get("cta_tile"), options.get("schedule")
    if config is not None:
        cta_tile = cta_tile if "cta_tile" in options else getattr(config, "cta_tile", None)
        schedule = schedule if "schedule" in options else getattr(config, "schedule", None)
    given = target_of(target).config_of({**({k: v for k, v in vars(config).items() if v is not None}
                                         if config is not None else {}), **options})
    toolchain.ensure_arch_env()
    if on_fa3 and "90a" not in toolchain.arch_tag().split("_"):
        raise FivarError(f"variant '{variant.name}': FA3 kernels are Hopper-only (sm_90a), but the target archs are "
                         f"{toolchain.arch_tag()} (FLASHINFER_CUDA_ARCH_LIST or --arch): build target fa2, or add 9.0a")
    nvcc_parallel_passes = fivar_config.switch("nvcc_parallel_passes", given.nvcc_parallel_passes,
                                               "nvcc_parallel_passes")
    r = (fa3_sources(user_variant, variant, key, given, nvcc_parallel_passes, shared) if on_fa3 else
         fa2_sources(variant, key, given, nvcc_parallel_passes, cta_tile, schedule))
    uri = f"fivar_{uri_name(variant.name)}_{key.uri_part()}_{content_hash(r.sources, r.cuda_cflags)}"
    return FivarModule(user_variant, op, target, dtype, head_dim, uri, r.sources, r.cuda_cflags, r.additional,
                       options={**key.as_options(), **manifest_options(r.built)}, kernel_variant=variant)


def rendered_from(variant, key: ModuleKey):
    """The variant a module of `variant` of the (checked) form `key` is rendered from. A tile-list module reading
    bits evaluates no mask: rendered from the mask-free bits_kernel, it is one module for every variant with the
    same logits and sink (one URI, whichever variant asks, with or without a custom mask); so is FA3's mask-free
    segments form (the logits alone)."""
    shared = (key.tile_list and reads_bits(variant, key.custom_mask)) or (key.mask_free and not key.kv_segments)
    return bits_kernel(variant) if shared else variant


def manifest_options(built: FA2BuildConfig | FA3KernelConfig) -> dict:
    """A module's resolved config as its manifest records it (and gen_module(**options) reads it back)."""
    out = {"nvcc_parallel_passes": built.nvcc_parallel_passes}
    for name in built.__dataclass_fields__:
        value = getattr(built, name)
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def serving_modules(variant, op: str, target: str, dtype: str = "bf16", head_dim: int = 128) -> list[FivarModule]:
    """What a build or prewarm of (variant, op, target) compiles: the modules that run `op` at runtime (a mask
    that is more than a band on FA3: its tile-list form, one module; with the bounded softmax, the
    running-max modules too; decode: also FA2 batch prefill, which runs it once a KV head serves >= 4 query heads
    or without softmax, fivar.runtime.attention.batch_decode; a mask trimming decode's pages runs only that, in its
    key-segments and tile-list forms)."""
    asked = ModuleKey(op, target, dtype, head_dim)
    if op == "batch_decode":
        prefill = asked.replace(op="batch_prefill", target="fa2")
        if fa2.trims_decode_pages(variant):  # FA2 batch prefill over the pages holding kept keys, always; the
            # tile-list form where a mask beyond a band keeps many runs of them (fivar.runtime.plans)
            return [gen_module(variant, k) for k in [prefill.replace(kv_segments=True)]
                    + ([prefill.replace(tile_list=True)] if variant.scans_mask else [])]
        # without softmax or with a sink, decode always runs on FA2 batch prefill
        return ([gen_module(variant, asked)] if variant.softmax and variant.sink is None else []) + [
            gen_module(variant, prefill)]
    key = asked.replace(op=serving_op(variant, op, target))
    keys = [key]  # FA3 batch prefill of a mask beyond a band is the tile-list form: one module
    if key.kernels.runs_key_segments and key.op in ("single_prefill", "batch_prefill") and variant.scans_mask:
        # prefill of a mask beyond a band runs in the tile-list form, a causal batch of segments (documents)
        # mask-free; single prefill runs as a batch of one, so only paged batches of one query a request (decode's
        # trimmed pages, the key-segments form, or the plain kernel) and FP8 caches (the block form) need the rest
        batch = key.replace(op="batch_prefill")
        keys = ([key, batch.replace(kv_segments=True)] if key.op == "batch_prefill" else []) + [
            batch.replace(tile_list=True), batch.replace(kv_segments=True, mask_free=True)]
    if key.kernels.tile_lists_every_mask and key.op == "batch_prefill" and variant.scans_mask and \
            runs_unmapped(variant):  # a causal batch of segments: the logits' mask-free kernel (runtime.plans)
        keys.append(key.replace(mask_free=True, tile_list=False))
    if key.kernels.bounds_softmax and fa3.softmax_range(variant, dtype) is not None:
        # a launch whose params make the range too wide runs the running-max module (fa3.bounded_softmax_applies)
        keys += [k.replace(bounded_softmax=False) for k in keys]
    return [gen_module(variant, k) for k in keys]


def serving_op(variant, op: str, target: str) -> str:
    """The op whose module runs `op` at runtime: FA3 single prefill of a mask that is more than a band runs
    as a batch of one in the tile-list form (fivar.runtime.fa3_tile_list), so builds and prewarms take that."""
    return "batch_prefill" if (target_of(target).tile_lists_every_mask and op == "single_prefill"
                               and variant.scans_mask) else op


#: the longest variant name a URI holds whole: a URI names a directory, `<uri>.so`, and objects named
#: `<uri>_<source stem>.cuda.o` (FlashInfer), all within a file name's 255 bytes
URI_NAME_MAX = 64


def uri_name(name: str) -> str:
    """The variant's name as a URI holds it: whole up to URI_NAME_MAX characters, else its start and a hash of the
    whole (still one name per variant; the manifest keeps the full name)."""
    if len(name) <= URI_NAME_MAX:
        return name
    return f"{name[:URI_NAME_MAX - 9]}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def content_hash(sources: dict[str, str], cuda_cflags: list[str]) -> str:
    """12 hex digits over every source (name and text), the flags, FlashInfer/nvcc versions and archs.

    The target archs go in as FlashInfer's arch list, not the -gencode flags it derives from them: those
    follow from the archs and the two versions, and deriving them runs nvcc in every fresh process."""
    h = hashlib.sha256()
    for name in sorted(sources):
        h.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    for item in (cuda_cflags, toolchain.arch_tag(), toolchain.flashinfer_version(), toolchain.nvcc_version(),
                 os.environ.get("FLASHINFER_JIT_DEBUG", ""), os.environ.get("FLASHINFER_JIT_LINEINFO", "")):
        h.update(repr(item).encode() + b"\0")
    return h.hexdigest()[:12]


def module_for(variant, key: ModuleKey | str, *args, **form) -> FivarModule:
    """gen_module(variant, key) with a per-process memo, so repeated calls skip rendering and hashing. `key`: a
    ModuleKey, or its fields as ModuleKey takes them (op, target, dtype, head_dim, then the form)."""
    if not isinstance(key, ModuleKey):
        key = ModuleKey(key, *args, **form)
    memo_key = (id(variant), key, fivar_config.state_key())
    m = _memo.get(memo_key)
    if m is None or m[0] is not variant:
        m = (variant, gen_module(variant, key))
        _memo[memo_key] = m
    return m[1]


_memo: dict[tuple, tuple] = {}


def build_many(modules: list[FivarModule], parallel: bool = True,
               on_done=None, progress: "progress.BatchProgress | None" = None) -> list[tuple[str, float]]:
    """Build modules, all cold compiles in one parallel ninja. Returns (cold|disk|memory, seconds) each: a cold
    module's seconds are its own compile seconds (its ninja edges' sum, fivar.jit.progress), not the batch's.

    The ninja run takes only the modules whose build lock (fivar.jit.locks) this process got at once, and holds
    each lock until that module's manifest is written, which happens as soon as ninja has linked it (a watcher
    reads ninja's log), not after the whole run: a concurrent prewarm, build, clear or prune never touches a
    module in flight. Modules another process is building are waited for afterwards, one lock at a time.
    `on_done(module, kind, seconds)` is called as each module is ready; `progress` (fivar.jit.progress) prints a
    line per module of the ninja run as it is ready and a heartbeat while none is (a module built on its own
    prints its own lines on stderr); with it, one module to build also goes through the ninja run."""
    import contextlib

    results: dict[str, tuple[str, float]] = {}
    unique = list({m.uri: m for m in modules}.values())

    def done(m, kind, secs, batch=False):
        results[m.uri] = (kind, secs)
        if progress is not None:
            progress.module_done(m, kind, secs, announce=batch or kind == "disk")
        if on_done is not None:
            on_done(m, kind, secs)
    for m in unique:
        if m.uri in _loaded:
            done(m, "memory", 0.0)
        elif m.manifest_ok():
            done(m, "disk", 0.0)
    todo = [m for m in unique if m.uri not in results]
    if parallel and len(todo) > (0 if progress is not None else 1):
        with contextlib.ExitStack() as held:
            mine = []
            for m in todo:
                check_buildable_paths(m)
                if held.enter_context(locks.build_lock(m.build_dir, wait=False)):
                    if m.manifest_ok():  # finished by another process before we got its lock
                        done(m, "disk", 0.0)
                    else:
                        mine.append(m)
            if len(mine) > (0 if progress is not None else 1):
                _ninja_batch(mine, done, progress)
            # the rest (one module, another process's, a failed one) below: the per-module path names a failure
    for m in unique:
        if m.uri not in results:
            t0 = time.perf_counter()
            kind = m._build()
            done(m, kind, m.compile_seconds if kind == "cold" else time.perf_counter() - t0)
    records.record_many([(m, *results[m.uri]) for m in unique])
    return [results[m.uri] for m in modules]


def _ninja_batch(mine: list[FivarModule], done, reporter=None, ninja: str = "ninja") -> None:
    """One ninja run over `mine` (whose build locks the caller holds; fivar.jit.progress.run_ninja_batch); each
    module's manifest is written the moment ninja's log shows its library linked in this run, with its own
    compile seconds from that log."""
    import threading

    from filelock import FileLock
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.core import get_tmpdir
    t0 = time.perf_counter()
    for m in mine:
        m._prepare()
    specs = [m.jit_spec() for m in mine]
    for spec in specs:  # as FlashInfer's build_jit_specs writes them
        with FileLock(spec.lock_path, thread_local=False):
            spec.write_ninja()
    workdir = jit_env.FLASHINFER_JIT_DIR
    watch = progress.LogWatch(workdir / progress.LOG_NAME, {m.uri: m.build_dir for m in mine})
    pending = {m.uri: m for m in mine}
    running: list = [None]
    stop = threading.Event()
    if reporter is not None:
        reporter.batch_started(sum(len(s.sources) for s in specs))

    def finish(final: bool):
        times = watch.poll()
        if reporter is not None:
            reporter.units(sum(t.units for t in times.values()), running[0])
        for uri in list(pending):
            m, t = pending[uri], times.get(uri)
            # after a run that failed, only what ninja's log says it linked: a library left by a failed link is
            # not trusted
            if (t is not None and t.linked) or (final and m.library_path.exists()):
                # the batch's wall time only where ninja's log is unreadable (it logs every edge it runs)
                secs = t.seconds if t is not None and t.seconds > 0 else time.perf_counter() - t0
                try:
                    m.write_manifest(secs)
                except OSError:
                    continue
                del pending[uri]
                done(m, "cold", secs, batch=True)
        if reporter is not None:
            reporter.tick()

    def watch_loop():
        while not stop.wait(progress.POLL_S):
            finish(final=False)
    jobs = os.environ.get("FLASHINFER_JIT_PREBUILD_MAX_JOBS", "") or os.environ.get("MAX_JOBS", "")
    watcher = threading.Thread(target=watch_loop, name="fivar-manifests", daemon=True)
    watcher.start()
    ok = False
    try:
        # under FlashInfer's lock for its parallel builds: one such ninja at a time in its JIT directory
        with FileLock(get_tmpdir() / "flashinfer_jit.lock", thread_local=False):
            progress.run_ninja_batch([s.ninja_path for s in specs], [m.library_path for m in mine], workdir,
                                     get_tmpdir() / "fivar_batch.ninja", int(jobs) if jobs.isdigit() else None,
                                     ninja=ninja, on_status=lambda f, t, r: running.__setitem__(0, r))
        ok = True
    except Exception:  # noqa: BLE001 - the per-module builds after this name the module that failed
        pass
    finally:
        stop.set()
        watcher.join()
    finish(final=ok)
