"""Every bundled fusion compiles for sm_90a through FlashInfer's JIT, in one build_many; URIs are content hashes."""
import os
import re
import shutil
import time

import pytest
from click.testing import CliRunner

import fivar
from fivar.cli import main
from fivar.fusion.build import gen_fusion_module
from fivar.jit.build import build_many

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
requires_nvcc = pytest.mark.skipif(not (os.path.exists(NVCC) or shutil.which("nvcc")),
                                   reason="nvcc not installed: cannot compile CUDA here")
BUNDLED_FUSIONS = ["qwen3_qk_norm_rope", "llama_add_rmsnorm", "add_rmsnorm_fp8", "partial_rope_gptj"]


def test_fusion_uri_names_the_fusion_and_hashes_its_sources():
    m = gen_fusion_module(fivar.load("qwen3_qk_norm_rope"))
    assert re.fullmatch(r"fivar_qwen3_qk_norm_rope_fusion_bf16_hd128_[0-9a-f]{12}", m.uri)
    assert (m.op, m.target, m.dtype, m.head_dim) == ("fusion", "fusion", "bf16", 128)
    assert gen_fusion_module(fivar.load("qwen3_qk_norm_rope")).uri == m.uri  # deterministic
    assert gen_fusion_module(fivar.load("qwen3_qk_norm_rope"), "fp16").uri != m.uri
    other = fivar.FusionVariant(name="qwen3_qk_norm_rope", norm="rmsnorm", norm_scope="head", rope="neox",
                                head_dim=128, rotary_dim=64)
    assert gen_fusion_module(other).uri != m.uri  # a compile-time field changed
    row = gen_fusion_module(fivar.load("llama_add_rmsnorm"))
    assert row.uri.startswith("fivar_llama_add_rmsnorm_fusion_bf16_hd0_")
    assert set(row.sources) == {"fusion_llama_add_rmsnorm.cu", "fivar_fusion.cuh"}


@pytest.mark.nvcc
@requires_nvcc
def test_every_bundled_fusion_compiles_for_sm90a():
    modules = [gen_fusion_module(fivar.load(n)) for n in BUNDLED_FUSIONS]
    assert len({m.uri for m in modules}) == len(modules)
    results = build_many(modules)  # one parallel ninja over all of them
    for m, (kind, _) in zip(modules, results):
        assert m.library_path.exists(), m.uri
        assert kind == "cold", (m.uri, kind)  # fresh cache per test run (tests/conftest.py)
        assert "-gencode=arch=compute_90a,code=sm_90a" in (m.build_dir / "build.ninja").read_text()
        assert m.manifest_ok()
        assert b"__tvm_ffi_fusion_run" in m.library_path.read_bytes()  # the tvm-ffi binding is exported
    # unchanged: a second build is a hit, also through the CLI's fusion branch
    t0 = time.perf_counter()
    assert [k for k, _ in build_many(modules)] == ["disk"] * len(modules)
    assert time.perf_counter() - t0 < 5
    r = CliRunner().invoke(main, ["build", *BUNDLED_FUSIONS, "--arch", "9.0a"])
    assert r.exit_code == 0, r.output
    assert r.output.count("hit (disk)") == len(BUNDLED_FUSIONS) and "compiled" not in r.output


@pytest.mark.nvcc
@requires_nvcc
def test_computed_cos_sin_fusions_compile_for_sm90a():
    """cos/sin from positions and inv_freq (sincosf in the kernel), NeoX and GPT-J."""
    modules = [gen_fusion_module(fivar.FusionVariant(
        name=f"computed_{rope}", norm=norm, norm_scope="head", rope=rope, head_dim=128, rotary_dim=rd,
        cos_sin="computed")) for rope, norm, rd in (("neox", "rmsnorm", 128), ("gptj", None, 64))]
    for m in modules:
        assert "constexpr bool kComputedCosSin = true;" in m.sources[f"fusion_{m.variant.name}.cu"]
    assert [k for k, _ in build_many(modules)] == ["cold", "cold"]
    assert all(m.library_path.exists() for m in modules)
