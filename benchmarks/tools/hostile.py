"""The hostile-user battery: seeded attempts at fivar with bad input, on the CPU, each counted as one of

  clean      a one-line FivarError (a spec error may add its "  allowed: ..." line), or a CLI command that exits 1
             with one "error: ..." line, and nothing half-written;
  traceback  any other exception, a message of more lines, a CLI command that crashes;
  wrong      a silent wrong result: bad input accepted, or good input giving another result than it should (an
             output that differs from the contiguous / reference one, a forged file installed, a file written outside
             the cache, a half-imported module, a manifest fault that `cache verify` calls ok);
  success    good input, the right result.

Classes: archives (truncated, bit-flipped, forged, path-traversing, linking members), archive limits (size caps,
staging left by a killed import, ENOSPC/EROFS at each step of export/import/clear/prune), manifests (every field
missing, wrongly typed or out of range), index tensors (strided, int64, host-side, and invalid ones), stale plans
(index tensors and params written in place between calls), paths with shell characters, variant files that exit or
raise at import, deep expressions, bad numbers. Maintainers rerun it after touching any of these:

    python3 benchmarks/tools/hostile.py --attempts 40 --seed 0 [--only archives,paths] [--json out.json]

Exit status 1 when any attempt is a traceback or a silent wrong result (each is listed). Figures: docs/reliability.md.
"""
from __future__ import annotations

import argparse
import atexit
import collections
import errno
import gzip
import hashlib
import io
import json
import math
import os
import random
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
_TMP = Path(tempfile.mkdtemp(prefix="fivar-hostile-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
# before flashinfer and Triton are imported: an isolated cache, the interpreter, no GPU
os.environ.update(FLASHINFER_WORKSPACE_BASE=str(_TMP / "base"), FIVAR_CACHE_DIR=str(_TMP / "fivar-cache"),
                  FIVAR_CONFIG_DIR=str(_TMP / "config"), TRITON_INTERPRET="1", FIVAR_COLD_START="wait",
                  FLASHINFER_CUDA_ARCH_LIST="9.0a")
os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")

import torch  # noqa: E402
from click.testing import CliRunner  # noqa: E402

import fivar  # noqa: E402
from fivar.cli import main  # noqa: E402
from fivar.errors import FivarError  # noqa: E402
from fivar.jit.build import gen_module  # noqa: E402
from fivar.testing import INDEX_LAYOUTS, _ragged_reference, _to_paged, compare, example_params  # noqa: E402

OUTCOMES = ("clean", "traceback", "wrong", "success")

VARIANT = '''from fivar import AttentionVariant, tanh


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return 20.0 * tanh(score / 20.0)


variant = AttentionVariant(name="hostv", logits=logits)
'''


class Wrong(Exception):
    """A silent wrong result, found by an attempt's own check."""


# --- outcomes -------------------------------------------------------------------------------------------------------
def _one_line(message: str) -> bool:
    lines = message.split("\n")
    return bool(lines[0].strip()) and all(x.startswith("  allowed: ") for x in lines[1:])


def call(fn):
    """Runs fn(): ('success', None) if it returns; ('clean', msg) for a one-line FivarError; ('traceback', what)
    otherwise. A Wrong it raises is ('wrong', why)."""
    try:
        fn()
    except Wrong as e:
        return "wrong", str(e)
    except FivarError as e:
        return ("clean", str(e)) if _one_line(str(e)) else ("traceback", f"{type(e).__name__} of many lines: {e}")
    except BaseException as e:  # SystemExit and KeyboardInterrupt from a variant file included
        return "traceback", f"{type(e).__name__}: {e}"
    return "success", None


def cli(*args) -> tuple[str, str]:
    """A fivar command: ('success', out) on exit 0, ('clean', line) on exit 1 with one 'error:' line, else
    ('traceback', ...)."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    out = r.output
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return "traceback", f"{type(r.exception).__name__}: {r.exception}"
    if r.exit_code == 0:
        return "success", out
    if r.exit_code == 2 and out.count("Error: ") == 1 and "Traceback" not in out:  # click's usage error
        return "clean", out.strip().splitlines()[-1]
    # one error, which the console may wrap at the terminal's width
    # (a line that starts with "error:"; the message itself may quote one, as a zlib error does)
    if r.exit_code == 1 and "Traceback" not in out and out.startswith("error:") and \
            sum(line.startswith("error:") for line in out.splitlines()) == 1:
        return "clean", " ".join(out.split())
    return "traceback", f"exit {r.exit_code}: {out[-400:]}"


def agree(name, case, got, ref):
    """Wrong unless `got` matches `ref`: the same NaN and infinite entries, the rest within fp16's tolerance."""
    got, ref = got.double(), ref.double().to(got.device)
    if not torch.equal(torch.isnan(got), torch.isnan(ref)) or not torch.equal(got[torch.isinf(got)],
                                                                             ref[torch.isinf(got)]):
        raise Wrong(f"{name} {case}: NaN or infinite entries differ from the reference's")
    finite = torch.isfinite(ref)
    r = compare(name, case, got[finite], ref[finite], torch.float16)
    if not r.passed:
        raise Wrong(str(r))


def must_refuse(outcome):
    """Bad input: a success is a silent wrong result."""
    kind, what = outcome
    return ("wrong", "accepted") if kind == "success" else (kind, what)


# --- an isolated cache per attempt (the layout tests/unit/test_cache_cli.py's `iso` fixture makes) ------------------
_WORKSPACE_REL: list = []  # FlashInfer's workspace below its cache dir ("<version>/<arch>"), as set at import


def isolated(d: Path):
    from flashinfer.jit import env as jit_env
    if not _WORKSPACE_REL:
        _WORKSPACE_REL.append(jit_env.FLASHINFER_WORKSPACE_DIR.relative_to(jit_env.FLASHINFER_CACHE_DIR))
    root = d / "ws" / ".cache" / "flashinfer"
    ws = root / _WORKSPACE_REL[0]
    jit_env.FLASHINFER_CACHE_DIR, jit_env.FLASHINFER_JIT_DIR = root, ws / "cached_ops"
    jit_env.FLASHINFER_GEN_SRC_DIR = ws / "generated"
    os.environ["FIVAR_CACHE_DIR"] = str(d / "fivar")
    os.environ["FIVAR_CONFIG_DIR"] = str(d / "config")
    vdir = d / "variants"
    vdir.mkdir(parents=True, exist_ok=True)
    (vdir / "hostv.py").write_text(VARIANT)
    os.environ["FIVAR_VARIANT_PATH"] = str(vdir)
    return ws, vdir / "hostv.py"


def fake_built(vfile, dtype="bf16", head_dim=128, size=4096):
    """A real fivar module (URI, sources, manifest) whose library is random bytes: all the cache commands read."""
    m = gen_module(fivar.load(str(vfile)), op="single_prefill", dtype=dtype, head_dim=head_dim)
    m.jit_spec()
    m.build_dir.mkdir(parents=True, exist_ok=True)
    m.library_path.write_bytes(os.urandom(size))
    m.write_manifest(1.0)
    assert m.manifest_ok()
    return m


def snapshot(ws: Path) -> dict:
    """The workspace's libraries and sources by path: what an import may put back, byte for byte."""
    return {str(p.relative_to(ws)): p.read_bytes() for p in ws.rglob("*")
            if p.is_file() and p.suffix in (".so", ".cu", ".cuh", ".h", ".inc", ".hpp")}


def check_workspace(ws: Path, before: dict, outside: list[Path]):
    """After an import: every library and source there is one exported (no forged byte), no staging folder or temp
    file left, nothing written outside the cache."""
    for p in ws.rglob("*"):
        rel = str(p.relative_to(ws))
        if p.name.startswith(".import-") or p.name.endswith(".tmp"):
            raise Wrong(f"left behind: {rel}")
        if p.is_file() and p.suffix in (".so", ".cu", ".cuh", ".h", ".inc", ".hpp", ".py"):
            if rel not in before or before[rel] != p.read_bytes():
                raise Wrong(f"installed a file the export did not hold: {rel}")
        if p.is_symlink():
            raise Wrong(f"installed a link: {rel}")
    for p in outside:
        if p.exists() or p.is_symlink():
            raise Wrong(f"wrote outside the cache: {p}")


def rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of a tar.gz archive, its members (TarInfo, bytes) passed through edit(list) -> list."""
    with tarfile.open(src) as s:
        items = [(m, s.extractfile(m).read() if m.isfile() else b"") for m in s.getmembers()]
    items = edit(items)
    with tarfile.open(dst, "w:gz") as d:
        for mem, data in items:
            if mem.isfile():
                mem.size = len(data)
            d.addfile(mem, io.BytesIO(data) if mem.isfile() else None)
    return dst


def reindexed(items, key=None):
    """The archive's index updated to the members' new hashes (what a forger does), signed with `key` or unsigned."""
    from fivar import trust
    meta = json.loads(next(d for m, d in items if m.name == "fivar_export.json"))
    meta["files"] = {m.name: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)}
                     for m, d in items if m.isfile() and m.name not in ("fivar_export.json", "fivar_export.sig")}
    blob = json.dumps(meta).encode()
    out = [(m, blob if m.name == "fivar_export.json" else d) for m, d in items if m.name != "fivar_export.sig"]
    if key is not None:
        out.append((tarfile.TarInfo("fivar_export.sig"), trust.sign(blob, key)[0]))
    return out


def _member(name, data=b"", kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    return info, data


# --- archives -------------------------------------------------------------------------------------------------------
def attempt_archive(rng: random.Random, d: Path):
    ws, vfile = isolated(d)
    m = fake_built(vfile)
    signed = rng.random() < 0.5
    if signed:
        cli("cache", "keygen")
    good = d / "good.tar.gz"
    kind, out = cli("cache", "export", good)
    if kind != "success":
        return kind, f"export: {out}"
    before = snapshot(ws)
    cli("cache", "clear", "--yes")
    outside = d / "outside"
    key = Path(os.environ["FIVAR_CONFIG_DIR"]) / "cache_signing_key.pem"
    so_name = next(n for n in before if n.endswith(".so")).split("/")[-1]
    evil_so = os.urandom(4096)
    cases = {
        "truncated": lambda: (d / "x.tar.gz").write_bytes(good.read_bytes()[:rng.randrange(1, good.stat().st_size)]),
        "bit flips": lambda: (d / "x.tar.gz").write_bytes(_flipped(rng, good.read_bytes())),
        "random bytes": lambda: (d / "x.tar.gz").write_bytes(os.urandom(rng.randrange(0, 5000))),
        "empty": lambda: (d / "x.tar.gz").write_bytes(b""),
        "swapped library, index updated": lambda: rewrite(good, d / "x.tar.gz", lambda it: reindexed(
            [(mm, evil_so if mm.name.endswith(so_name) else dd) for mm, dd in it], key if signed else None)),
        "swapped library, index kept": lambda: rewrite(good, d / "x.tar.gz", lambda it: [
            (mm, evil_so if mm.name.endswith(so_name) else dd) for mm, dd in it]),
        "path traversal": lambda: rewrite(good, d / "x.tar.gz", lambda it: reindexed(
            it + [_member(f"{m.uri}/" + "../" * rng.randrange(1, 8) + "outside", b"x")],
            key if signed else None)),
        "absolute path": lambda: rewrite(good, d / "x.tar.gz", lambda it: reindexed(
            it + [_member(str(outside), b"x")], key if signed else None)),
        "symlink member": lambda: rewrite(good, d / "x.tar.gz", lambda it: it + [
            _member(f"{m.uri}/evil.cuh", kind=tarfile.SYMTYPE, link=str(outside))]),
        "hard link member": lambda: rewrite(good, d / "x.tar.gz", lambda it: it + [
            _member(f"{m.uri}/evil.cuh", kind=tarfile.LNKTYPE, link="/etc/passwd")]),
        "device member": lambda: rewrite(good, d / "x.tar.gz", lambda it: it + [
            _member(f"{m.uri}/evil.cuh", kind=tarfile.CHRTYPE)]),
        "variant file member": lambda: rewrite(good, d / "x.tar.gz", lambda it: reindexed(
            it + [_member(f"{m.uri}/hostv.py", f"open({str(outside)!r}, 'w')".encode())], key if signed else None)),
        "garbage manifest": lambda: rewrite(good, d / "x.tar.gz", lambda it: reindexed(
            [(mm, _garbage_json(rng) if mm.name.endswith("fivar_manifest.json") else dd) for mm, dd in it],
            key if signed else None)),
        "garbage index": lambda: rewrite(good, d / "x.tar.gz", lambda it: [
            (mm, _garbage_json(rng) if mm.name == "fivar_export.json" else dd) for mm, dd in it]),
        "garbage signature": lambda: rewrite(good, d / "x.tar.gz", lambda it: [
            (mm, dd) for mm, dd in it if mm.name != "fivar_export.sig"] + [
            _member("fivar_export.sig", os.urandom(rng.randrange(0, 200)))]),
        "no index": lambda: rewrite(good, d / "x.tar.gz", lambda it: [
            (mm, dd) for mm, dd in it if mm.name != "fivar_export.json"]),
        "duplicate member": lambda: rewrite(good, d / "x.tar.gz", lambda it: it + [
            (tarfile.TarInfo(next(mm.name for mm, _ in it if mm.name.endswith(so_name))), evil_so)]),
        "directory as archive": lambda: (d / "x.tar.gz").mkdir(),
        "missing archive": lambda: None,
    }
    case = rng.choice(sorted(cases))
    cases[case]()
    args = ["cache", "import", d / "x.tar.gz"] + (["--trust-unsigned"] if rng.random() < 0.3 else [])
    kind, out = cli(*args)
    try:
        check_workspace(ws, before, [outside, d / "ws" / "outside"])
    except Wrong as e:
        return "wrong", f"{case}: {e}"
    if kind == "success" and case not in ("swapped library, index kept", "duplicate member", "symlink member",
                                          "hard link member", "device member"):
        # ignoring what it does not import is fine; a refusal-worthy archive imported is checked above
        return kind, case
    return kind, f"{case}: {out}"


def _flipped(rng, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randrange(1, 8)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _garbage_json(rng) -> bytes:
    return rng.choice([b"", b"{", b"[]", b"null", b"\xff\xfe", b"[" * 100000 + b"]" * 100000, b'{"schema": 2}',
                       json.dumps({"uri": 5, "sources": "x"}).encode(), os.urandom(64)])


# --- archive limits -------------------------------------------------------------------------------------------------
def _raiser(code, real, after):
    calls = [0]

    def f(*args, **kwargs):
        calls[0] += 1
        if calls[0] <= after:
            return real(*args, **kwargs)
        raise OSError(code, os.strerror(code), str(args[0]) if args else None)
    return f


def attempt_archive_limits(rng: random.Random, d: Path):
    ws, vfile = isolated(d)
    mods = [fake_built(vfile, "bf16", 128, rng.randrange(1024, 64 * 1024)),
            fake_built(vfile, "fp16", 64, rng.randrange(1024, 64 * 1024))]
    if rng.random() < 0.5:
        cli("cache", "keygen")
    archive = d / "mods.tar.gz"
    case = rng.choice(["member cap", "total cap", "staging left", "disk export", "disk staging", "disk install",
                       "disk clear", "disk prune"])
    code = rng.choice([errno.ENOSPC, errno.EROFS])
    import shutil as sh
    patches = []

    def patch(obj, name, new):
        patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)
    try:
        if case == "disk export":
            (d / "prev").mkdir()
            archive = d / "prev" / "mods.tar.gz"
            archive.write_bytes(b"previous")
            patch(gzip.GzipFile, "write", _raiser(code, gzip.GzipFile.write, rng.randrange(0, 6)))
            kind, out = cli("cache", "export", archive)
            for obj, name, real in reversed(patches):
                setattr(obj, name, real)
            patches.clear()
            if archive.read_bytes() != b"previous" or len(list((d / "prev").iterdir())) != 1:
                return "wrong", f"{case}: the previous export was replaced or a temp file left"
            return kind, f"{case}: {out}"
        kind, out = cli("cache", "export", archive)
        if kind != "success":
            return kind, f"export: {out}"
        before = snapshot(ws)
        sizes = [m.library_path.stat().st_size for m in mods]
        if case in ("disk clear", "disk prune"):
            patch(os, "unlink", _raiser(code, os.unlink, rng.randrange(0, 4)))
            patch(sh, "rmtree", _raiser(code, sh.rmtree, rng.randrange(0, 2)))
            kind, out = cli("cache", *(["clear", "--yes"] if case == "disk clear" else ["prune", "--older-than", "0s"]))
            for obj, name, real in reversed(patches):
                setattr(obj, name, real)
            patches.clear()
            for m in mods:  # a module is whole or gone
                if m.manifest_path.exists() and not m.manifest_ok():
                    return "wrong", f"{case}: {m.uri} half removed ({out})"
            return kind, f"{case}: {out}"
        cli("cache", "clear", "--yes")
        args = ["cache", "import", archive]
        if case == "member cap":
            cap = rng.randrange(512, 80 * 1024)
            args += ["--max-member-size", str(cap), "--trust-unsigned"]
            over = max(sizes) > cap
        elif case == "total cap":
            cap = rng.randrange(512, 200 * 1024)
            args += ["--max-total-size", str(cap)]
            with tarfile.open(archive) as t:
                over = sum(mm.size for mm in t.getmembers()) > cap
        else:
            over = False
        if case == "staging left":
            # killed after it locked (its lock file, held by nobody), or before (no lock file, an hour old)
            from fivar.jit import locks
            dead = ws / "cached_ops" / f".import-fivar_killed-{rng.randrange(10**6)}"
            (dead / "cached_ops").mkdir(parents=True)
            (dead / "cached_ops" / "x.so").write_bytes(os.urandom(100))
            if rng.random() < 0.5:
                (dead / locks.BUILD_LOCK).touch()
            else:
                os.utime(dead, (time.time() - 3600,) * 2)
        elif case == "disk staging":
            patch(sh, "copyfileobj", _raiser(code, sh.copyfileobj, rng.randrange(0, 8)))
        elif case == "disk install":
            patch(os, "replace", _raiser(code, os.replace, rng.randrange(0, 12)))
        kind, out = cli(*args)
        for obj, name, real in reversed(patches):
            setattr(obj, name, real)
        patches.clear()
        if over and kind == "success":
            return "wrong", f"{case}: members over the cap imported"
        check_workspace(ws, before, [])
        for m in mods:
            if (m.library_path.exists() or m.manifest_path.exists()) and not m.manifest_ok() and \
                    m.library_path.exists():
                return "wrong", f"{case}: {m.uri} half imported"
        return kind, f"{case}: {out}"
    except Wrong as e:
        return "wrong", f"{case}: {e}"
    finally:
        for obj, name, real in reversed(patches):
            setattr(obj, name, real)


# --- manifests ------------------------------------------------------------------------------------------------------
BAD_VALUES = [None, True, [], {}, "", "x\ny", -1, 10**30, 1.5, float("nan"), [1, [2]], {"kind": "evil"}]


def attempt_manifest(rng: random.Random, d: Path):
    from fivar.jit import manifest
    ws, vfile = isolated(d)
    m = fake_built(vfile)
    man = json.loads(m.manifest_path.read_text())
    field = rng.choice(sorted(manifest.FIELDS) + ["<file>", "so_sha256 (another)", "so_size (another)",
                                                   "provenance.kind"])
    if field == "<file>":
        m.manifest_path.write_bytes(_garbage_json(rng))
    else:
        if field == "so_sha256 (another)":
            man["so_sha256"] = hashlib.sha256(os.urandom(8)).hexdigest()
        elif field == "so_size (another)":
            man["so_size"] += rng.randrange(1, 100)
        elif field == "provenance.kind":
            man["provenance"] = {"kind": rng.choice(["evil", None, 5, "trusted"])}
        elif field in man and rng.random() < 0.3:
            del man[field]
        else:
            types = manifest.FIELDS[field][0]
            bad = [x for x in BAD_VALUES if not isinstance(x, types) or (isinstance(x, bool) and bool not in types)]
            man[field] = rng.choice(bad)
        m.manifest_path.write_text(json.dumps(man))
    valid = not manifest.problems(man) if field != "<file>" else False
    # a valid manifest that says what the module is (an optional field left out): nothing for verify to report
    harmless = valid and field not in ("so_sha256 (another)", "so_size (another)", "provenance.kind")
    rows = None
    for args in (["ls", "--json"], ["verify", "--json"], ["verify", "--fix"]):
        # ls exits 0, verify 1 on a fault it reports: JSON rows, not an error line
        r = CliRunner().invoke(main, ["cache", *args])
        if (r.exception is not None and not isinstance(r.exception, SystemExit)) or "Traceback" in r.output \
                or r.exit_code not in (0, 1):
            return "traceback", f"{field} cache {' '.join(args)}: exit {r.exit_code} {r.exception!r} {r.output[-300:]}"
        if args == ["verify", "--json"]:
            try:
                rows = json.loads(r.stdout)
            except ValueError:
                return "traceback", f"{field} verify --json: not JSON: {r.output[-300:]}"
            mine = [row for row in rows if row.get("uri") == m.uri]
            if not harmless and (not mine or mine[0].get("ok") or r.exit_code != 1):
                return "wrong", f"{field}: cache verify does not report the fault ({mine})"
    if not harmless and m.manifest_ok():
        return "wrong", f"{field}: manifest_ok() after the fault"
    if not harmless and m.library_path.exists():
        return "wrong", f"{field}: verify --fix kept the library of a faulty manifest"
    why = next((row.get("problems") for row in rows or [] if row.get("uri") == m.uri), None)
    return ("success" if harmless else "clean"), f"{field}: {why}"


# --- index tensors --------------------------------------------------------------------------------------------------
HQ, HKV, D = 2, 1, 16


def attempt_index(rng: random.Random, d: Path):
    torch.manual_seed(rng.randrange(2**31))
    v = fivar.load(rng.choice(["softcap", "document_mask", "sliding_window"]))
    op = rng.choice(["ragged", "decode"])
    n = rng.randrange(1, 4)
    qo_lens, kv_lens = [rng.randrange(1, 9) for _ in range(n)], [rng.randrange(1, 13) for _ in range(n)]
    page = 4
    q = torch.randn(sum(qo_lens) if op == "ragged" else n, HQ, D, dtype=torch.float16)
    k, vv = torch.randn(sum(kv_lens), HKV, D, dtype=torch.float16), torch.randn(sum(kv_lens), HKV, D,
                                                                                   dtype=torch.float16)
    params = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=n, max_len=max(kv_lens), device="cpu")
    if "window" in params:
        params["window"] = rng.randrange(1, 8)
    qo = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    cache, indptr, indices, last = _to_paged(k, vv, kv_lens, page)
    if op == "ragged":
        names, good = ["qo_indptr", "kv_indptr"], [qo, kv]
        run = lambda a, b: v.batch_prefill_ragged(q, k, vv, a, b, causal=True, backend="triton", **params)  # noqa
    else:
        names, good = ["kv_indptr", "kv_indices", "kv_last_page_len"], [indptr, indices, last]
        run = lambda a, b, c: v.decode(q, cache, a, b, c, backend="triton", **params)  # noqa
    want = run(*good)
    which = rng.randrange(len(names))
    if rng.random() < 0.5:  # a layout or integer dtype of valid values: the same output, bit for bit
        form = rng.choice(sorted(INDEX_LAYOUTS) + ["uint8", "int16", "int8_every_third"])
        f = {"uint8": lambda t: t.to(torch.uint8), "int16": lambda t: t.to(torch.int16),
             "int8_every_third": lambda t: torch.stack([t, t, t], 1).reshape(-1)[::3].to(torch.int8)}.get(
            form, INDEX_LAYOUTS.get(form))
        args = [f(t) if rng.random() < 0.5 or i == which else t for i, t in enumerate(good)]

        def same():
            got = run(*args)
            if not torch.equal(got, want):
                raise Wrong(f"{op} {form}: differs from the contiguous int32 call")
        return call(same)
    t = good[which]
    name = names[which]
    bad = {
        "float": lambda: t.float(), "bool": lambda: t.bool(), "2-D": lambda: t.view(1, -1),
        "0-d": lambda: t[0], "list": lambda: t.tolist(), "None": lambda: None, "meta": lambda: t.to("meta"),
        "negative": lambda: _set(t, rng.randrange(t.numel()), -rng.randrange(1, 2**31)),
        "past int32": lambda: _set(t.long(), rng.randrange(t.numel()), 2**32 + rng.randrange(3)),
        "too short": lambda: t[:rng.randrange(0, max(1, t.numel() - 1))],
        "huge": lambda: _set(t, t.numel() - 1, int(t[-1]) + rng.randrange(1, 10**6)),
    }
    if "indptr" in name:
        bad["decreasing"] = lambda: _set(t, rng.randrange(1, t.numel()), int(t[-1]) + 5) if t.numel() > 2 else \
            torch.tensor([0, -1], dtype=t.dtype)
        bad["start not 0"] = lambda: t + rng.randrange(1, 4)
    if name == "kv_last_page_len":
        bad["past the page"] = lambda: _set(t, rng.randrange(t.numel()), page + rng.randrange(1, 9))
        del bad["huge"]
    if name == "kv_indices":
        bad["past the cache"] = lambda: _set(t, rng.randrange(t.numel()), cache[0].shape[0] + rng.randrange(9))
        del bad["too short"]
        bad["too short"] = lambda: t[:max(0, int(indptr[-1]) - 1 - rng.randrange(int(indptr[-1])))]
    case = rng.choice(sorted(bad))
    args = list(good)
    args[which] = bad[case]()
    kind, what = must_refuse(call(lambda: run(*args)))
    return kind, f"{op} {name} {case}: {what}"


def _set(t, i, value):
    t = t.clone()
    t[i] = value
    return t


# --- stale plans ----------------------------------------------------------------------------------------------------
def attempt_stale(rng: random.Random, d: Path):
    """One-shot calls keep plans (block maps) keyed on their tensors: written in place between calls by any means,
    the next call must see the new contents."""
    torch.manual_seed(rng.randrange(2**31))
    v = fivar.load("document_mask")
    n = rng.randrange(1, 4)
    lens = [rng.randrange(2, 14) for _ in range(n)]
    total = sum(lens)
    q, k, vv = (torch.randn(total, h, D, dtype=torch.float16) for h in (HQ, HKV, HKV))
    doc_ids = torch.randint(0, 3, (n, max(lens) + 2), dtype=torch.int32).sort(1).values
    qo = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kv = qo.clone()
    run = lambda: v.batch_prefill_ragged(q, k, vv, qo, kv, causal=True, backend="triton", doc_ids=doc_ids)  # noqa
    target = rng.choice(["doc_ids", "indptrs"])
    writer = rng.choice(["copy_", "setitem", "data", "numpy", "add_"])

    def write(t, index, value):
        if writer == "copy_":
            t[index].copy_(torch.as_tensor(value, dtype=t.dtype).expand_as(t[index]))
        elif writer == "setitem":
            t[index] = value
        elif writer == "data":
            t.data[index] = value
        elif writer == "numpy":
            t.numpy()[index] = value
        else:
            t[index].add_(torch.as_tensor(value, dtype=t.dtype) - t[index])

    def attempt():
        run()
        if target == "doc_ids":
            write(doc_ids, (rng.randrange(n), slice(rng.randrange(max(lens)), None)), rng.randrange(0, 4))
            new_lens = lens
        else:  # move one boundary between two requests (a batch of one: nothing to move, write the same)
            if n > 1:
                b = rng.randrange(1, n)
                lo, hi = int(qo[b - 1]) + 1, int(qo[b + 1]) - 1
                write(qo, b, rng.randrange(lo, hi + 1))
                write(kv, b, int(qo[b]))
            new_lens = (qo[1:] - qo[:-1]).tolist()
        got = run()
        ref = _ragged_reference(v, q, k, vv, new_lens, new_lens, True, {"doc_ids": doc_ids},
                                float_dtype=torch.float64)
        r = compare("document_mask", f"{target} by {writer}", got, ref, torch.float16)
        if not r.passed:
            raise Wrong(str(r))
    kind, what = call(attempt)
    return kind, f"{target} by {writer}: {what}"


# --- paths with shell characters ------------------------------------------------------------------------------------
SHELL = ["$(touch {s})", "`touch {s}`", "; touch {s}", "a b", "x|y", "x&y", "x>y", "q'uote", 'd"q', "x:y",
         "st*r", "x?y", "[br]", "back\\slash", "new\nline", "t\tab"]


def attempt_path(rng: random.Random, d: Path):
    """A workspace or CUDA_HOME holding shell or ninja syntax: refused before any build file is written, nothing
    run. FIVAR_CACHE_DIR with a space: works (nothing of it reaches build.ninja but the stub directory, quoted)."""
    from flashinfer.jit import env as jit_env
    sentinel = d / "ran"
    piece = rng.choice(SHELL).format(s=sentinel)
    where = rng.choice(["FLASHINFER_WORKSPACE_BASE", "CUDA_HOME"])
    hostile = d / f"dir{piece}x"
    try:
        hostile.mkdir(parents=True)
    except OSError as e:
        return "success", f"the file system refuses {piece!r}: {e}"
    old_cuda = os.environ.get("CUDA_HOME")
    if where == "CUDA_HOME":
        ws, vfile = isolated(d / "plain")
        os.environ["CUDA_HOME"] = str(hostile)
    else:
        ws, vfile = isolated(hostile)
    try:
        m = gen_module(fivar.load(str(vfile)), op="single_prefill", dtype="bf16", head_dim=128)
        kind, what = must_refuse(call(m.build))
    finally:
        if old_cuda is None:
            os.environ.pop("CUDA_HOME", None)
        else:
            os.environ["CUDA_HOME"] = old_cuda
    if sentinel.exists():
        return "wrong", f"{where} {piece!r}: a command in the path ran"
    if list(Path(jit_env.FLASHINFER_JIT_DIR).rglob("build.ninja")):
        return "wrong", f"{where} {piece!r}: build.ninja written"
    return kind, f"{where} {piece!r}: {what}"


# --- variant files that exit or raise -------------------------------------------------------------------------------
BODIES = {
    "sys.exit(0)": "import sys\nsys.exit(0)\n", "sys.exit(3)": "import sys\nsys.exit(3)\n",
    "sys.exit('msg')": "import sys\nsys.exit('bye')\n", "raise SystemExit": "raise SystemExit\n",
    "raise KeyboardInterrupt": "raise KeyboardInterrupt\n", "1/0": "x = 1 / 0\n",
    "syntax error": "def f(:\n", "import missing": "import fivar_no_such_module\n",
    "no variant": "x = 1\n", "variant = 5": "variant = 5\n", "recursion": "def f():\n    return f()\n\n\nf()\n",
    "null bytes": "x = 1\x00\n", "raise with lines": "raise ValueError('a\\nb\\nc')\n",
    "mask as a lambda": VARIANT.replace("logits=logits", "logits=logits, mask=lambda b, qh, kh, q, k, p: q >= k"),
    "mask returns a float": VARIANT.replace("logits(score, ", "mask(").replace(
        "return 20.0 * tanh(score / 20.0)", "return 1.5").replace("logits=logits", "mask=mask"),
    "memory error": "raise MemoryError\n", "exit in a function at import": "import os\n\ndef f():\n"
    "    raise SystemExit(4)\n\n\nf()\n", "GeneratorExit": "raise GeneratorExit\n",
}


def attempt_variant_file(rng: random.Random, d: Path):
    case = rng.choice(sorted(BODIES))
    name = rng.choice(["bad", "bad file", "bad$(x)", "bad;x"]).replace(" ", "_") if rng.random() < 0.3 else "bad"
    vdir = d / "vdir"
    vdir.mkdir(parents=True)
    f = vdir / f"{name}.py"
    f.write_text(BODIES[case])
    (vdir / "goodv.py").write_text(VARIANT.replace("hostv", "goodv"))
    kind, what = must_refuse(call(lambda: fivar.load(str(f)).ir))  # a loaded file is parsed on first use
    if kind != "clean":
        return kind, f"load {case}: {what}"
    os.environ["FIVAR_VARIANT_PATH"] = str(vdir)
    r = CliRunner().invoke(main, ["list"])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        return "traceback", f"list {case}: {type(r.exception).__name__}: {r.exception}"
    if r.exit_code != 1 or "goodv" not in r.output or "Traceback" in r.output or f.name not in r.output:
        return "wrong", f"list {case}: exit {r.exit_code}, {r.output[-300:]!r}"
    return "clean", f"{case}: {what}"


# --- deep expressions -----------------------------------------------------------------------------------------------
def attempt_deep(rng: random.Random, d: Path):
    """Expressions of random depth and length: refused as a FivarSpecError with file:line, or accepted with the
    reference's output equal to the shallow expression's."""
    depth = rng.choice([rng.randrange(2, 120), rng.randrange(90, 400), rng.randrange(400, 3000)])
    kind = rng.choice(["and chain", "parentheses", "sum", "nested where", "unary minus"])
    if kind == "and chain":
        body, shallow = " and ".join(["kv_idx <= q_idx"] * depth), "kv_idx <= q_idx"
        text = f"def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):\n    return {body}\n"
        ref_text = f"def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):\n    return {shallow}\n"
        use = "mask=mask"
    else:
        if kind == "parentheses":
            body = "(" * depth + "score" + ")" * depth
        elif kind == "sum":
            body = "score" + " + 0.0" * depth
        elif kind == "unary minus":
            body = "-" * (2 * depth) + "score"
        else:
            body = "score"
            for _ in range(depth):
                body = f"where(q_idx >= 0, {body}, score)"
        text = f"def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):\n    return {body}\n"
        ref_text = "def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):\n    return score\n"
        use = "logits=logits"
    head = "from fivar import AttentionVariant, where\n\n\n"
    f, g = d / f"deep{depth}.py", d / "shallow.py"
    f.write_text(head + text + f"\n\nvariant = AttentionVariant(name='deep{depth}', {use})\n")
    g.write_text(head + ref_text + f"\n\nvariant = AttentionVariant(name='shallow', {use})\n")

    def attempt():
        v = fivar.load(str(f))
        q, k, vv = (torch.randn(5, HQ, D, dtype=torch.float64) for _ in range(3))
        got, want = v.reference(q, k, vv), fivar.load(str(g)).reference(q, k, vv)
        if not torch.allclose(got.double(), want.double(), atol=1e-5, rtol=1e-5):
            raise Wrong(f"{kind} depth {depth}: the reference differs from the shallow expression's")
    outcome, what = call(attempt)
    if outcome == "clean" and f.name not in what:
        return "wrong", f"{kind} depth {depth}: refused without naming the file: {what}"
    return outcome, f"{kind} depth {depth}: {what}"


# --- bad numbers ----------------------------------------------------------------------------------------------------
def attempt_number(rng: random.Random, d: Path):
    from fractions import Fraction
    import numpy as np
    kind = rng.choice(["scalar default", "constant", "sm_scale", "float param", "int param", "head dim"])
    bad_float = [float("nan"), float("inf"), -float("inf"), 3.5e38, -1e39, "0.5", None if kind != "sm_scale" else [],
                 np.float64("nan"), 1e-50j]
    # real numbers of other types are fine: float() of them is what the kernels get
    good_float = [rng.uniform(-4, 4), 0.0, 1e-3, float(np.float32(rng.uniform(0.1, 2))), Fraction(1, 3),
                  np.float64(0.7)]
    if kind in ("scalar default", "constant"):
        if kind == "scalar default":
            ptype = rng.choice(["int", "float"])
            value = rng.choice(["float('nan')", "float('inf')", "2**40", "-2**31 - 1", "Fraction(1, 3)", "True",
                                "'3'", "np.int64(3)", "1e39", "[1]"] + (["7", "-5"] if ptype == "int" else
                                                                       ["0.25", "-3.0"]))
            # within float32, an int is a fine float default; an int default must fit int32
            good = value in ("7", "-5", "0.25", "-3.0") or (ptype == "float" and value in ("2**40", "-2**31 - 1"))
            spec = (f"params={{'p': Scalar({ptype}, default={value})}}", "score + params.p")
        else:
            value = rng.choice(["1e39", "2**31", "-2**31 - 1", "1e400", "2**63", "0.5", "3", "-7", "1e-50"])
            good = value in ("0.5", "3", "-7", "1e-50")  # 1e-50: within range, rounds to 0 in float32
            spec = ("", f"score + {value}")
        f = d / "numv.py"
        f.write_text("import numpy as np\nfrom fractions import Fraction\nfrom fivar import AttentionVariant, "
                     "Scalar\n\n\ndef logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):\n"
                     f"    return {spec[1]}\n\n\nvariant = AttentionVariant(name='numv', logits=logits, {spec[0]})\n")
        q, k, vv = (torch.randn(4, HQ, D, dtype=torch.float16) for _ in range(3))

        def attempt():
            v = fivar.load(str(f))
            agree("numv", value, v.prefill(q, k, vv, backend="triton"), v.reference(q, k, vv))
        outcome = call(attempt)
        outcome = outcome if good else must_refuse(outcome)
        return outcome[0], f"{kind} {value}: {outcome[1]}"
    v = fivar.load("sliding_window" if kind == "int param" else "softcap")
    hd = rng.choice([0, 1, 15, 33, 16, 32]) if kind == "head dim" else D
    q, k, vv = (torch.randn(4, HQ, hd, dtype=torch.float16) for _ in range(3))
    params = example_params(v, num_qo_heads=HQ, num_kv_heads=HQ, batch_size=1, max_len=4, device="cpu")
    kwargs, good = {}, True
    if kind == "sm_scale":
        good = rng.random() < 0.3
        kwargs["sm_scale"] = rng.choice(good_float if good else bad_float)
        what = kwargs["sm_scale"]
    elif kind == "float param":
        name = next(n for n, p in v.params.items() if getattr(p, "dtype", None) is float)
        good = rng.random() < 0.3
        params[name] = rng.choice([abs(x) + 1 for x in good_float] if good else
                                  [x for x in bad_float if x is not None])
        what = params[name]
    elif kind == "int param":
        good = rng.random() < 0.3
        # (None is "not given": the default)
        params["window"] = rng.choice([1, 2, 3] if good else [2**31, -2**31 - 1, 2**40, 1.5, "3", float("nan"),
                                                            [2], torch.tensor([2, 3])])
        what = params["window"]
    else:
        good = hd in (16, 32)
        what = hd

    def attempt():
        agree(v.name, f"{kind} {what!r}", v.prefill(q, k, vv, backend="triton", **kwargs, **params),
              v.reference(q, k, vv, **kwargs, **params))
    outcome = call(attempt)
    outcome = outcome if good else must_refuse(outcome)
    return outcome[0], f"{kind} {what!r}: {outcome[1]}"


CLASSES = {
    "archives": attempt_archive,
    "archive_limits": attempt_archive_limits,
    "manifests": attempt_manifest,
    "index_tensors": attempt_index,
    "stale_plans": attempt_stale,
    "paths": attempt_path,
    "variant_files": attempt_variant_file,
    "deep_expressions": attempt_deep,
    "bad_numbers": attempt_number,
}


def run(attempts: int, seed: int, only=None, log=print, verbose=False) -> dict:
    """{class: Counter of outcomes}, and the tracebacks and wrong results with their cases."""
    counts, bad = {}, []
    for name, fn in CLASSES.items():
        if only and name not in only:
            continue
        c = collections.Counter({o: 0 for o in OUTCOMES})
        t0 = time.time()
        for i in range(attempts):
            rng = random.Random(f"{seed}:{name}:{i}")
            d = _TMP / f"{name}-{i}"
            d.mkdir(parents=True)
            try:
                kind, what = fn(rng, d)
            except Wrong as e:
                kind, what = "wrong", str(e)
            except BaseException as e:  # the attempt's own set-up failed: counted, never hidden
                kind, what = "traceback", f"{type(e).__name__}: {e}"
            c[kind] += 1
            if kind in ("traceback", "wrong"):
                bad.append((name, i, kind, what))
                log(f"  {name}[{i}] {kind}: {str(what)[:300]}")
            elif verbose:
                log(f"  {name}[{i}] {kind}: {' '.join(str(what).split())[:160]}")
            shutil.rmtree(d, ignore_errors=True)
        counts[name] = c
        log(f"{name}: {dict(c)} ({time.time() - t0:.0f}s)")
    return {"counts": counts, "bad": bad}


def table(counts: dict) -> str:
    rows = ["| class | attempts | clean errors | successes | tracebacks | silent wrong results |",
            "|---|---|---|---|---|---|"]
    total = collections.Counter()
    for name, c in counts.items():
        n = sum(c.values())
        total.update(c)
        total["attempts"] += n
        rows.append(f"| {name.replace('_', ' ')} | {n} | {c['clean']} | {c['success']} | {c['traceback']} | "
                    f"{c['wrong']} |")
    rows.append(f"| all | {total['attempts']} | {total['clean']} | {total['success']} | {total['traceback']} | "
                f"{total['wrong']} |")
    return "\n".join(rows)


def main_(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attempts", type=int, default=40, help="attempts per class")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated classes: " + ", ".join(CLASSES))
    ap.add_argument("--json", default=None, help="write the counts and the bad attempts here")
    ap.add_argument("--verbose", action="store_true", help="a line per attempt")
    a = ap.parse_args(argv)
    only = [x for x in a.only.split(",") if x]
    unknown = sorted(set(only) - set(CLASSES))
    if unknown:
        ap.error(f"unknown class(es) {', '.join(unknown)}")
    import logging
    logging.disable(logging.WARNING)  # the cache's own warnings about the faults injected
    res = run(a.attempts, a.seed, only, verbose=a.verbose)
    print(table(res["counts"]))
    if a.json:
        Path(a.json).write_text(json.dumps({"counts": res["counts"], "bad": res["bad"], "seed": a.seed,
                                            "attempts": a.attempts}, indent=1))
    return 1 if res["bad"] else 0


if __name__ == "__main__":
    sys.exit(main_())
