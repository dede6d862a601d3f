"""Where the cache lives: a read-only prebuilt workspace (what a fleet mounts), paths with spaces, long names.

The read-only case mounts the workspace read-only for real (a private mount namespace through `unshare`),
so any write fivar attempts fails; the test is skipped where namespaces are not allowed.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cache_cli import VARIANT, as_json, fake_built, invoke, iso, module  # noqa: F401 - the fixture

import fivar
from fivar.errors import FivarError
from fivar.jit import build as jb
from fivar.jit import locks, triton_module
from fivar.jit.build import gen_module

REPO = Path(__file__).resolve().parents[2]

LOADER = r'''
import json, sys, tvm_ffi, fivar
loaded = []
tvm_ffi.load_module = lambda path: loaded.append(open(path, "rb").read(16)) or object()
from fivar.jit.build import gen_module
m = gen_module(fivar.load(sys.argv[1]), "single_prefill", "fa2", "bf16", 128)
m.load()
print("RESULT " + json.dumps({"uri": m.uri, "loaded": len(loaded)}), flush=True)
'''

CACHE_LS_VERIFY = r'''
from fivar.cli import main
for args in (["cache", "ls", "--json"], ["cache", "verify", "--json"]):
    try:
        main(args, prog_name="fivar")
    except SystemExit as e:  # each command ends as `fivar` does: 0 goes on to the next
        if e.code:
            raise
'''


def _unshare_prefix() -> list[str] | None:
    """A command prefix that runs in a private mount namespace, or None where that is not permitted."""
    if shutil.which("unshare") is None:
        return None
    for prefix in (["unshare", "-m"], ["unshare", "-Urm"]):
        try:
            r = subprocess.run([*prefix, "sh", "-c", "mount --bind -o ro / /mnt 2>/dev/null || "
                                "mount --bind /tmp /tmp && mount -o remount,bind,ro /tmp"],
                               capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return prefix
    return None


def _snapshot(root: Path) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_a_read_only_prebuilt_workspace_loads_with_no_write(iso, tmp_path):
    prefix = _unshare_prefix()
    if prefix is None:
        pytest.skip("no private mount namespace here (unshare -m / -Urm not permitted)")
    root, ws, vfile = iso
    m = fake_built(module(vfile))
    (m.build_dir / ".fivar.verified").unlink()  # a fleet's image: nothing but what the build left...
    (ws / "flashinfer_jit.log").touch()  # ...which includes the log FlashInfer creates on import
    base = tmp_path / "ws"
    before = _snapshot(base)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FLASHINFER_WORKSPACE_BASE": str(base),
           "FIVAR_CACHE_DIR": str(tmp_path / "fivar-rw")}
    script = (f"mount --bind {base} {base} && mount -o remount,bind,ro {base} && "
              f"touch {base}/probe 2>/dev/null && echo WRITABLE; "
              f"exec {sys.executable} -c '{LOADER}' {vfile}")
    r = subprocess.run([*prefix, "sh", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "WRITABLE" not in r.stdout, "the bind mount is not read-only"
    assert r.returncode == 0 and "Traceback" not in r.stderr and "OSError" not in r.stderr, r.stderr[-3000:]
    res = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert res == {"uri": m.uri, "loaded": 1}
    assert _snapshot(base) == before  # not one file written, touched or added
    # and `fivar cache` reads it read-only as well (ls, then verify: one process, one import of torch and FlashInfer)
    (tmp_path / "ls_verify.py").write_text(CACHE_LS_VERIFY)
    script = (f"mount --bind {base} {base} && mount -o remount,bind,ro {base} && "
              f"{sys.executable} {tmp_path / 'ls_verify.py'}")
    r = subprocess.run([*prefix, "sh", "-c", script], env={**env, "FIVAR_VARIANT_PATH": str(vfile.parent)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert '"ok": true' in r.stdout and _snapshot(base) == before


def test_a_workspace_path_with_a_space_loads_but_a_compile_is_refused_up_front(tmp_path, monkeypatch):
    from flashinfer.jit import env as jit_env
    root = tmp_path / "fleet cache" / ".cache" / "flashinfer"
    wsd = root / jit_env.FLASHINFER_WORKSPACE_DIR.relative_to(jit_env.FLASHINFER_CACHE_DIR)
    monkeypatch.setattr(jit_env, "FLASHINFER_CACHE_DIR", root)
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", wsd / "cached_ops")
    monkeypatch.setattr(jit_env, "FLASHINFER_GEN_SRC_DIR", wsd / "generated")
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "fivar"))
    (tmp_path / "cachev.py").write_text(VARIANT)
    m = fake_built(module(tmp_path / "cachev.py"))
    import tvm_ffi
    monkeypatch.setattr(tvm_ffi, "load_module", lambda p: object())
    try:
        m.load()  # prebuilt: fine
    finally:
        jb._loaded.pop(m.uri, None)
        locks.release_hold(m.build_dir)
    other = module(tmp_path / "cachev.py", "fp16", 64)
    import flashinfer.jit.core as core
    monkeypatch.setattr(core.JitSpecNvcc, "build", lambda *a, **k: pytest.fail("compiled into a spaced path"))
    with pytest.raises(FivarError, match=r"cannot compile with FLASHINFER_WORKSPACE_BASE at .*fleet cache.*a space"):
        other.build()
    with pytest.raises(FivarError, match="FLASHINFER_WORKSPACE_BASE"):
        jb.build_many([other, module(tmp_path / "cachev.py", "bf16", 64)])


@pytest.mark.parametrize("name", ["ws`id>PWNED`", "ws$(touch PWNED)", "ws;id>PWNED", "ws&&id>PWNED", "ws|id>PWNED",
                                  "ws'\"(id>PWNED)", "ws\nid>PWNED", "ws\tPWNED"])
def test_a_path_with_shell_syntax_never_reaches_a_build_command(tmp_path, monkeypatch, name):
    """FlashInfer writes the workspace and toolkit paths unquoted into build.ninja, whose commands run through
    /bin/sh: a backtick or `$(...)` in a directory name would run. Such a path is refused, in one line naming it and
    the variable that sets it, before any build file is written."""
    from flashinfer.jit import env as jit_env
    import flashinfer.jit.core as core
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(tmp_path / "fivar"))
    (tmp_path / "cachev.py").write_text(VARIANT)
    wanted = [module(tmp_path / "cachev.py", "fp16", 64), module(tmp_path / "cachev.py", "bf16", 64)]
    for call in ("build", "write_ninja"):
        monkeypatch.setattr(core.JitSpecNvcc, call, lambda *a, **k: pytest.fail("a build file or command was made"))
    root = tmp_path / name / "flashinfer"
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", root / "cached_ops")
    monkeypatch.setattr(jit_env, "FLASHINFER_GEN_SRC_DIR", root / "generated")
    for build in (wanted[0].build, lambda: jb.build_many(wanted)):
        with pytest.raises(FivarError) as info:
            build()
        msg = str(info.value)
        shown = str(root) if str(root).isprintable() else repr(str(root))[1:-1]  # a line break escaped
        assert "\n" not in msg and shown in msg and "FLASHINFER_WORKSPACE_BASE" in msg and "shell" in msg, msg
    monkeypatch.setattr(jit_env, "FLASHINFER_JIT_DIR", tmp_path / "ok" / "cached_ops")
    monkeypatch.setattr(jit_env, "FLASHINFER_GEN_SRC_DIR", tmp_path / "ok" / "generated")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / name / "cuda"))
    with pytest.raises(FivarError, match=r"cannot compile with CUDA_HOME at .*PWNED.*shell") as info:
        wanted[0].build()
    assert not list(tmp_path.rglob("PWNED")) and not list(tmp_path.rglob("*.ninja"))


def test_a_fivar_cache_dir_with_a_space_works(tmp_path, monkeypatch):
    """Records, the Triton twin and the libcuda stub's link flag (one shell word) under a spaced path."""
    from fivar.jit import records, toolchain
    cache = tmp_path / "my fivar cache"
    monkeypatch.setenv("FIVAR_CACHE_DIR", str(cache))
    (tmp_path / "cachev.py").write_text(VARIANT)
    v = fivar.load(str(tmp_path / "cachev.py"))
    m = gen_module(v, "single_prefill", "fa2", "fp16", 64)
    records.record(m, "disk", 0.01)
    con = records.connect()
    assert con.execute("SELECT COUNT(*) FROM events WHERE uri=?", (m.uri,)).fetchone()[0] == 1
    con.close()
    assert Path(triton_module.load_triton_module(v).__file__).parent == cache / "triton"
    monkeypatch.setattr(toolchain, "_libcuda_linkable", lambda: False)
    m.spec = None
    spec = m.jit_spec()
    import shlex
    flags = [shlex.split(f) for f in spec.extra_ldflags]
    assert [f"-L{cache / 'libcuda-stub'}"] in flags, spec.extra_ldflags


def test_a_240_character_variant_name_builds_under_a_shortened_uri(iso, tmp_path, monkeypatch):
    name = "v" * 240
    f = tmp_path / "long.py"
    f.write_text(VARIANT.replace('"cachev"', f'"{name}"'))
    v = fivar.load(str(f))
    m = gen_module(v, "single_prefill", "fa2", "fp16", 64)
    assert len(m.uri) < 130 and m.uri.startswith("fivar_vvv")
    f2 = tmp_path / "long2.py"
    f2.write_text(VARIANT.replace('"cachev"', f'"{name[:-1]}w"'))
    assert gen_module(fivar.load(str(f2)), "single_prefill", "fa2", "fp16", 64).uri != m.uri  # still one per name
    fake_built(m)  # sources, directory, library and manifest all fit a file name
    man = json.loads(m.manifest_path.read_text())
    assert man["variant"] == name
    row = next(r for r in as_json("cache", "ls", "--no-stale-check") if r["uri"] == m.uri)
    assert row["variant"] == name
    assert len(Path(triton_module.load_triton_module(v).__file__).name) < 120


def test_cache_subcommands_take_arch_after_the_command(iso):
    _, ws, vfile = iso
    fake_built(module(vfile))
    a = invoke("cache", "ls", "--arch", "9.0a", "--json")
    b = invoke("cache", "--arch", "9.0a", "ls", "--json")
    assert a.exit_code == 0 and b.exit_code == 0, a.output
    assert json.loads(a.output)[0]["stale"] is False and json.loads(a.output) == json.loads(b.output)
    for cmd in (["verify"], ["stats"], ["prune", "--stale", "--dry-run"], ["clear", "--yes"]):
        r = invoke("cache", *cmd, "--arch", "9.0a", "--json")
        assert r.exit_code == 0, (cmd, r.output)
