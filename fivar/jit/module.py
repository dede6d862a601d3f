"""A module fivar builds: its sources, where it lives in the cache, building (one JitSpec through FlashInfer's JIT)
and loading it, the manifest that vouches for its library, and what a failed build says. Rendering the sources is
fivar.jit.build's (gen_module); building many at once too (build_many)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path


from ..errors import FivarBuildError, FivarError
from . import locks, progress, records, toolchain
from . import manifest as manifests


_loaded: dict[str, object] = {}  # URI -> loaded module (the in-process cache)
log = logging.getLogger("fivar")


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
    #: gen_module's rendering options beyond (variant, op, target, dtype, head_dim), resolved: recorded in the
    #: manifest, so `fivar cache` re-renders a module the way it was built to decide whether it is stale.
    options: dict = field(default_factory=dict)
    #: the last cold build's own compile seconds in this process (fivar.jit.progress: its ninja edges' sum)
    compile_seconds: float | None = field(default=None, repr=False, compare=False)
    #: the variant the struct was rendered from, whose params the kernel takes (fivar.runtime.params.kernel_args):
    #: `variant` itself, or for a tile-list module reading bits the mask-free kernel it shares with every variant of
    #: the same logits (fivar.codegen.tile_list.bits_kernel)
    kernel_variant: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.kernel_variant is None:
            self.kernel_variant = self.variant

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
            units = [self.gen_dir / n for n in self.sources if n.endswith(".cu")]
            paths = toolchain.compile_units(units, self.build_dir)  # FA3 tile units grouped on few cores
            self.spec = gen_jit_spec(self.uri, paths, extra_cuda_cflags=toolchain.build_flags(self.cuda_cflags) or None,
                                      # ninja runs the link line through the shell: a stub dir under a
                                      # FIVAR_CACHE_DIR with a space stays one argument
                                      extra_ldflags=[shlex.quote(f) for f in toolchain.link_flags()] or None,
                                      extra_include_paths=toolchain.extra_include_paths() or None)
        return self.spec

    @property
    def manifest_path(self) -> Path:
        return self.build_dir / manifests.NAME

    def read_manifest(self) -> tuple[dict | None, str | None]:
        """(manifest, None) or (None, why): validated (fivar.jit.manifest), never a raw list or null."""
        return manifests.read(self.manifest_path)

    def manifest_ok(self) -> bool:
        """The library fivar recorded after its last successful build is still there, byte for byte.

        Trusting this (instead of asking ninja) is safe because the URI already hashes every input. The
        library's sha256 is checked against the manifest once per (size, mtime, inode, ctime) of the file
        (library_verified), so a same-size corruption is caught and a warm load costs a stat, not a hash.
        """
        man, _ = self.read_manifest()
        if man is None or man["uri"] != self.uri or manifests.origin_problem(man):  # a foreign library: rebuilt
            return False
        try:
            st = self.library_path.stat()
        except OSError:
            return False
        return man["so_size"] == st.st_size and man["so_mtime_ns"] == st.st_mtime_ns and \
            library_verified(self.library_path, st, man["so_sha256"])

    def write_manifest(self, seconds: float) -> bool:
        """Record the library just built. A valid manifest of this very library is kept as it is (its compile
        time stays the build's, never a later hit's). Returns whether it wrote one."""
        st = self.library_path.stat()
        old, _ = self.read_manifest()
        if old is not None and old["uri"] == self.uri and old["so_size"] == st.st_size and \
                old["so_mtime_ns"] == st.st_mtime_ns:
            return False
        sha = _sha256(self.library_path)
        man = {"schema": manifests.SCHEMA_VERSION, "uri": self.uri, "variant": self.variant.name, "op": self.op,
               "target": self.target, "dtype": self.dtype, "head_dim": self.head_dim, "so_size": st.st_size,
               "so_mtime_ns": st.st_mtime_ns, "compile_seconds": round(seconds, 3),
               "flashinfer": toolchain.flashinfer_version(), "nvcc": toolchain.nvcc_version(),
               "arch": toolchain.arch_tag(), "created": time.time(),
               "so_sha256": sha, "sources": sorted(self.sources), "cuda_cflags": list(self.cuda_cflags),
               "variant_file": getattr(self.variant, "source_file", None),
               "variant_file_sha256": variant_file_sha256(self.variant), "options": self.options,
               "provenance": {"kind": "build"}}
        _write_if_different(self.manifest_path, json.dumps(man, indent=1))
        _remember_verified(self.library_path, st, sha)
        return True

    def _missing_sources(self) -> list[str]:
        """Generated sources gone from a module built here before (a first build has none yet: its directory may
        exist already, made for its lock, so "built before" means a library or a manifest is there)."""
        if not (self.library_path.exists() or self.manifest_path.exists()):
            return []
        return [n for n in self.sources if not (self.gen_dir / n).exists()]

    def _prepare(self, missing: list[str] | None = None) -> None:
        """Before running ninja: regenerate any missing source, and drop a library that does not match
        its manifest (ninja would trust a truncated .so whose mtime is newer than its objects)."""
        missing = self._missing_sources() if missing is None else missing
        self.jit_spec()
        for name in missing:
            log.warning("fivar: %s: generated source %s was missing; regenerated", self.uri, name)
        self.gen_dir.mkdir(parents=True, exist_ok=True)  # evicted (clear, prune) since jit_spec() made it
        for name, text in self.sources.items():
            _write_if_different(self.gen_dir / name, text)
        if self.library_path.exists() and not self.manifest_ok():
            man, bad = self.read_manifest()
            foreign = manifests.origin_problem(man) if man else None
            why = ("has no manifest" if bad == "missing" else f"has a {bad}" if bad
                   else f"was {foreign}" if foreign else "does not match its manifest")
            log.warning("fivar: %s: library %s %s (%s); rebuilding", self.uri, self.library_path, why,
                        "not loaded" if foreign else "interrupted build or corrupted file")
            self.library_path.unlink()
            self.manifest_path.unlink(missing_ok=True)

    def build(self) -> str:
        """Compile if needed. Returns 'memory', 'disk' or 'cold' (what it took to get the library).

        Every call is recorded (fivar.jit.records): cold/disk at once, memory hits counted in process."""
        t0 = time.perf_counter()
        kind = self._build()
        records.record(self, kind, self.compile_seconds if kind == "cold" else time.perf_counter() - t0)
        return kind

    def _build(self) -> str:
        if self.uri in _loaded:
            return "memory"
        if self.manifest_ok():
            return "disk"
        try:
            check_buildable_paths(self)
            missing = self._missing_sources()
            spec = self.jit_spec()
            with locks.build_lock(self.build_dir):
                if self.manifest_ok():  # another process finished it while we waited
                    return "disk"
                first = not (self.library_path.exists() or self.manifest_path.exists())
                self._prepare(missing)
                lone = progress.SingleBuild(self, "first use of this module" if first else
                                            "its library was missing or did not match its manifest")
                spec.build()
                self.compile_seconds = lone.finished()  # its units' and link's own seconds (fivar.jit.progress)
                self.write_manifest(self.compile_seconds)
        except FivarError:
            raise
        except OSError as e:
            if e.filename == "ninja":  # FlashInfer runs `ninja`: not installed, not a cache problem
                raise FivarError(f"variant '{self.variant.name}': building {self.uri} needs ninja, which was not found "
                                 "on PATH (pip install ninja)") from None
            raise _cache_write_error(self, e) from None
        except Exception as e:  # ninja/nvcc failed: say whose failure it is (_build_failure)
            if "No space left on device" in str(e):
                raise _cache_write_error(self, OSError(28, "No space left on device")) from None
            log = self.build_dir / "fivar_build_error.log"
            try:
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text(str(e))
            except OSError:
                pass
            arch = re.search(r"Unsupported gpu architecture '(\S+)'", str(e))
            if arch:  # the arch list, not the sources
                raise FivarError(
                    f"variant '{self.variant.name}': nvcc at {toolchain.cuda_home()} cannot compile for {arch.group(1)} "
                    f"(FLASHINFER_CUDA_ARCH_LIST={os.environ.get('FLASHINFER_CUDA_ARCH_LIST', '')!r} or --arch); "
                    f"name an arch it knows, e.g. 9.0a (log: {log})") from None
            missing = re.search(r"cannot find -l(\w+)", str(e))
            if missing:  # the toolchain, not the sources: say what to fix
                raise FivarError(
                    f"variant '{self.variant.name}': linking {self.uri} failed: the linker cannot find lib"
                    f"{missing.group(1)} (CUDA toolkit at {toolchain.cuda_home()}); set CUDA_HOME to the CUDA "
                    f"toolkit, e.g. CUDA_HOME=/usr/local/cuda (log: {log})") from None
            raise _build_failure(self, e, log) from None
        return "cold"

    def load(self):
        mod = _loaded.get(self.uri)
        if mod is None:
            t0 = time.perf_counter()
            kind = self._build()
            # the hold (fivar.jit.locks) before the last check: an eviction either happened before it (the
            # library is gone: build again) or waits until this process exits
            for _ in range(3):
                locks.hold(self.build_dir)
                if self.manifest_ok():
                    break
                locks.release_hold(self.build_dir)
                kind = self._build()
            try:
                # the library is the one its manifest names: no JitSpec (link flags, source checks) to load it
                import tvm_ffi
                mod = tvm_ffi.load_module(str(self.library_path))
            except Exception as e:
                raise FivarError(f"variant '{self.variant.name}': loading {self.library_path} failed: "
                                 f"{e}") from None
            _loaded[self.uri] = mod
            records.record(self, kind, self.compile_seconds if kind == "cold" else time.perf_counter() - t0,
                           action="load", holder=True, background=True)
        else:
            records.memory_hit(self)  # a counter bump, no I/O (see fivar.jit.records)
        return mod


#: What a compiler (or the shell, or the kernel) says when the compile backend itself failed, not the sources
_BACKEND_FAILED = re.compile(r"died due to signal|\bKilled\b|out of memory|cannot allocate memory|virtual memory "
                             r"exhausted|: not found$|: Permission denied$|"
                             r"internal compiler error|Segmentation fault", re.I | re.M)


def _failed_steps(text: str) -> list[tuple[str, list[str]]]:
    """(command, its output lines) of each step ninja reports as FAILED in FlashInfer's "Ninja build failed" text."""
    steps, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("FAILED: ") and i + 1 < len(lines):
            out = []
            for follow in lines[i + 2:]:
                if follow.startswith(("FAILED: ", "ninja: ")) or re.match(r"\[\d+/\d+\] ", follow):
                    break
                out.append(follow)
            steps.append((lines[i + 1], out))
    return steps


def _build_failure(m: "FivarModule", e: Exception, log: Path) -> FivarError:
    """The error for a failed build, naming whose failure it is: the compiler launcher (--launcher), the compile
    backend (ninja, nvcc or the host compiler dying or missing), FlashInfer's JIT, or fivar (a compiler diagnostic
    on sources fivar generated, or an exception in fivar itself)."""
    who = f"variant '{m.variant.name}': building {m.uri} failed"
    text = str(e)
    if not text.startswith("Ninja build failed"):  # FlashInfer's run_ninja; anything else raised before ninja ran
        tb, frame_file = e.__traceback__, ""
        while tb is not None:
            frame_file, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
        import flashinfer
        if Path(frame_file).resolve().is_relative_to(Path(flashinfer.__file__).resolve().parent):
            first = text.strip().splitlines()[0] if text.strip() else ""
            return FivarError(f"{who} in FlashInfer {flashinfer.__version__}'s JIT (not in the variant or fivar's "
                              f"sources): {type(e).__name__}: {first} (log: {log})")
        return FivarBuildError(f"{who}: fivar raised {type(e).__name__} while building; this is a fivar bug, please "
                               f"report it with the log at {log}")
    steps = _failed_steps(text)
    launchers = {os.environ.get(v, "").strip() for v in ("FLASHINFER_NVCC_LAUNCHER", "FLASHINFER_CXX_LAUNCHER")} - {""}
    for command, out in steps:
        launcher = next((lc for lc in launchers if command.startswith(lc + " ")), None)
        said = " ".join(line.strip() for line in out if line.strip())
        if launcher and (not said or f"{Path(launcher.split()[0]).name}:" in said):
            # the compiler prints diagnostics; a launcher failing on its own prints nothing, or its own name
            return FivarError(f"{who} in the compiler launcher {launcher} (--launcher / FLASHINFER_NVCC_LAUNCHER), "
                              f"not in the compiler: {said[:300] or 'it exited non-zero with no output'}; check "
                              f"the launcher (its server and cache backend), or build without it (log: {log})")
    backend = _BACKEND_FAILED.search("\n".join(line for _, out in steps for line in out)) if steps else None
    if backend or not steps:
        line = next((ln.strip() for _, out in steps for ln in out if _BACKEND_FAILED.search(ln)),
                    text.strip().splitlines()[-1] if text.strip() else "")
        return FivarError(f"{who} in the compile backend (ninja, nvcc at {toolchain.cuda_home()} or the host "
                          f"compiler), not in the sources: {line[:300]}; if a compiler was killed, build with fewer "
                          f"jobs (--jobs, MAX_JOBS) (log: {log})")
    return FivarBuildError(f"{who}: the compiler refused sources fivar generated from an accepted spec, so this is a "
                           f"fivar bug; please report it with the log at {log}")


#: FlashInfer writes paths unquoted into build.ninja, whose commands ninja runs through /bin/sh: whitespace, `$`, `:`
#: and `|` are ninja syntax, and the rest would be the shell's (a backtick or `$(...)` in a directory name would run)
_UNSAFE_IN_BUILD_FILES = re.compile(r"[\s$:|`;&<>()'\"\\*?\[\]]")


def unsafe_in_build_files(text: str, unsafe: re.Pattern = _UNSAFE_IN_BUILD_FILES) -> str | None:
    """The ninja or shell syntax in a path FlashInfer would write unquoted into build.ninja, shown for a
    one-line error ("a space '$' ';'"), or None when it holds none."""
    bad = sorted(set(unsafe.findall(text)))
    return " ".join("a space" if c == " " else repr(c) for c in bad) or None


def check_buildable_paths(m: "FivarModule") -> None:
    """Before compiling (never before loading a prebuilt module): every path FlashInfer writes into the module's
    build.ninja (its workspace, the CUDA toolkit, include and library directories) must reach nvcc as the path it
    is: FlashInfer quotes none of them, so a path holding ninja or shell syntax is refused here, naming the path
    and what sets it, before any build file is written or command run."""
    from flashinfer.jit import cpp_ext
    from flashinfer.jit import env as jit_env
    places = [("FLASHINFER_WORKSPACE_BASE", m.build_dir), ("FLASHINFER_WORKSPACE_BASE", m.gen_dir),
              ("CUDA_HOME", toolchain.cuda_home())]
    places += [("the include paths fivar adds", p) for p in toolchain.extra_include_paths()]
    places += [("FlashInfer's installation", p) for p in
               (jit_env.FLASHINFER_INCLUDE_DIR, jit_env.FLASHINFER_CSRC_DIR, *cpp_ext.get_cccl_includes())]
    # the libcuda stub's directory reaches the shell quoted (jit_spec): only ninja's `$` and a line break matter
    places += [("FIVAR_CACHE_DIR", f[2:], re.compile(r"[$\n]")) for f in toolchain.link_flags() if f.startswith("-L")]
    for what, path, *unsafe in places:
        text = str(Path(path).resolve())
        shown = unsafe_in_build_files(text, *unsafe)
        if shown:
            at = text if text.isprintable() else repr(text)  # a line break in the path would break the line
            raise FivarError(
                f"variant '{m.variant.name}': cannot compile with {what} at {at}: FlashInfer writes that path "
                f"unquoted into build.ninja, whose commands run through the shell, and it holds {shown}; set {what} "
                f"to a directory without them (a symlink to this one works); loading modules already built there is "
                f"fine")


#: library path -> (size, mtime_ns, inode, ctime_ns, sha256) this process has hashed
_verified: dict[str, tuple] = {}
_VERIFIED = ".fivar.verified"


def _stamp(st: os.stat_result) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]


def library_verified(path: Path, st: os.stat_result, sha256: str) -> bool:
    """Whether the library at `path` (stat `st`) hashes to `sha256`. Hashed once per file version: the
    result is kept in process and in `.fivar.verified` beside it (best effort: a read-only cache re-hashes
    once per process). Any write to the file changes its ctime, which nothing can set back."""
    key = _stamp(st)
    hit = _verified.get(str(path))
    if hit is not None and list(hit[:4]) == key:
        return hit[4] == sha256
    try:
        stamp = json.loads((path.parent / _VERIFIED).read_text())
        if isinstance(stamp, dict) and stamp.get("stat") == key and stamp.get("sha256") == sha256:
            _verified[str(path)] = (*key, sha256)
            return True
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deep to read; hashed again
        pass
    try:
        actual = _sha256(path)
    except OSError:
        return False
    _remember_verified(path, st, actual)
    if actual != sha256:
        log.warning("fivar: %s does not hash to its manifest's sha256 (corrupted?); it is not loaded", path)
    return actual == sha256


def _remember_verified(path: Path, st: os.stat_result, sha256: str) -> None:
    _verified[str(path)] = (*_stamp(st), sha256)
    try:
        _write_if_different(path.parent / _VERIFIED, json.dumps({"stat": _stamp(st), "sha256": sha256}))
    except OSError:
        pass  # a read-only cache: verified again by the next process


def _cache_write_error(m: FivarModule, e: OSError) -> FivarError:
    where = e.filename or m.build_dir
    if e.errno == 28:  # ENOSPC
        return FivarError(f"variant '{m.variant.name}': the JIT cache at {where} is full (No space left on "
                          f"device); free space (`fivar cache prune --max-size ...`) or set "
                          f"FLASHINFER_WORKSPACE_BASE to a directory with room")
    return FivarError(f"variant '{m.variant.name}': cannot write the JIT cache at {where} ({e.strerror}); "
                      f"set FLASHINFER_WORKSPACE_BASE to a writable directory")


def variant_file_sha256(variant) -> str | None:
    """The variant's file as it was when loaded (fivar.registry.load_file; None for a variant built in code):
    tells `fivar cache` staleness whether a module renders differently because its variant was edited or
    because fivar's code generation changed."""
    return getattr(variant, "loaded_file_sha256", None)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_if_different(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic: concurrent builders never see a torn file
