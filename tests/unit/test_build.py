"""Building through FlashInfer's JIT: every bundled variant compiles for sm_90a; URIs are content hashes."""
import os
import re
import shutil
import subprocess
import time

import pytest

import fivar
from fivar.errors import FivarBuildError, FivarError
from fivar.jit.build import build_many, gen_module
from fivar.registry import variant_files

NVCC = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
requires_nvcc = pytest.mark.skipif(not (os.path.exists(NVCC) or shutil.which("nvcc")),
                                   reason="nvcc not installed: cannot compile CUDA here")
BUNDLED = ["alibi", "document_mask", "relative_bias", "sigmoid", "sliding_window", "softcap",
           "softcap_sliding_window"]
SHARED_SHAPES = {"document_mask": dict(dtype="fp16", head_dim=128), "sigmoid": dict(dtype="fp16", head_dim=64)}



def _needs(*couplings):
    """Skip where the installed FlashInfer release turns these optimisations off by design
    (fivar.flashinfer_compat.OFF_IN_RELEASE: 0.7.4's FA2 launchers are not the ones fivar's copies mirror)."""
    from fivar.flashinfer_compat import OFF_IN_RELEASE, release
    off = sorted(set(couplings) & OFF_IN_RELEASE.get(release(), frozenset()))
    return pytest.mark.skipif(bool(off), reason=f"off by design on this FlashInfer release: {', '.join(off)}")

def test_uri_names_variant_target_op_dtype_headdim_and_hash():
    m = gen_module(fivar.load("softcap"), op="single_prefill", dtype="bf16", head_dim=128)
    assert re.fullmatch(r"fivar_softcap_fa2_single_prefill_bf16_hd128_[0-9a-f]{12}", m.uri)
    assert gen_module(fivar.load("softcap"), op="single_prefill", dtype="fp16", head_dim=64).uri != m.uri


def test_fa2_units_compile_with_nvcc_split_compile(monkeypatch):
    """FA2 modules ask nvcc for --split-compile unless FIVAR_NVCC_SPLIT_COMPILE=1; on/off is part of the URI, the
    thread count (given at build time: the env's N >= 2, else half the cores within [2, 8]) is not. FA3 modules keep
    FlashInfer's flags."""
    from fivar import FivarError
    from fivar.jit import toolchain
    from fivar.jit.build import module_for
    monkeypatch.delenv(toolchain.SPLIT_COMPILE_ENV, raising=False)
    v = fivar.load("softcap")
    on, off = gen_module(v), gen_module(v, nvcc_split_compile=False)
    assert on.cuda_cflags == ["--split-compile", "--threads"] and on.options["nvcc_split_compile"] is True
    assert off.cuda_cflags == ["--threads"] and off.options["nvcc_split_compile"] is False and off.uri != on.uri
    assert gen_module(v, op="batch_decode").cuda_cflags == ["--split-compile", "--threads"]
    assert not any("split-compile" in f for f in gen_module(v, target="fa3").cuda_cflags)
    for cores, threads in ((1, 2), (2, 2), (6, 3), (16, 8), (128, 8)):
        monkeypatch.setattr(toolchain, "cpu_count", lambda c=cores: c)
        assert toolchain.build_flags(on.cuda_cflags)[0] == f"--split-compile={threads}"
    monkeypatch.setenv(toolchain.SPLIT_COMPILE_ENV, "12")
    assert toolchain.build_flags(on.cuda_cflags)[0] == "--split-compile=12" and gen_module(v).uri == on.uri
    monkeypatch.setenv(toolchain.SPLIT_COMPILE_ENV, "1")
    assert gen_module(v).uri == off.uri and module_for(v, "single_prefill", "fa2", "bf16", 128).uri == off.uri
    for bad in ("0", "-2", "four", "\u00b2"):
        monkeypatch.setenv(toolchain.SPLIT_COMPILE_ENV, bad)
        with pytest.raises(FivarError, match=f"FIVAR_NVCC_SPLIT_COMPILE='{bad}': expected a thread count"):
            gen_module(v)
    with pytest.raises(FivarError, match="nvcc_split_compile=8: expected True or False"):
        gen_module(v, nvcc_split_compile=8)


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


@_needs('fa2_single_prefill_split', 'fa2_batch_prefill_split')
def test_only_needed_mask_modes_are_instantiated(monkeypatch):
    monkeypatch.delenv("FIVAR_SPLIT_CTA_TILES", raising=False)
    plain = gen_module(fivar.load("softcap"), split_cta_tiles=True)
    masked = gen_module(fivar.load("document_mask"), split_cta_tiles=True)
    window = gen_module(fivar.load("sliding_window"), split_cta_tiles=True)  # fa2.window_form: kCausal too
    assert sorted(n for n in window.sources if "kernel_mask" in n and "_cta" not in n) == [
        "single_prefill_kernel_mask_1.cu", "single_prefill_kernel_mask_2.cu"]
    assert sorted(n for n in plain.sources if "kernel_mask" in n) == [
        "single_prefill_kernel_mask_0.cu", "single_prefill_kernel_mask_0_cta16_32.cu",
        "single_prefill_kernel_mask_0_cta64.cu", "single_prefill_kernel_mask_1.cu",
        "single_prefill_kernel_mask_1_cta16_32.cu", "single_prefill_kernel_mask_1_cta64.cu"]
    assert sorted(n for n in masked.sources if "kernel_mask" in n) == [
        "single_prefill_kernel_mask_2.cu", "single_prefill_kernel_mask_2_cta16_32.cu",
        "single_prefill_kernel_mask_2_cta64.cu"]
    assert "case MaskMode::kCustom" in masked.sources["single_prefill_config.inc"]
    # FlashInfer's own layout (the default; FIVAR_SPLIT_CTA_TILES=1 splits): one unit per mask mode
    whole = gen_module(fivar.load("softcap"))
    assert sorted(n for n in whole.sources if "kernel_mask" in n) == [
        "single_prefill_kernel_mask_0.cu", "single_prefill_kernel_mask_1.cu"]
    assert whole.uri != plain.uri and whole.uri == gen_module(fivar.load("softcap"), split_cta_tiles=False).uri
    monkeypatch.setenv("FIVAR_SPLIT_CTA_TILES", "1")
    assert gen_module(fivar.load("softcap")).uri == plain.uri


def test_fa2_mask_free_segments_module_has_no_mask():
    """FA2's mask-free key-segments module (documents and chunks as segments: kCausal is the whole mask) renders
    the struct without the mask and its causal flag, instantiates kCausal only, and is a module of its own;
    the key-segments module it stands beside keeps the mask in both modes."""
    from fivar.codegen import fa2
    v = fivar.load("document_mask")
    free = gen_module(v, op="batch_prefill", kv_segments=True, mask_free=True)
    masked = gen_module(v, op="batch_prefill", kv_segments=True)
    config = free.sources["batch_prefill_config.inc"]
    assert "REGISTER_LOGITS_MASK" not in config and "fv_causal" not in config and "fv_kv_segments" in config
    assert "REGISTER_LOGITS_MASK" in masked.sources["batch_prefill_config.inc"]
    assert sorted(n for n in free.sources if "kernel_mask" in n) == [
        "batch_prefill_paged_kernel_mask_1.cu", "batch_prefill_ragged_kernel_mask_1.cu"]
    assert free.uri != masked.uri and "_kvsegfree_" in free.uri
    assert "fv_causal" not in free.additional[2] and "fv_causal" in masked.additional[2]
    assert fa2.mask_modes(v, kv_segments=True, mask_free=True) == [fa2.MASK_CAUSAL]
    with pytest.raises(Exception, match="mask-free"):
        gen_module(v, op="batch_prefill", mask_free=True)


def _units(m):
    """kernel unit -> (mask codes, CTA tiles) it instantiates; plus the unit that instantiates the merge."""
    units, merge_units = {}, []
    for name, text in m.sources.items():
        if not name.endswith(".cu") or "kernel" not in name:
            continue
        insts = re.findall(r"^template cudaError_t (\w+)<(.*?)>\(", text, re.S | re.M)
        tiles = {int(x) for _, args in insts for x in re.findall(r"/\*CTA_TILE_Q=\*/(\d+)", args)}
        codes = {"None": 0, "Causal": 1, "Custom": 2}
        masks = {codes[x] for _, args in insts for x in re.findall(r"MaskMode::k(None|Causal|Custom)", args)}
        units[name] = (masks, tiles)
        if any(f in ("MergeStates", "AttentionSum", "VariableLengthMergeStates", "VariableLengthAttentionSum")
               for f, _ in insts):
            merge_units.append(name)
        else:
            assert "extern template" in text, name
    return units, merge_units


@pytest.mark.parametrize("op", [pytest.param("single_prefill", marks=_needs('fa2_single_prefill_split')),
                                pytest.param("batch_prefill", marks=_needs('fa2_batch_prefill_split'))])
@pytest.mark.parametrize("variant,head_dim", [("softcap", 128), ("document_mask", 64), ("sigmoid", 256)])
def test_fa2_prefill_kernels_are_one_unit_per_mask_mode_and_cta_tile(op, variant, head_dim):
    """Each CTA tile FlashInfer's FA2DetermineCtaTileQ can pick compiles in a unit of its own (the longest
    unit of a cold build was one mask mode with all its tiles); together the units instantiate exactly what
    FlashInfer's per-mask-mode units do, and the split-KV merge once per module."""
    from flashinfer.jit.utils import mask_mode_literal

    from fivar.codegen import fa2
    from fivar.jit import build
    v = fivar.load(variant)
    m = gen_module(v, op=op, head_dim=head_dim, split_cta_tiles=True)
    units, merge_units = _units(m)
    masks = {fa2.MASK_CODES[mode] for mode in fa2.mask_modes(v)}
    reachable = [128, 64, 16] if head_dim < 256 else [64, 16]  # FA2DetermineCtaTileQ, head_dim < 512
    instantiated = [128, 64, 32, 16] if op == "single_prefill" else [128, 64, 16]
    assert len(units) == len(masks) * len(reachable)
    for mask in masks:
        mine = {n: tiles for n, (ms, tiles) in units.items() if ms == {mask}}
        assert sorted(len([n for n, tiles in mine.items() if t in tiles]) for t in instantiated) == \
            [1] * len(instantiated)  # every tile in exactly one unit of this mask mode
        own = sorted(next(iter(tiles & set(reachable))) for tiles in mine.values())
        assert own == sorted(reachable)  # one unit per tile FlashInfer can pick
    assert len(merge_units) == 1
    if op == "batch_prefill":  # FlashInfer's explicit instantiations, the same statements
        ours = build._inst_statements("".join(t for n, t in m.sources.items() if n in units))
        theirs = build._inst_statements("".join(
            build._render_flashinfer(inst, mask_mode=mask_mode_literal[code], dtype_o="nv_bfloat16",
                                     head_dim_qk=head_dim, head_dim_vo=head_dim,
                                     pos_encoding_mode="PosEncodingMode::kNone", use_fp16_qk_reduction="false",
                                     variant_name=fa2.struct_name(v), same_kv_strides_values=["true", "false"])
            for code in masks for inst in ("batch_prefill_paged_kernel_inst.jinja",
                                           "batch_prefill_ragged_kernel_inst.jinja")))
        assert ours == theirs and len(ours) == 9 * len(masks)
    else:  # the host unit carries the dispatcher, the tile function goes with the kernel units
        assert '#include "fivar_single_prefill_dispatch.cuh"' in m.sources["single_prefill_jit_binding.cu"]
        assert "fivar_single_prefill_tile.cuh" in m.sources


def _installed_with(tmp_path, monkeypatch, edit):
    """The installed FlashInfer's headers with prefill.cuh's SinglePrefillWithKVCacheDispatched edited, in use."""
    from flashinfer.jit import env as jit_env
    inc = tmp_path / "include"
    shutil.copytree(jit_env.FLASHINFER_INCLUDE_DIR / "flashinfer", inc / "flashinfer")
    prefill = inc / "flashinfer" / "attention" / "prefill.cuh"
    text = prefill.read_text()
    at = text.index("cudaError_t SinglePrefillWithKVCacheDispatched(")
    prefill.write_text(text[:at] + edit(text[at:]))
    monkeypatch.setattr(jit_env, "FLASHINFER_INCLUDE_DIR", inc)


def test_single_prefill_split_cuts_the_installed_launcher_and_needs_only_its_form(tmp_path, monkeypatch, caplog):
    """The per-tile function is cut from the installed FlashInfer's launcher: a changed body (here the 256-row
    minimum KV chunk of its split-KV heuristic) is carried into the units; a launcher not of the form fivar cuts
    (no DISPATCH_CTA_TILE_Q over its body) gets FlashInfer's own unsplit units, said once."""
    import logging

    from fivar.flashinfer_compat import fa2_launchers
    from fivar.jit import build
    line = "uint32_t chunk_size = max(ceil_div(kv_len, max_num_kv_chunks), 256);"
    cached = (build._single_prefill_split_problem, fa2_launchers._installed_single_prefill_parts)
    try:
        assert build._single_prefill_split_problem() is None  # the installed FlashInfer: split
        installed = gen_module(fivar.load("softcap"), split_cta_tiles=True)
        # the tile function: FlashInfer's preamble (but its tile choice) and body, the dispatcher its preamble
        assert "FA2DetermineCtaTileQ" not in installed.sources["fivar_single_prefill_tile.cuh"]
        assert "FA2DetermineCtaTileQ" in installed.sources["fivar_single_prefill_dispatch.cuh"]
        assert line in installed.sources["fivar_single_prefill_tile.cuh"]
        _installed_with(tmp_path / "a", monkeypatch, lambda t: t.replace(line, line.replace("256", "512"), 1))
        for f in cached:
            f.cache_clear()
        m = gen_module(fivar.load("softcap"), split_cta_tiles=True)
        tile = m.sources["fivar_single_prefill_tile.cuh"]
        assert line.replace("256", "512") in tile and line not in tile
        assert m.uri != installed.uri  # the URI follows FlashInfer's text
        # a preamble with an effect the per-tile copy would repeat: not cut
        _installed_with(tmp_path / "c", monkeypatch, lambda t: t.replace(
            "const uint32_t group_size", "params.kv_len += 1;\n  const uint32_t group_size", 1))
        for f in cached:
            f.cache_clear()
        assert "effects the per-tile copy would repeat" in build._single_prefill_split_problem()
        _installed_with(tmp_path / "b", monkeypatch,
                        lambda t: t.replace("DISPATCH_CTA_TILE_Q(cta_tile_q, CTA_TILE_Q, {", "SWITCH_TILE({", 1))
        for f in cached:
            f.cache_clear()
        with caplog.at_level(logging.WARNING, logger="fivar"):
            m = gen_module(fivar.load("softcap"), split_cta_tiles=True)
        assert build._single_prefill_split_problem() == \
            "prefill.cuh has no SinglePrefillWithKVCacheDispatched of the form fivar splits"
        assert sorted(n for n in m.sources if "kernel" in n and n.endswith(".cu")) == [
            "single_prefill_kernel_mask_0.cu", "single_prefill_kernel_mask_1.cu"]
        assert "fivar_single_prefill_tile.cuh" not in m.sources
        assert m.uri == gen_module(fivar.load("softcap"), split_cta_tiles=False).uri
        assert any("compiling its single_prefill kernels unsplit" in r.getMessage() for r in caplog.records)
    finally:
        monkeypatch.undo()
        for f in cached:
            f.cache_clear()
        build._split_warned.clear()


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
    if target == "fa2":  # FA2 units start by leaving out unused headers (fivar/jit/unused_headers.py)
        assert lines.pop(0).startswith("#define _CUDA_PIPELINE ")
        if op != "batch_decode":
            assert lines.pop(0).startswith('#include "fivar_thread_block.cuh" ')
    assert lines[1] == "#ifndef __CUDA_ARCH__" and lines[-1] == "#endif  // __CUDA_ARCH__"
    assert text.count("#ifndef __CUDA_ARCH__") == 1
    # the binding's declarations (no default arguments) come before the definitions
    assert text.index(f"// ---- {stem}_jit_binding.cu ----") < text.index(f"// ---- {stem}.cu ----")
    # kernel units come first, so ninja starts the long ones first
    cus = [n for n in m.sources if n.endswith(".cu")]
    assert cus[-1] == host[0]


@requires_nvcc
@pytest.mark.nvcc
def test_every_bundled_variant_compiles_for_sm90a():
    assert sorted(variant_files()) == BUNDLED or set(BUNDLED) <= set(variant_files())
    # bf16 hd128, except where a later test of this file compiles a variant at another shape: that one, so each
    # module compiles once in a run (the split test's whole-module build, the parallel-passes test's first build)
    modules = [gen_module(fivar.load(n), op="single_prefill", **SHARED_SHAPES.get(n, {})) for n in BUNDLED]
    t0 = time.perf_counter()
    results = build_many(modules)
    wall = time.perf_counter() - t0
    for m, (kind, _) in zip(modules, results):
        assert m.library_path.exists(), m.uri
        assert kind == "cold", (m.uri, kind)  # fresh cache per test run (tests/conftest.py)
        assert "-gencode=arch=compute_90a,code=sm_90a" in (m.build_dir / "build.ninja").read_text()
    # each module's seconds are its own span inside the shared ninja (ninja's log), not the batch's wall time
    secs = [s for _, s in results]
    assert all(0 < s <= wall for s in secs) and len({round(s, 2) for s in secs}) > 1, (secs, wall)
    # Unchanged: a second build is a hit, and fast.
    t0 = time.perf_counter()
    assert [k for k, _ in build_many(modules)] == ["disk"] * len(modules)
    assert time.perf_counter() - t0 < 5


def _cuobjdump():
    import importlib.util
    found = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"),
             shutil.which("cuobjdump") or ""]
    spec = importlib.util.find_spec("triton")  # Triton bundles one
    if spec and spec.submodule_search_locations:
        found.append(os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin", "cuobjdump"))
    return next((c for c in found if c and os.path.exists(c)), None)


CUOBJDUMP = _cuobjdump()
requires_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump to list the kernels with")


def _kernels_per_unit(m):
    """kernel unit (source name) -> the kernels (mangled names) in its object's cubin."""
    out = {}
    for obj in m.build_dir.glob("*.cuda.o"):
        elf = subprocess.run([CUOBJDUMP, "-elf", str(obj)], capture_output=True, text=True, check=True).stdout
        out[obj.name[len(m.uri) + 1:-len(".cuda.o")] + ".cu"] = set(re.findall(r"\.text\.(\w+)", elf))
    return out


def _sass(path):
    """kernel (mangled name) -> the distinct instruction streams its copies in the library have."""
    text = subprocess.run([CUOBJDUMP, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    copies, name = [], None
    for line in text.splitlines():
        if m := re.match(r"\s*Function : (\S+)", line):
            name = m.group(1)
            copies.append((name, []))
        elif (m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)) and name:
            copies[-1][1].append(m.group(1))
    fns = {}
    for name, code in copies:
        fns.setdefault(name, set()).add("\n".join(code))
    return fns


def _check_split_objects(m):
    """Each kernel unit's object holds the kernels of its own mask mode and tiles, no kernel is compiled in two
    units, the host unit holds none, and one unit holds the split-KV merge kernels. Returns all kernels."""
    units, merge_units = _units(m)
    per_unit = _kernels_per_unit(m)
    assert set(per_unit) == {n for n in m.sources if n.endswith(".cu")}
    every = [k for ks in per_unit.values() for k in ks]
    assert len(every) == len(set(every)), "a kernel compiled in two units"
    for unit, kernels in per_unit.items():
        if unit not in units:
            assert kernels == set(), unit  # the host unit
            continue
        masks, tiles = units[unit]
        prefill = [k for k in kernels if "PrefillWith" in k]
        assert {tuple(map(int, re.search(r"KernelTraitsILNS_8MaskModeE(\d)ELj(\d+)E", k).groups()))
                for k in prefill} <= {(mask, t) for mask in masks for t in tiles}, unit
        assert bool(kernels - set(prefill)) == (unit in merge_units), unit  # merge kernels: that unit only
        assert prefill, unit  # every unit of a tile FlashInfer can pick has kernels
    return set(every)


@requires_nvcc
@pytest.mark.nvcc
@requires_cuobjdump
@_needs("fa2_single_prefill_split", "fa2_pinned_kv_tiles")
def test_split_single_prefill_compiles_to_flashinfer_kernels_instruction_for_instruction():
    """The per-tile units build the kernels FlashInfer's per-mask-mode unit does, each once, the same SASS."""
    v = fivar.load("document_mask")
    split = gen_module(v, op="single_prefill", dtype="fp16", head_dim=128, split_cta_tiles=True)
    whole = gen_module(v, op="single_prefill", dtype="fp16", head_dim=128, split_cta_tiles=False)
    build_many([split, whole])
    kernels = _check_split_objects(split)
    whole_kernels = set().union(*_kernels_per_unit(whole).values())
    # with KV tiles pinned (the default), one prefill kernel per tile: 128, 64, 16; and the split-KV merge kernels
    assert kernels == whole_kernels and len([k for k in kernels if "PrefillWith" in k]) == 3 and len(kernels) > 6
    assert _sass(split.library_path) == _sass(whole.library_path)
    # nothing the split library calls is left for the loader to find (the tile launchers, the merge)
    undefined = subprocess.run(["nm", "-uC", str(split.library_path)], capture_output=True, text=True).stdout
    assert "flashinfer::" not in undefined


@requires_nvcc
@pytest.mark.nvcc
@requires_cuobjdump
def test_nvcc_split_compile_output_does_not_depend_on_the_thread_count(monkeypatch):
    """The URI says whether nvcc's --split-compile is on, not with how many threads (each host picks its own):
    that is sound only while nvcc's output is the same at any count from 2 up, which this rebuilds to check.
    The first build is the bundled-variant test's module (SHARED_SHAPES), at this host's count."""
    from fivar.jit import toolchain
    m = gen_module(fivar.load("sigmoid"), op="single_prefill", dtype="fp16", head_dim=64, split_cta_tiles=False,
                   nvcc_split_compile=True)
    m.build()
    first = int(re.findall(r"--split-compile=(\d+)", (m.build_dir / "build.ninja").read_text())[-1])
    sass = [_sass(m.library_path)]
    other = str(first + 3)
    monkeypatch.setenv(toolchain.SPLIT_COMPILE_ENV, other)
    shutil.rmtree(m.build_dir, ignore_errors=True)
    m.spec = None  # a fresh JitSpec: its ninja file takes this thread count
    assert m.build() == "cold"
    assert f"--split-compile={other}" in (m.build_dir / "build.ninja").read_text()
    sass.append(_sass(m.library_path))
    assert first >= 2 and len(sass[0]) > 4 and sass[0] == sass[1]


def test_nvcc_runs_host_and_device_passes_side_by_side_unless_told_not_to(monkeypatch):
    """--threads in the URI, its count (one per target arch, one for the host pass) on nvcc's command line after
    FlashInfer's own --threads=1, which nvcc would otherwise take; FIVAR_NVCC_PARALLEL_PASSES=0 leaves it out."""
    from fivar.jit import toolchain
    monkeypatch.delenv(toolchain.PARALLEL_PASSES_ENV, raising=False)
    for target in ("fa2", "fa3"):
        m = gen_module(fivar.load("softcap"), op="single_prefill", target=target)
        assert "--threads" in m.cuda_cflags and m.options["nvcc_parallel_passes"] is True
        for unit in m.jit_spec().get_compile_commands():
            assert re.findall(r"--threads=(\d+)", unit["command"])[-1] == str(len(toolchain.target_archs()) + 1)
        serial = gen_module(fivar.load("softcap"), op="single_prefill", target=target, nvcc_parallel_passes=False)
        assert "--threads" not in serial.cuda_cflags and serial.uri != m.uri
    monkeypatch.setenv(toolchain.PARALLEL_PASSES_ENV, "0")
    assert gen_module(fivar.load("softcap"), op="single_prefill").options["nvcc_parallel_passes"] is False


def _assert_same_sass(variant: str, one: dict, other: dict, **module):
    """Builds a single-prefill module with gen_module options `one` and with `other`: another URI, the same kernels
    (at least 6: prefill kernels per CTA tile and the split-KV merge kernels), instruction for instruction."""
    a, b = (gen_module(fivar.load(variant), op="single_prefill", **module, **opts) for opts in (one, other))
    assert a.uri != b.uri
    build_many([a, b])
    sass = _sass(a.library_path)
    assert len(sass) >= 2 * 3 and sass == _sass(b.library_path)
    return a, b


@requires_nvcc
@pytest.mark.nvcc
@requires_cuobjdump
def test_parallel_passes_compile_to_the_same_sass():
    _assert_same_sass("sigmoid", {"nvcc_parallel_passes": True}, {"nvcc_parallel_passes": False}, dtype="fp16",
                      head_dim=64)


@requires_nvcc
@pytest.mark.nvcc
def test_batch_prefill_and_decode_modules_compile():
    modules = [gen_module(fivar.load("document_mask"), op="batch_prefill", split_cta_tiles=True),
               gen_module(fivar.load("alibi"), op="batch_decode")]
    build_many(modules)
    assert all(m.library_path.exists() for m in modules)
    if CUOBJDUMP:  # batch prefill: FlashInfer's instantiations, one unit per (mask mode, tile), kernels once
        assert len(_check_split_objects(modules[0])) > 10


@requires_nvcc
@pytest.mark.nvcc
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


def test_an_arch_nvcc_rejects_is_named_not_called_a_fivar_bug(tmp_path, monkeypatch):
    """FLASHINFER_CUDA_ARCH_LIST is only checked for its form where a build starts from the environment; an arch this
    nvcc lacks fails in nvcc, and the error says so instead of blaming the spec."""
    from fivar import FivarError
    m = gen_module(fivar.load("softcap"), op="single_prefill", dtype="fp16", head_dim=64)
    m.uri += "_arch"

    class NvccRefuses:
        lock_path = str(tmp_path / "lock")

        def build(self):
            raise RuntimeError("ninja: build stopped\nnvcc fatal   : Unsupported gpu architecture 'compute_91a'")
    m.spec = NvccRefuses()
    monkeypatch.setattr(type(m), "_prepare", lambda self, missing=None: None)
    with pytest.raises(FivarError) as info:
        m.build()
    assert not isinstance(info.value, FivarBuildError)
    assert "cannot compile for compute_91a" in str(info.value) and "fivar bug" not in str(info.value)


@requires_nvcc
@pytest.mark.nvcc
def test_fa3_module_compiles_for_sm90a(monkeypatch):
    """The Hopper struct (mask folded into LogitsTransform, request index from the block coordinate); compiled the
    few-cores way, the second tile's unit inside its mode's (test_fa3_tiles renders the many-cores way), both mask
    modes' dispatch defined with kernels of the module's tiles alone."""
    from fivar.jit import toolchain
    monkeypatch.setattr(toolchain, "cpu_count", lambda: 2)
    m = gen_module(fivar.load("softcap_sliding_window"), op="single_prefill", target="fa3")
    assert sorted(n for n in m.sources if "kernel_mask" in n) == [
        "single_prefill_sm90_kernel_mask_0.cu", "single_prefill_sm90_kernel_mask_0_tile1.cu",
        "single_prefill_sm90_kernel_mask_1.cu"]  # the non-causal choice's second tile: a source of its own
    # the window mask gives a band: FA3's sliding-window schedule skips the KV tiles left of it
    assert "USE_SLIDING_WINDOW=*/true" in m.sources["single_prefill_sm90_kernel_mask_0.cu"]
    # and its causal kernel runs on fivar's persistent launcher (csrc/fivar_fa3_persistent.cuh)
    assert "fivar::single_prefill_persistent<" in m.sources["single_prefill_sm90_kernel_mask_1.cu"]
    assert m.build() == "cold" and m.library_path.exists()
    if shutil.which("nm"):  # the second tile's launcher is defined in the library, and local to it
        syms = subprocess.run(["nm", "-C", str(m.library_path)], capture_output=True, text=True).stdout.splitlines()
        assert [ln.split()[1] for ln in syms if "fivar_single_prefill_mask_0_tile_1(" in ln] == ["t"], syms[:5]
        dispatch = [ln for ln in syms if "SinglePrefillWithKVCacheDispatched<" in ln]
        assert not [ln for ln in dispatch if ln.split()[0] == "U"], dispatch
        for mode in ("(flashinfer::MaskMode)0", "(flashinfer::MaskMode)1"):  # both defined, in place of FlashInfer's
            assert any(f"SinglePrefillWithKVCacheDispatched<128u, 128u, {mode}" in ln and " T " in ln
                       for ln in dispatch), (mode, dispatch)
        text = "\n".join(syms)  # kernels of the module's own tiles (fa3.MUFU_BOUND_WINDOW_TILE), none of FlashInfer's
        traits = "AttentionKernelTraits<true, 128, 128, {}, {}, 2"
        assert all(traits.format(q, kv) in text for q, kv in ((192, 64), (128, 128)))
        assert traits.format(128, 192) not in text
    assert not list(m.build_dir.glob("*tile1.cuda.o"))  # the tile unit compiled inside its mode's


def test_fa3_has_no_decode():
    with pytest.raises(fivar.FivarError, match="no FA3 kernel for batch_decode"):
        gen_module(fivar.load("softcap"), op="batch_decode", target="fa3")


def test_fa3_is_refused_for_archs_without_sm90a(monkeypatch):
    """Not an 8-minute compile of kernels no GPU of that arch can run."""
    from fivar.jit import toolchain
    monkeypatch.setattr(toolchain, "arch_tag", lambda: "75")
    with pytest.raises(fivar.FivarError, match="variant 'softcap': FA3 kernels are Hopper-only.*archs are 75"):
        gen_module(fivar.load("softcap"), op="single_prefill", target="fa3")
    assert gen_module(fivar.load("softcap"), op="single_prefill", target="fa2").target == "fa2"


# --- KV tiles pinned at compile time (fivar/jit/pinned_kv_tiles.py, csrc/fivar_pinned_kv_tiles.cuh) ---

def _flashinfer_launcher_texts():
    from flashinfer.jit import env as jit_env
    include = jit_env.FLASHINFER_INCLUDE_DIR / "flashinfer"
    return (include / "attention" / "prefill.cuh").read_text(), (include / "utils.cuh").read_text()


@_needs('fa2_pinned_kv_tiles')
def test_kv_tiles_are_pinned_only_for_archs_of_one_known_shared_memory(monkeypatch):
    from fivar.jit import pinned_kv_tiles as pin
    monkeypatch.delenv(pin.ENV, raising=False)
    assert pin.pinned_smem({(9, "0a")}) == pin.pinned_smem({(9, "0")}) == (233472, 232448)
    assert pin.pinned_smem({(8, "6"), (8, "9")}) == (102400, 101376)  # two archs, the same shared memory
    assert pin.pinned_smem({(9, "0a"), (8, "0")}) is None  # a GPU of either may run it
    assert pin.pinned_smem({(12, "0")}) is None  # not in the table
    assert pin.decide({(12, "0")})[1] == "an arch whose shared memory fivar does not know"
    assert pin.decide({(9, "0a"), (8, "0")})[1] == "archs of different shared memory"
    monkeypatch.setenv(pin.ENV, "0")
    assert pin.pinned_smem({(9, "0a")}) is None and pin.decide({(9, "0a")})[1] == "FIVAR_PIN_KV_TILES=0"
    assert pin.pinned_smem({(9, "0a")}, on=True) == (233472, 232448)  # gen_module's pin_kv_tiles= wins


@pytest.mark.parametrize("env,option", [("FIVAR_PIN_KV_TILES", "pin_kv_tiles"),
                                        ("FIVAR_SKIP_UNUSED_HEADERS", "skip_unused_headers"),
                                        ("FIVAR_NVCC_PARALLEL_PASSES", "nvcc_parallel_passes")])
def test_fa2_build_switches_refuse_what_they_cannot_read(monkeypatch, env, option):
    """Unset, 1 or an on word: on; 0 or an off word ('false', 'off'): off; anything else is an error naming the
    variable, not silently on."""
    softcap = fivar.load("softcap")
    for text in ("false", "off"):
        monkeypatch.setenv(env, text)
        assert gen_module(softcap, op="single_prefill").uri == gen_module(softcap, op="single_prefill",
                                                                          **{option: False}).uri
    for text in ("2", "disabled"):
        monkeypatch.setenv(env, text)
        with pytest.raises(FivarError, match=f"{env}='{text}': expected 1/true/yes/on .on. or 0/false/no/off"):
            gen_module(softcap, op="single_prefill")
    monkeypatch.delenv(env)
    with pytest.raises(FivarError, match=f"{option}='yes': expected True or False"):
        gen_module(fivar.load("softcap"), op="single_prefill", **{option: "yes"})


@_needs('fa2_pinned_kv_tiles')
def test_kv_tile_pinning_checks_the_installed_launchers_follow_the_steps_it_repeats():
    from fivar.jit.pinned_kv_tiles import flashinfer_problem
    prefill, utils = _flashinfer_launcher_texts()
    assert flashinfer_problem(prefill, utils) is None
    assert prefill.count("DISPATCH_NUM_MMA_KV(") == 3  # single prefill, batch prefill ragged and paged
    # a launcher whose budget is computed another way: not pinned
    changed = prefill.replace("min(max_smem_per_sm / num_ctas_per_sm, max_smem_per_block_optin)",
                              "max_smem_per_sm / num_ctas_per_sm", 1)
    assert "follows neither" in flashinfer_problem(changed, utils)
    assert "8/4/2/1" in flashinfer_problem(prefill, utils.replace("NUM_MMA_KV = 8;", "NUM_MMA_KV = 16;"))


@pytest.mark.parametrize("split", [False, True])
@_needs('fa2_pinned_kv_tiles')
def test_pinned_fa2_prefill_units_carry_the_shared_memory_in_their_text(monkeypatch, split):
    from fivar.flashinfer_compat import release
    from fivar.jit import pinned_kv_tiles as pin
    monkeypatch.delenv(pin.ENV, raising=False)
    # 0.7.4's launchers take the token-head-scale steps, which the macro then repeats
    token_head_sf = {"0.7.2": "", "0.7.4": "#define FIVAR_PINNED_TOKEN_HEAD_SF 1\n"}[release()]
    for op in ("single_prefill", "batch_prefill"):
        m = gen_module(fivar.load("sliding_window"), op=op, split_cta_tiles=split)
        units = [n for n in m.sources if n.endswith(".cu")]
        kernel_units = [n for n in units if "_kernel_" in n]
        assert kernel_units and len(kernel_units) == len(units) - 1, units  # and one host unit
        for n in kernel_units:  # first (after the unused headers' guards): before the launchers that expand the macro
            assert re.match(r'(#define _CUDA_PIPELINE [^\n]*\n)?(#include "fivar_thread_block.cuh" [^\n]*\n)?'
                            r'// fivar: KV tiles pinned to 233472 bytes[^\n]*\n'
                            r'(#define [^\n]*\n){2}' + token_head_sf + r'#include "fivar_pinned_kv_tiles.cuh"\n',
                            m.sources[n]), n
        assert not any("// fivar: KV tiles" in m.sources[n] for n in set(units) - set(kernel_units))
        assert pin.HEADER in m.sources and m.options["pin_kv_tiles"]
        monkeypatch.setenv(pin.ENV, "0")
        off = gen_module(fivar.load("sliding_window"), op=op, split_cta_tiles=split)
        monkeypatch.delenv(pin.ENV)
        assert off.uri != m.uri and pin.HEADER not in off.sources and not off.options["pin_kv_tiles"]
    decode = gen_module(fivar.load("sliding_window"), op="batch_decode")  # FlashInfer's decode picks no NUM_MMA_KV
    assert pin.HEADER not in decode.sources


@requires_nvcc
@pytest.mark.nvcc
@requires_cuobjdump
def test_pinned_kv_tiles_compile_the_one_kernel_per_cta_tile_flashinfer_picks_on_sm90(monkeypatch):
    """FlashInfer 0.7.2's launcher on a 228 KB (sm_90) GPU, 16-bit hd128, two CTAs per SM (114 KB each):
    CTA_TILE_Q=128: (114 KB - 32 KB of Q) / 8 KB per NUM_MMA_KV = 10, capped at 8 / NUM_MMA_Q(2) = 4 -> 4;
    64: (114 - 16) / 8 = 12, cap 8 -> 8; 16 (4 KV warps): (114 - 4) / 32 = 3 -> the 2 case.
    The pinned module compiles exactly those, the same SASS as in FlashInfer's run-time dispatch."""
    from fivar.jit import pinned_kv_tiles as pin
    v = fivar.load("document_mask")
    monkeypatch.delenv(pin.ENV, raising=False)
    pinned = gen_module(v, op="single_prefill", dtype="fp16", head_dim=128, split_cta_tiles=False)
    monkeypatch.setenv(pin.ENV, "0")
    whole = gen_module(v, op="single_prefill", dtype="fp16", head_dim=128, split_cta_tiles=False)
    build_many([pinned, whole])
    expected = {128: 4, 64: 8, 16: 2}
    for unit, kernels in _kernels_per_unit(pinned).items():
        prefill = [k for k in kernels if "PrefillWith" in k]
        if "_kernel_" not in unit:
            assert not kernels, unit
            continue
        tiles = {}
        for k in prefill:  # KernelTraits<MASK_MODE, CTA_TILE_Q, NUM_MMA_Q, NUM_MMA_KV, ...>
            _, cta, _, num_mma_kv = map(int, re.search(r"KernelTraitsILNS_8MaskModeE(\d)ELj(\d+)ELj(\d+)ELj(\d+)E",
                                                        k).groups())
            tiles.setdefault(cta, []).append(num_mma_kv)
        assert tiles == {cta: [n] for cta, n in expected.items()}, (unit, tiles)
    pinned_sass, whole_sass = _sass(pinned.library_path), _sass(whole.library_path)
    assert len(whole_sass) > len(pinned_sass) >= 2 * 3
    assert all(whole_sass[k] == code for k, code in pinned_sass.items())


# --- headers FlashInfer includes but hardly uses, left out of FA2 units (fivar/jit/unused_headers.py) ---

def test_unused_headers_are_skipped_only_while_no_reachable_flashinfer_file_may_need_them(monkeypatch):
    from fivar.jit import unused_headers as uh
    monkeypatch.delenv(uh.ENV, raising=False)
    for op, left_out in [("single_prefill", ["cuda/pipeline", "cooperative_groups.h"]),
                         ("batch_prefill", ["cuda/pipeline", "cooperative_groups.h"]),
                         ("batch_decode", ["cuda/pipeline"])]:  # decode also uses cg::this_grid()
        m = gen_module(fivar.load("softcap"), op=op)
        assert m.options["skip_unused_headers"] == left_out, op
        prefix = "".join(uh.BY_NAME[n].prefix() for n in left_out)
        assert all(m.sources[n].startswith(prefix) for n in m.sources if n.endswith(".cu")), op
        assert ("fivar_thread_block.cuh" in m.sources) == ("cooperative_groups.h" in left_out)
    fa3 = gen_module(fivar.load("softcap"), op="single_prefill", target="fa3")
    assert not any("fivar/jit/unused_headers.py" in t for t in fa3.sources.values())
    only = gen_module(fivar.load("softcap"), op="single_prefill", skip_unused_headers=["cuda/pipeline"])
    assert only.options["skip_unused_headers"] == ["cuda/pipeline"] and "fivar_thread_block.cuh" not in only.sources
    with pytest.raises(FivarError, match="cannot leave out cuda/barrier"):
        gen_module(fivar.load("softcap"), op="single_prefill", skip_unused_headers=["cuda/barrier"])
    monkeypatch.setenv(uh.ENV, "0")
    kept = gen_module(fivar.load("softcap"), op="single_prefill")
    assert kept.options["skip_unused_headers"] == []
    assert not any("fivar/jit/unused_headers.py" in t for t in kept.sources.values())


def _flashinfer_tree(tmp_path, a_cuh: str):
    inc, csrc = tmp_path / "include", tmp_path / "csrc"
    (inc / "flashinfer").mkdir(parents=True, exist_ok=True)
    csrc.mkdir(exist_ok=True)
    (inc / "flashinfer" / "a.cuh").write_text('#include "b.cuh"\n' + a_cuh)
    return inc, csrc


def test_cuda_pipeline_stays_when_a_reachable_file_uses_a_libcu_name_it_may_bring(tmp_path):
    from fivar.jit import unused_headers as uh
    pipeline = uh.BY_NAME["cuda/pipeline"]
    inc, csrc = _flashinfer_tree(tmp_path, '// cuda::pipeline in a comment\nconst char* s = "cuda::barrier";\n'
                                           "cuda::std::numeric_limits<float> x; cuda::fast_mod_div<int> d;\n")
    (inc / "flashinfer" / "b.cuh").write_text("#include <cuda/pipeline>\n/* cuda::barrier */\n")
    src = ["#include <flashinfer/a.cuh>"]
    assert [p.name for p in uh.reachable(src, inc, csrc)] == ["a.cuh", "b.cuh"]
    assert uh.problem(pipeline, src, inc, csrc) is None
    (inc / "flashinfer" / "b.cuh").write_text("#include <cuda/pipeline>\nauto p = cuda::make_pipeline();\n")
    assert "b.cuh uses cuda::make_pipeline" in uh.problem(pipeline, src, inc, csrc)


@pytest.mark.parametrize("use,why", [
    ("auto block = cg::this_thread_block(); block.sync(); block . sync ( );", None),
    ('auto block = cg::this_thread_block(); block.sync(); print("block"); // block.thread_rank()', None),
    ("auto block = cg::this_thread_block(); block.sync(); char q = '\"'; int r = block.thread_rank(); // \"",
     "for more than block.sync()"),  # a '"' opens no string literal that would hide the rest of the line
    ("auto block = cg::this_thread_block(); block.sync(); int my_block = 0; x_block.sync();", None),
    ("auto grid = cg::this_grid(); grid.sync();", "uses cooperative_groups::this_grid"),
    ("auto block = cg::this_thread_block(); int r = block.thread_rank();", "for more than block.sync()"),
    ("auto block = cg::this_thread_block(); reduce(block);", "for more than block.sync()"),
    ("f(cg::this_thread_block());", "other than as `auto block"),
    ("auto t = cg::tiled_partition<32>(cg::this_thread_block());", "uses cooperative_groups::tiled_partition"),
    ("using namespace cg; auto b = this_thread_block();", "has `using namespace`"),
    ("cuda::atomic<int> a;", "uses cuda::atomic, which <cooperative_groups.h> may provide"),
])
def test_cooperative_groups_stay_unless_only_a_thread_block_is_synced(tmp_path, use, why):
    """fivar_thread_block.cuh has this_thread_block() and sync() only: any other use keeps the CUDA header."""
    from fivar.jit import unused_headers as uh
    inc, csrc = _flashinfer_tree(tmp_path, "")
    (inc / "flashinfer" / "b.cuh").write_text(
        "#include <cooperative_groups.h>\nnamespace cg = cooperative_groups;\n"
        f"__device__ void kernel() {{ {use} }}\n")
    found = uh.problem(uh.BY_NAME["cooperative_groups.h"], ["#include <flashinfer/a.cuh>"], inc, csrc)
    assert (found is None) if why is None else (why in found), found


def test_a_header_is_left_out_only_where_the_compiler_copy_has_the_guard_fivar_defines(tmp_path):
    from fivar.jit import unused_headers as uh
    cg = uh.BY_NAME["cooperative_groups.h"]
    first, toolkit = tmp_path / "extra", tmp_path / "cuda" / "include"
    first.mkdir()
    toolkit.mkdir(parents=True)
    assert "is not under" in uh.guard_problem(cg, [first, toolkit])
    (toolkit / "cooperative_groups.h").write_text("#ifndef _COOPERATIVE_GROUPS_H_\n#define _COOPERATIVE_GROUPS_H_\n#endif\n")
    assert uh.guard_problem(cg, [first, toolkit]) is None
    (first / "cooperative_groups.h").write_text("#pragma once\n")  # found first: that is the one nvcc reads
    assert "has no include guard _COOPERATIVE_GROUPS_H_" in uh.guard_problem(cg, [first, toolkit])
    assert uh.guard_problem(cg, uh._search_path()) is None  # this machine's toolkit
    assert uh.guard_problem(uh.BY_NAME["cuda/pipeline"], uh._search_path()) is None  # FlashInfer's CCCL


@requires_nvcc
@pytest.mark.nvcc
@requires_cuobjdump
def test_fa2_units_without_the_unused_headers_compile_to_the_same_sass(monkeypatch):
    """<cuda/pipeline> left out and <cooperative_groups.h> replaced by fivar_thread_block.cuh: the same kernels."""
    from fivar.jit import unused_headers as uh
    monkeypatch.delenv(uh.ENV, raising=False)
    skipped, _ = _assert_same_sass("document_mask", {}, {"skip_unused_headers": False}, dtype="fp16", head_dim=128,
                                   split_cta_tiles=False)
    assert skipped.options["skip_unused_headers"] == ["cuda/pipeline", "cooperative_groups.h"]


def _fake_tool(path, text: str, code: int):
    """An executable that prints `text` on stderr and exits with `code` (a launcher or compiler that fails)."""
    path.write_text(f"#!/bin/sh\ncat >&2 <<'END'\n{text}\nEND\nexit {code}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("case", ["false_launcher", "sccache_unreachable", "real_sccache_unreachable", "nvcc_killed",
                                  "flashinfer_refuses", "fivar_sources"])
def test_a_failed_build_names_whose_failure_it_is(tmp_path, monkeypatch, case):
    """A failed build was always "a fivar bug"; now a launcher, the compile backend and FlashInfer are named as the
    cause, and only a compiler diagnostic on fivar's sources (or fivar raising) is called a fivar bug. Real ninja
    runs the generated build.ninja, with fake launchers and compilers that fail at once."""
    import uuid
    for var in ("FLASHINFER_NVCC_LAUNCHER", "FLASHINFER_CXX_LAUNCHER", "FLASHINFER_NVCC", "FLASHINFER_DISABLE_JIT"):
        monkeypatch.delenv(var, raising=False)
    m = gen_module(fivar.load("softcap"), op="single_prefill", dtype="fp16", head_dim=64)
    m.uri += f"_{case}_{uuid.uuid4().hex[:8]}"  # never built: ninja really runs
    src = m.gen_dir / "single_prefill_config.inc"
    expect = {
        "false_launcher": ("the compiler launcher /bin/false", "/bin/false", None),
        "sccache_unreachable": ("the compiler launcher", "sccache: error: Server startup failed: cache storage failed "
                                "to read: Unexpected (temporary) at read, context: { url: redis://10.255.0.1:6379 } "
                                "=> connection refused", 2),
        "real_sccache_unreachable": ("the compiler launcher", shutil.which("sccache"), None),
        "nvcc_killed": ("in the compile backend", "nvcc error   : 'cicc' died due to signal 9 (Kill signal)", 9),
        "flashinfer_refuses": ("in FlashInfer", None, None),
        "fivar_sources": ("fivar bug", f"{src}(3): error: identifier \"oops\" is undefined", 1),
    }[case]
    says, tool, code = expect
    if case == "false_launcher":
        monkeypatch.setenv("FLASHINFER_NVCC_LAUNCHER", tool)
        monkeypatch.setenv("FLASHINFER_CXX_LAUNCHER", tool)
    elif case == "sccache_unreachable":
        launcher = _fake_tool(tmp_path / "sccache", tool, code)
        monkeypatch.setenv("FLASHINFER_NVCC_LAUNCHER", launcher)
        monkeypatch.setenv("FLASHINFER_CXX_LAUNCHER", launcher)
    elif case == "real_sccache_unreachable":  # an S3 backend nothing listens for: its server cannot start
        if not tool:
            pytest.skip("sccache is not installed")
        import random
        for var, value in (("SCCACHE_SERVER_PORT", str(random.randint(20000, 60000))), ("SCCACHE_BUCKET", "nowhere"),
                           ("SCCACHE_ENDPOINT", "http://127.0.0.1:1"), ("SCCACHE_REGION", "us-east-1"),
                           ("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "y")):
            monkeypatch.setenv(var, value)
        monkeypatch.setenv("FLASHINFER_NVCC_LAUNCHER", tool)
        monkeypatch.setenv("FLASHINFER_CXX_LAUNCHER", tool)
    elif case == "flashinfer_refuses":
        monkeypatch.setenv("FLASHINFER_DISABLE_JIT", "1")
    else:
        monkeypatch.setenv("FLASHINFER_NVCC", _fake_tool(tmp_path / "nvcc", tool, code))
    with pytest.raises(FivarError) as info:
        m.build()
    msg = str(info.value)
    assert "\n" not in msg and "variant 'softcap'" in msg and says in msg, msg
    assert ("fivar bug" in msg) == (case == "fivar_sources") and isinstance(info.value, FivarBuildError) == (
        case == "fivar_sources"), msg
    log = re.search(r"log(?: at|:) (\S+\.log)", msg).group(1)
    assert os.path.exists(log) and not m.library_path.exists()


def test_ninja_missing_is_named_not_called_a_cache_write_error(tmp_path, monkeypatch):
    m = gen_module(fivar.load("softcap"), op="single_prefill", dtype="fp16", head_dim=64)
    m.uri += "_no_ninja"

    class NoNinja:
        lock_path = str(tmp_path / "lock")

        def build(self):  # what subprocess.run(["ninja", ...]) raises when ninja is not on PATH
            raise FileNotFoundError(2, "No such file or directory", "ninja")
    m.spec = NoNinja()
    monkeypatch.setattr(type(m), "_prepare", lambda self, missing=None: None)
    with pytest.raises(FivarError, match=r"needs ninja, which was not found on PATH") as info:
        m.build()
    assert "cache" not in str(info.value) and "fivar bug" not in str(info.value)


@pytest.mark.parametrize("var,field,default", [
    ("FIVAR_SPLIT_CTA_TILES", "split_cta_tiles", False), ("FIVAR_PIN_KV_TILES", "pin_kv_tiles", True),
    ("FIVAR_SKIP_UNUSED_HEADERS", "skip_unused_headers", True),
    ("FIVAR_NVCC_PARALLEL_PASSES", "nvcc_parallel_passes", True), ("FIVAR_NVCC_SPLIT_COMPILE", "nvcc_split_compile", True),
])
def test_boolean_env_knobs_take_the_common_spellings_and_refuse_the_rest(monkeypatch, var, field, default):
    """FIVAR_SPLIT_CTA_TILES=yes was silently off (only "1" turned it on) and FIVAR_TRITON_TMA=off silently on; the
    usual on and off words (any case) now mean on and off, and anything else is one line naming the variable."""
    import random

    from fivar import config
    monkeypatch.delenv(var, raising=False)
    assert getattr(config.fa2_build_config(), field) is default
    on_words = [w for w in ("yes", "true", "on", "1") if not (field == "nvcc_split_compile" and w == "1")]
    off_words = [w for w in ("no", "false", "off", "0") if not (field == "nvcc_split_compile" and w == "0")]
    for words, want in ((on_words, True), (off_words, False)):
        for w in words:
            monkeypatch.setenv(var, random.choice((w, w.upper(), w.capitalize())))
            assert getattr(config.fa2_build_config(), field) is want, (var, w)
    for bad in ("maybe", "enable", "2x"):
        monkeypatch.setenv(var, bad)
        with pytest.raises(FivarError, match=f"{var}='{bad}': expected") as info:
            config.fa2_build_config()
        assert "\n" not in str(info.value)


def test_triton_and_wave_split_knobs_read_off_words_as_off(monkeypatch):
    from fivar import config
    from fivar.runtime import wave_split
    for var, field in (("FIVAR_TRITON_TMA", "tma"), ("FIVAR_TRITON_AUTOTUNE", "autotune"),
                       ("FIVAR_TRITON_GLUON", "gluon")):
        for word, want in (("off", False), ("No", False), ("yes", True), ("", True)):
            monkeypatch.setenv(var, word)
            assert getattr(config.triton_config(), field) is want, (var, word)
        monkeypatch.setenv(var, "nope")
        with pytest.raises(FivarError, match=f"{var}='nope': expected"):
            config.triton_config()
        monkeypatch.delenv(var)
    for word, want in (("off", False), ("true", True), ("2x2", (2, 2))):
        monkeypatch.setenv("FIVAR_FA3_WAVE_SPLIT", word)
        assert wave_split._setting("softcap") == want
