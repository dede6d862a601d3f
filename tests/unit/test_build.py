"""Building through FlashInfer's JIT: every bundled variant compiles for sm_90a; URIs are content hashes."""
import os
import re
import shutil
import time

import pytest

import fivar
from fivar.errors import FivarBuildError
from fivar.jit.build import build_many, gen_module
from fivar.registry import variant_files

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
requires_nvcc = pytest.mark.skipif(not (os.path.exists(NVCC) or shutil.which("nvcc")),
                                   reason="nvcc not installed: cannot compile CUDA here")
BUNDLED = ["alibi", "document_mask", "relative_bias", "sigmoid", "sliding_window", "softcap",
           "softcap_sliding_window"]


def test_uri_names_variant_target_op_dtype_headdim_and_hash():
    m = gen_module(fivar.load("softcap"), op="single_prefill", dtype="bf16", head_dim=128)
    assert re.fullmatch(r"fivar_softcap_fa2_single_prefill_bf16_hd128_[0-9a-f]{12}", m.uri)
    assert gen_module(fivar.load("softcap"), op="single_prefill", dtype="fp16", head_dim=64).uri != m.uri


def test_editing_a_variant_changes_the_uri_and_reverting_restores_it(tmp_path):
    src = ("from fivar import AttentionVariant, tanh\n\n"
           "def logits(score, b, h, kh, qi, ki, p):\n    return 20.0 * tanh(score / 20.0)\n\n"
           "variant = AttentionVariant(name='edited', logits=logits)\n")
    f = tmp_path / "edited.py"
    uris = []
    for text in (src, src.replace("20.0", "25.0"), src):
        f.write_text(text)
        from fivar.registry import _loaded
        _loaded.clear()
        uris.append(gen_module(fivar.load(str(f))).uri)
    assert uris[0] != uris[1] and uris[0] == uris[2]


def test_only_needed_mask_modes_are_instantiated():
    plain = gen_module(fivar.load("softcap"))
    masked = gen_module(fivar.load("sliding_window"))
    assert sorted(n for n in plain.sources if "kernel_mask" in n) == [
        "single_prefill_kernel_mask_0.cu", "single_prefill_kernel_mask_1.cu"]
    assert sorted(n for n in masked.sources if "kernel_mask" in n) == ["single_prefill_kernel_mask_2.cu"]
    assert "case MaskMode::kCustom" in masked.sources["single_prefill_config.inc"]


@pytest.mark.parametrize("op,target", [("single_prefill", "fa2"), ("batch_prefill", "fa2"),
                                       ("batch_decode", "fa2"), ("single_prefill", "fa3"),
                                       ("batch_prefill", "fa3")])
def test_host_sources_are_one_host_only_translation_unit(op, target):
    """FlashInfer's host .cu files (launcher wrapper + tvm-ffi binding) compile as one nvcc unit, hidden from
    the device pass (they define no device code): one nvcc run and no cicc over their headers."""
    m = gen_module(fivar.load("softcap"), op=op, target=target)
    stem = op + ("_sm90" if target == "fa3" else "")
    host = [n for n in m.sources if n.endswith(".cu") and "kernel" not in n]
    assert host == [f"{stem}_jit_binding.cu"]
    text = m.sources[host[0]]
    lines = text.rstrip().splitlines()
    assert lines[1] == "#ifndef __CUDA_ARCH__" and lines[-1] == "#endif  // __CUDA_ARCH__"
    assert text.count("#ifndef __CUDA_ARCH__") == 1
    # the binding's declarations (no default arguments) come before the definitions
    assert text.index(f"// ---- {stem}_jit_binding.cu ----") < text.index(f"// ---- {stem}.cu ----")
    # kernel units come first, so ninja starts the long ones first
    cus = [n for n in m.sources if n.endswith(".cu")]
    assert cus[-1] == host[0]


@requires_nvcc
def test_every_bundled_variant_compiles_for_sm90a():
    assert sorted(variant_files()) == BUNDLED or set(BUNDLED) <= set(variant_files())
    modules = [gen_module(fivar.load(n), op="single_prefill") for n in BUNDLED]
    results = build_many(modules)
    for m, (kind, _) in zip(modules, results):
        assert m.library_path.exists(), m.uri
        assert kind == "cold", (m.uri, kind)  # fresh cache per session (tests/conftest.py)
        assert "-gencode=arch=compute_90a,code=sm_90a" in (m.build_dir / "build.ninja").read_text()
    # Unchanged: a second build is a hit, and fast.
    t0 = time.perf_counter()
    assert [k for k, _ in build_many(modules)] == ["disk"] * len(modules)
    assert time.perf_counter() - t0 < 5


@requires_nvcc
def test_batch_prefill_and_decode_modules_compile():
    modules = [gen_module(fivar.load("document_mask"), op="batch_prefill"),
               gen_module(fivar.load("alibi"), op="batch_decode")]
    build_many(modules)
    assert all(m.library_path.exists() for m in modules)


@requires_nvcc
def test_nvcc_failure_is_reported_as_a_fivar_bug_not_a_raw_error():
    m = gen_module(fivar.load("softcap"), op="single_prefill", dtype="fp16", head_dim=64)
    m.uri += "_broken"
    m.sources["single_prefill_config.inc"] += "\nthis is not C++;\n"
    with pytest.raises(FivarBuildError) as info:
        m.build()
    text = str(info.value)
    assert "variant 'softcap'" in text and "fivar bug" in text and "error:" not in text.lower().split("log at")[0]
    log = text.rsplit("log at ", 1)[1].strip()
    assert os.path.exists(log) and "this is not C++" in open(log).read()


@requires_nvcc
def test_fa3_module_compiles_for_sm90a():
    """The Hopper struct (mask folded into LogitsTransform, request index from the block coordinate)."""
    m = gen_module(fivar.load("softcap_sliding_window"), op="single_prefill", target="fa3")
    assert sorted(n for n in m.sources if "kernel_mask" in n) == [
        "single_prefill_sm90_kernel_mask_0.cu", "single_prefill_sm90_kernel_mask_1.cu"]
    # the window mask gives a band: FA3's sliding-window schedule skips the KV tiles left of it
    assert "USE_SLIDING_WINDOW=*/true" in m.sources["single_prefill_sm90_kernel_mask_0.cu"]
    assert m.build() == "cold" and m.library_path.exists()


def test_fa3_has_no_decode():
    with pytest.raises(fivar.FivarError, match="no FA3 kernel for batch_decode"):
        gen_module(fivar.load("softcap"), op="batch_decode", target="fa3")
