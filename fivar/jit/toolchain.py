"""What a compiled module depends on besides its sources: FlashInfer, nvcc and the target archs."""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess

from .. import config
from ..errors import FivarError


def cpu_count() -> int:
    """The cores this process may run on (its affinity), which bound the build's parallelism."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def ensure_arch_env() -> None:
    """FlashInfer fixes its target archs (and cache directory) at import: decide them before that.

    On a machine without a GPU there is nothing to detect, so fivar asks for an explicit arch instead of
    letting FlashInfer fail deep inside a compile.
    """
    ensure_cuda_home()
    if os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        check_arch_list(os.environ["FLASHINFER_CUDA_ARCH_LIST"], "FLASHINFER_CUDA_ARCH_LIST")
        return
    import torch
    if not torch.cuda.is_available():
        raise FivarError("no CUDA GPU is visible, so fivar cannot pick a target architecture: set "
                         "FLASHINFER_CUDA_ARCH_LIST (e.g. FLASHINFER_CUDA_ARCH_LIST=9.0a) or pass --arch")


def check_arch_list(text: str, where: str) -> None:
    """FlashInfer's arch list is space-separated major.minor with an optional suffix ("9.0a 10.0a"); it fails with a
    bare ValueError on anything else."""
    if not text.split() or not all(re.fullmatch(r"\d+\.\d+[a-z]?", a) for a in text.split(" ")):
        raise FivarError(f"{where}={text!r}: expected CUDA archs as major.minor, space-separated, e.g. 9.0a or "
                         "'9.0a 10.0a'")


def set_arch_env(arch: str | None, where: str = "--arch") -> None:
    """A command's `--arch`: checked (also against the archs this nvcc knows), then FlashInfer's arch list for this
    process (before FlashInfer is imported)."""
    if arch:
        check_arch_list(arch, where)
        unknown = [a for a in arch.split() if not nvcc_supports(a)]
        if unknown:
            raise FivarError(f"{where}={arch!r}: this nvcc ({os.path.join(cuda_home(), 'bin', 'nvcc')}) cannot compile "
                             f"for {', '.join(unknown)}; it knows {', '.join(nvcc_archs()) or 'none'} (with an optional "
                             "'a' or 'f' suffix, e.g. 9.0a)")
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = arch


@functools.cache
def nvcc_archs() -> tuple[str, ...]:
    """The archs `nvcc --list-gpu-arch` names, as major.minor ("9.0"); empty when nvcc cannot be asked."""
    try:
        out = subprocess.run([os.path.join(cuda_home(), "bin", "nvcc"), "--list-gpu-arch"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(f"{int(m[:-1])}.{m[-1]}" for m in re.findall(r"compute_(\d+)", out))


def nvcc_supports(arch: str) -> bool:
    """Whether nvcc can compile for `arch` ("9.0a"); True when nvcc cannot be asked (the build then says why)."""
    known = nvcc_archs()
    m = re.fullmatch(r"(\d+\.\d+)([a-z]?)", arch)
    return not known or bool(m and m.group(1) in known and m.group(2) in ("", "a", "f"))


def cuda_home() -> str:
    """CUDA_HOME or CUDA_PATH, else the toolkit the nvcc on PATH belongs to: the directory above its bin/, or
    /usr/local/cuda, whichever holds the CUDA runtime a module links against (an nvcc on PATH may be a wrapper
    script outside the toolkit, where FlashInfer would look for libcudart in the wrong place)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if any(os.path.exists(os.path.join(c, lib, "libcudart.so")) for lib in ("lib64", "lib")):
            return c
    return candidates[0]


def ensure_cuda_home() -> None:
    """Give FlashInfer's JIT the toolkit cuda_home() found when neither CUDA_HOME nor CUDA_PATH is set."""
    if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        os.environ["CUDA_HOME"] = cuda_home()


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    """nvcc's version (part of every module's content hash). Running `nvcc --version` costs 3-12 ms, in
    every fresh process that renders a module, so the answer is kept on disk per nvcc binary (its real
    path, size and mtime: a replaced or upgraded nvcc is asked again)."""
    nvcc = os.path.join(cuda_home(), "bin", "nvcc")
    if not os.path.exists(nvcc):
        nvcc = shutil.which("nvcc") or nvcc
    try:
        st = os.stat(nvcc)
        key = f"{os.path.realpath(nvcc)}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        key = None
    known = _nvcc_versions()
    if key in known:
        return known[key]
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        raise FivarError(f"nvcc was not found (looked for {nvcc}); set CUDA_HOME to the CUDA toolkit, "
                         "e.g. CUDA_HOME=/usr/local/cuda") from None
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    version = m.group(2) if m else out.strip().splitlines()[-1]
    if key is not None and m:
        _remember_nvcc_version(key, version)
    return version


def _nvcc_versions_file():
    from ..cache import cache_dir
    return cache_dir() / "nvcc_versions.json"


def _nvcc_versions() -> dict:
    try:
        return json.loads(_nvcc_versions_file().read_text())
    except (OSError, ValueError, RecursionError, FivarError):  # RecursionError: JSON nested too deep to read
        return {}


def _remember_nvcc_version(key: str, version: str) -> None:
    try:
        path = _nvcc_versions_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**_nvcc_versions(), key: version}))
        os.replace(tmp, path)
    except (OSError, FivarError):
        pass  # only a cache


SPLIT_COMPILE_ENV = config.ENV["nvcc_split_compile"]
#: In an FA2 module's flags (so in its URI): nvcc's --split-compile is on. The thread count is added when the
#: module is built (build_flags): nvcc's output does not depend on it once it is 2 or more (checked by
#: tests/unit/test_build.py), so the same URI names the same library on a 2-core box and a 64-core host.
SPLIT_COMPILE_FLAG = "--split-compile"


def split_compile_on(setting: bool | None = None) -> bool:
    """Whether FA2 modules compile with nvcc's --split-compile: `setting`, else fivar.config's (FIVAR_NVCC_SPLIT_COMPILE
    != 1)."""
    if setting is None:
        return config.nvcc_split_compile_threads() != 1
    if not isinstance(setting, bool):
        raise FivarError(f"nvcc_split_compile={setting!r}: expected True or False")
    return setting


def switch(env: str, setting: bool | None, option: str) -> bool:
    """An on-by-default build option: `setting` (gen_module's `option`) if given, else fivar.config's setting of the
    field whose variable is `env`."""
    return config.switch(next(k for k, v in config.ENV.items() if v == env), setting, option)


def split_compile_threads() -> int:
    """Threads per nvcc for --split-compile: FIVAR_NVCC_SPLIT_COMPILE when it names 2 or more, else half the cores
    this process may use, between 2 and 8 (ninja runs several units at once; more threads than that only add the
    CPU a split costs: on the 2-core CI box 8 threads took 24% more CPU-seconds than none)."""
    n = config.nvcc_split_compile_threads()
    if n is not None and n >= 2:
        return n
    return max(2, min(8, cpu_count() // 2))


def split_compile_flags(on: bool) -> list[str]:
    """nvcc's --split-compile for FA2 units (hashed into the URI as SPLIT_COMPILE_FLAG; build_flags adds the
    count). cicc's optimizer and ptxas work on a unit's kernels in parallel threads: an FA2 prefill unit holds
    one kernel per CTA tile and NUM_MMA_KV (up to 16 for one mask mode), and those phases are most of its time,
    so with idle cores (one module is 2-3 units) a unit finishes sooner. An nvcc older than 12.0 gets no flag."""
    if not on:
        return []
    m = re.match(r"(\d+)\.(\d+)", nvcc_version())
    if m and (int(m.group(1)), int(m.group(2))) < (12, 0):
        return []
    return [SPLIT_COMPILE_FLAG]


PARALLEL_PASSES_ENV = config.ENV["nvcc_parallel_passes"]
PARALLEL_PASSES_FLAG = "--threads"


def parallel_passes_flags(on: bool) -> list[str]:
    """nvcc's --threads for fivar's units (hashed into the URI as PARALLEL_PASSES_FLAG; build_flags adds the count).

    nvcc compiles a .cu in two passes: host (preprocess, cudafe++) and device (preprocess, cicc, ptxas, fatbinary),
    then the host compiler over cudafe++'s output with the fatbinary embedded. With --threads=1, which FlashInfer
    passes unless FLASHINFER_NVCC_THREADS says otherwise, it runs them one after the other; with more threads it runs
    the host pass beside the device passes, even for one arch (nvcc's help says the option is ignored then; a gcc
    wrapper timing the two preprocessing runs shows them overlap). The output is the same (tests/unit/test_build.py).
    For a pinned FA2 kernel unit the host pass is about a third of its time (benchmarks/tools/nvcc_phases.py)."""
    return [PARALLEL_PASSES_FLAG] if on else []


def build_flags(cuda_cflags: list[str]) -> list[str]:
    """A module's hashed flags as nvcc gets them: SPLIT_COMPILE_FLAG with this host's thread count, and
    PARALLEL_PASSES_FLAG with one thread per target arch plus one for the host pass. Both come after FlashInfer's
    own --threads in the command line (FlashInfer appends a spec's extra flags last), and nvcc takes the last."""
    counts = {SPLIT_COMPILE_FLAG: split_compile_threads, PARALLEL_PASSES_FLAG: lambda: len(target_archs()) + 1}
    return [f"{f}={counts[f]()}" if f in counts else f for f in cuda_cflags]


#: Below this many cores an FA3 tile unit (fivar.codegen.fa3.tile_units) compiles inside its mask mode's unit: a module's
#: units with nvcc's host and device passes side by side already keep that many cores busy, so a unit of its own only
#: adds a front end (about 32 CPU-seconds: 2 cores, 61 -> 81 s for the soft-cap module) for no shorter wall time.
SPLIT_TILE_UNITS_MIN_CORES = 8
_TILE_UNIT = re.compile(r"(.+_mask_\d+)_tile\d+\.cu")


def compile_units(units: list, build_dir) -> list:
    """The translation units nvcc runs for a module's .cu sources (paths in its generated folder). Every source on a
    host of SPLIT_TILE_UNITS_MIN_CORES or more; below, each FA3 tile unit joins its mask mode's unit in one
    translation unit written to the module's build folder (`#include` of both sources, unchanged), the two-kernel
    unit of old. Not part of the URI: the sources are the same and so are the kernels (the two layouts' SASS is the
    same byte for byte); only how the objects split the library differs."""
    from pathlib import Path

    tiles: dict[str, list] = {}
    for u in units:
        m = _TILE_UNIT.fullmatch(Path(u).name)
        if m:
            tiles.setdefault(m.group(1) + ".cu", []).append(Path(u))
    if not tiles or cpu_count() >= SPLIT_TILE_UNITS_MIN_CORES:
        return list(units)
    out, folder = [], Path(build_dir) / "fivar_units"
    for u in units:
        u = Path(u)
        if _TILE_UNIT.fullmatch(u.name):
            continue
        if u.name not in tiles:
            out.append(u)
            continue
        folder.mkdir(parents=True, exist_ok=True)
        grouped = folder / u.name
        text = "".join(f'#include "{p.resolve()}"\n' for p in [u, *sorted(tiles[u.name])])
        if not grouped.exists() or grouped.read_text() != text:
            tmp = grouped.with_name(f".{grouped.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, grouped)
        out.append(grouped)
    return out


def flashinfer_version() -> str:
    import flashinfer
    return flashinfer.__version__


def target_archs() -> set[tuple[int, str]]:
    """FlashInfer's target archs for this process, as (major, minor with suffix) pairs: {(9, "0a")}."""
    from flashinfer.jit.core import current_compilation_context
    return set(current_compilation_context.TARGET_CUDA_ARCHS)


def arch_tag() -> str:
    return "_".join(f"{a}{b}" for a, b in sorted(target_archs()))


@functools.cache
def _libcuda_linkable() -> bool:
    import ctypes.util  # find_library runs ldconfig and gcc (tens of ms): asked once per process, and last
    return os.path.exists(os.path.join(cuda_home(), "lib64", "stubs", "libcuda.so")) or \
        bool(ctypes.util.find_library("cuda"))


def link_flags() -> list[str]:
    """On a machine with no CUDA driver (CI), link against an empty libcuda stub.

    The stub has the driver's soname, so a library linked here still binds the real driver where one
    exists; it only lets the linker finish so that builds can be checked without a GPU.
    """
    if _libcuda_linkable():
        return []
    from ..cache import cache_dir
    stub_dir = cache_dir() / "libcuda-stub"
    stub = stub_dir / "libcuda.so"
    if not stub.exists():
        stub_dir.mkdir(parents=True, exist_ok=True)
        src = stub_dir / "stub.c"
        src.write_text("/* empty: see fivar.jit.toolchain.link_flags */\n")
        tmp = stub_dir / f".libcuda.{os.getpid()}.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)],
                       check=True, capture_output=True)
        os.replace(tmp, stub)
    return [f"-L{stub_dir}"]


def extra_include_paths() -> list[str]:
    """Headers a minimal CUDA toolkit may lack (FA3's CUTLASS utilities include curand_kernel.h).

    Falls back to the pip-installed NVIDIA packages (`pip install nvidia-curand`) when the toolkit has none.
    """
    if os.path.exists(os.path.join(cuda_home(), "include", "curand_kernel.h")):
        return []
    try:
        import nvidia
    except ImportError:
        return []
    for base in nvidia.__path__:
        for sub in ("cu13/include", "curand/include", "cu12/include"):
            d = os.path.join(base, sub)
            if os.path.exists(os.path.join(d, "curand_kernel.h")):
                return [d]
    return []


def report() -> list[tuple[str, str]]:
    """What builds depend on, as (name, value) pairs for `fivar doctor`: nvcc, CUDA_HOME, the arch list, and the
    versions of torch, triton and FlashInfer. Nothing here raises: a missing piece is reported as such."""
    def ask(fn) -> str:
        try:
            return str(fn())
        except Exception as e:  # noqa: BLE001 - the report says what is missing instead of failing
            return f"unavailable ({str(e).splitlines()[0] if str(e) else type(e).__name__})"

    def version(module: str) -> str:
        import importlib
        return importlib.import_module(module).__version__

    def archs() -> str:
        text = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
        if text:
            return f"{text} (FLASHINFER_CUDA_ARCH_LIST)"
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}.{minor} (the visible GPU, {torch.cuda.get_device_name()})"
        return "none: no GPU visible and FLASHINFER_CUDA_ARCH_LIST unset (builds need --arch)"

    nvcc = os.path.join(cuda_home(), "bin", "nvcc")
    return [("nvcc", ask(lambda: f"{nvcc_version()} ({nvcc if os.path.exists(nvcc) else shutil.which('nvcc')})")),
            ("CUDA_HOME", cuda_home() + ("" if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") else
                                         " (found; CUDA_HOME unset)")),
            ("nvcc archs", ask(lambda: " ".join(nvcc_archs()) or "unknown")),
            ("target archs", ask(archs)),
            ("torch", ask(lambda: version("torch"))),
            ("triton", ask(lambda: version("triton"))),
            ("flashinfer", ask(flashinfer_version))]
