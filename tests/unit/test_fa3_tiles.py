"""FA3 single prefill at a CTA tile of the user's choice (fivar.codegen.fa3.cta_tiles,
templates/fa3/cta_tile_*.jinja): what is rendered, what is refused, what a module records, and that the
explicit specialization compiles and links in place of FlashInfer's instantiation."""
import os
from pathlib import Path

import pytest

import fivar
from fivar.codegen import fa3
from fivar.flashinfer_compat import fa3_launchers
from fivar.jit.build import gen_module, module_for

KERNELS = ("single_prefill_sm90_kernel_mask_0.cu", "single_prefill_sm90_kernel_mask_1.cu")


@pytest.fixture(autouse=True)
def _no_tile_env(monkeypatch):
    monkeypatch.delenv(fa3.CTA_TILE_ENV, raising=False)


def _tiles_of(source: str) -> list[tuple[int, int]]:
    """Every tile a kernel unit instantiates, in the order it prefers them."""
    qs = [int(part.split(",")[0]) for part in source.split("/*CTA_Q_=*/")[1:]]
    kvs = [int(part.split(",")[0]) for part in source.split("/*CTA_KV_=*/")[1:]]
    return list(zip(qs, kvs))


def _tile_of(source: str) -> tuple[int, int]:
    (tile,) = _tiles_of(source)
    return tile


def _mode_units(m, code: int) -> list[str]:
    """A mask mode's kernel units: its dispatch unit, then one per tile compiled on its own (fa3.tile_units)."""
    stem = f"single_prefill_sm90_kernel_mask_{code}"
    return [stem + ".cu"] + sorted(n for n in m.sources if n.startswith(stem + "_tile"))


def _mode_tiles(m, code: int) -> list[tuple[int, int]]:
    """Every tile a mask mode's units instantiate, in the order its dispatch prefers them."""
    return [t for n in _mode_units(m, code) for t in _tiles_of(m.sources[n])]


def test_a_tile_replaces_flashinfers_instantiation_per_mask_mode():
    softcap = fivar.load("softcap")
    stock = gen_module(softcap, "single_prefill", "fa3", cta_tile="flashinfer")
    assert stock.options["cta_tile"] == "flashinfer"
    assert all("template cudaError_t SinglePrefillWithKVCacheDispatched" in stock.sources[k] for k in KERNELS)
    assert "fivar: this module's FA3 single prefill runs its own CTA tile" not in stock.sources[
        "single_prefill_sm90_config.inc"]
    m = gen_module(softcap, "single_prefill", "fa3", cta_tile="128x176,192x128")
    assert m.options["cta_tile"] == "128x176,192x128" and m.uri != stock.uri
    assert [_tile_of(m.sources[k]) for k in KERNELS] == [(128, 176), (192, 128)]
    assert "CAUSAL=*/false" in m.sources[KERNELS[0]] and "CAUSAL=*/true" in m.sources[KERNELS[1]]
    # every unit (the host unit includes the config too) sees the specialization before any use
    config = m.sources["single_prefill_sm90_config.inc"]
    for mode in ("MaskMode::kNone", "MaskMode::kCausal"):
        assert f"SinglePrefillWithKVCacheDispatched<128, 128, {mode}, /*USE_SLIDING_WINDOW=*/false,\n" in config
    # one tile for both modes; the window variant keeps FA3's sliding-window kernel
    both = gen_module(fivar.load("softcap_sliding_window"), "single_prefill", "fa3", cta_tile="128x64")
    assert both.options["cta_tile"] == "128x64"
    assert [_tile_of(both.sources[k]) for k in KERNELS] == [(128, 64), (128, 64)]
    assert all("LEFT_SLIDING_WINDOW=*/true" in both.sources[k] for k in KERNELS)


@pytest.mark.parametrize("name,head_dim,tile", [
    ("softcap", 128, "192x64|128x128,128x128"), ("softcap_sliding_window", 128, "192x64|128x128,192x64"),  # measured
    ("softcap", 64, "flashinfer"), ("softcap", 256, "flashinfer"),  # not measured there
    ("alibi", 128, "flashinfer"), ("sliding_window", 128, "flashinfer"), ("sigmoid", 128, "flashinfer"),
])
def test_fivars_own_tiles_are_the_default_only_where_they_were_measured_faster(name, head_dim, tile):
    v = fivar.load(name)
    m = gen_module(v, "single_prefill", "fa3", head_dim=head_dim)
    assert m.options["cta_tile"] == tile == fa3.default_cta_tile(v, "single_prefill", head_dim)
    if tile != "flashinfer":
        assert [_mode_tiles(m, code) for code in (0, 1)] == [
            [(192, 64), (128, 128)], [(192, 64)] if v.kv_band.left is not None else [(128, 128)]]
    assert gen_module(v, "batch_prefill", "fa3", head_dim=head_dim).options["cta_tile"] == "flashinfer"


def test_the_env_var_picks_the_tile_of_single_prefill_and_a_recorded_tile_ignores_it(monkeypatch):
    softcap = fivar.load("softcap")
    default = module_for(softcap, "single_prefill", "fa3", "bf16", 128)
    with fa3.cta_tile("128x160"):
        tiled = module_for(softcap, "single_prefill", "fa3", "bf16", 128)
        assert tiled.options["cta_tile"] == "128x160" and tiled.uri != default.uri
        # batch prefill keeps FlashInfer's tiles (its ragged and paged kernels dispatch differently)
        assert gen_module(softcap, "batch_prefill", "fa3").options["cta_tile"] == "flashinfer"
        # a module re-rendered from its manifest (fivar cache staleness) passes its recorded tile
        assert gen_module(softcap, "single_prefill", "fa3", cta_tile=fa3.MUFU_BOUND_TILE).uri == default.uri
    with fa3.cta_tile("flashinfer"):
        assert module_for(softcap, "single_prefill", "fa3", "bf16", 128).options["cta_tile"] == "flashinfer"
    assert module_for(softcap, "single_prefill", "fa3", "bf16", 128) is default
    assert gen_module(softcap, "single_prefill", "fa3", cta_tile="128x160").uri == tiled.uri


def test_the_causal_kernel_may_hold_a_choice_of_tiles_picked_per_launch():
    """"QxKV|QxKV": one kernel per tile in the causal unit, and a launch-time choice by waves x CTA_Q (the GPU
    test runs a shape that takes each: test_gpu_kernels.py::test_fa3_causal_window_runs_the_tile_the_wave_rule_picks).
    CTA_Q is 128 or 192, so a choice holds two tiles at most (a third would repeat a CTA_Q: refused below)."""
    softcap = fivar.load("softcap")
    m = gen_module(softcap, "single_prefill", "fa3", cta_tile="128x176,192x64|128x96")
    assert m.options["cta_tile"] == "128x176,192x64|128x96"
    assert _tiles_of(m.sources[KERNELS[0]]) == [(128, 176)]
    causal = m.sources[KERNELS[1]]
    assert _mode_tiles(m, 1) == [(192, 64), (128, 96)]
    assert "const int cta_q[] = {192, 128};" in causal
    assert "case 0:\n      SinglePrefillWithKVCacheKernelTraitsDispatched<Tile0," in causal
    assert "case 1:\n      fivar_single_prefill_mask_1_tile_1(params, stream);" in causal
    assert gen_module(softcap, "single_prefill", "fa3", cta_tile=m.options["cta_tile"]).uri == m.uri


def test_the_non_causal_kernel_may_hold_two_tiles_picked_by_the_launchs_rows():
    """"A|B,..." non-causal: A from fa3.LONG_QO_LEN query rows, B below, in the unit and in non_causal_tile (what the
    wave split plans with) alike; the GPU tests run both sides (test_gpu_kernels.py::test_fa3_cta_tile_override)."""
    softcap = fivar.load("softcap")
    m = gen_module(softcap, "single_prefill", "fa3", cta_tile="192x64|128x160,128x96")
    assert m.options["cta_tile"] == "192x64|128x160,128x96"
    unit = m.sources[KERNELS[0]]
    assert _mode_tiles(m, 0) == [(192, 64), (128, 160)] and _mode_tiles(m, 1) == [(128, 96)]
    branch = f"if (params.qo_len >= {fa3.LONG_QO_LEN}) {{\n    SinglePrefillWithKVCacheKernelTraitsDispatched<Tile0,"
    assert branch in unit and "} else {\n    fivar_single_prefill_mask_0_tile_1(params, stream);" in unit
    assert not any("CAUSAL=*/true" in m.sources[n] for n in _mode_units(m, 0))
    for qo_len, tile in ((fa3.LONG_QO_LEN, (192, 64)), (fa3.LONG_QO_LEN - 1, (128, 160)), (1, (128, 160))):
        assert fa3.non_causal_tile(m.options["cta_tile"], 128, qo_len) == tile
    assert fa3.non_causal_tile("128x176,128x128", 128, 10**6) == (128, 176)
    assert fa3.non_causal_tile("flashinfer", 128, 10**6) == fa3.FLASHINFER_SINGLE_PREFILL_TILES[128][0]
    # one choice for both modes: each mode's own rule
    both = gen_module(softcap, "single_prefill", "fa3", cta_tile="192x64|128x128")
    assert both.options["cta_tile"] == "192x64|128x128"
    assert "params.qo_len >=" in both.sources[KERNELS[0]] and "const int cta_q[] = {192, 128};" in both.sources[
        KERNELS[1]]


@pytest.mark.parametrize("name,tile,schedule", [
    ("softcap", None, None), ("softcap_sliding_window", None, None),  # the defaults: a non-causal choice
    ("softcap", "128x176,192x64|128x96", "persistent"), ("softcap", "192x64|128x128", "grid,persistent"),
])
def test_every_kernel_unit_holds_one_kernel_so_the_units_compile_side_by_side(name, tile, schedule):
    """A module's cold build on a many-core host lasts as long as its longest unit: each tile of a choice compiles in a
    unit of its own, launched from the mode's dispatch through a function the module defines once and keeps hidden
    (another module's same-named function never binds to it)."""
    m = gen_module(fivar.load(name), "single_prefill", "fa3", cta_tile=tile, schedule=schedule)
    chosen = m.options["cta_tile"].split(",")
    per_mode = [chosen[0].split("|"), chosen[-1].split("|")]
    for code, tiles in enumerate(per_mode):
        units = _mode_units(m, code)
        assert len(units) == len(tiles) and _mode_tiles(m, code) == [tuple(map(int, t.split("x"))) for t in tiles]
        persistent = m.options["schedule"].split(",")[-1 if code else 0] == "persistent"
        for n in units:
            text = m.sources[n]
            launches = text.count("SinglePrefillWithKVCacheKernelTraitsDispatched<Tile") + text.count(
                "fivar::single_prefill_persistent<Tile")
            assert launches == 1 and (("fivar::single_prefill_persistent<Tile" in text) == persistent), (n, text)
        for i in range(1, len(tiles)):
            fn = f"fivar_single_prefill_mask_{code}_tile_{i}(Params& params, cudaStream_t stream)"
            defined = [n for n in m.sources if f'__attribute__((visibility("hidden"))) cudaError_t {fn} {{' in
                       m.sources[n]]
            assert defined == [units[i]]
            assert f'__attribute__((visibility("hidden"))) cudaError_t {fn};' in m.sources[units[0]]


@pytest.mark.parametrize("cores,grouped", [(2, True), (7, True), (8, False), (64, False)])
def test_few_cores_compile_a_tile_unit_inside_its_modes_unit_under_the_same_uri(cores, grouped, monkeypatch, tmp_path):
    """On a host of fewer than SPLIT_TILE_UNITS_MIN_CORES a unit of its own would only add a front end: nvcc then runs
    one translation unit that includes the mode's unit and its tile unit, both unchanged. Nothing rendered differs, so
    the URI (and what a cache exported from any host holds) is the same."""
    from fivar.jit import toolchain
    m = gen_module(fivar.load("softcap"), "single_prefill", "fa3")
    monkeypatch.setattr(toolchain, "cpu_count", lambda: cores)
    units = [tmp_path / n for n in m.sources if n.endswith(".cu")]
    out = toolchain.compile_units(units, tmp_path / "build")
    names = sorted(p.name for p in out)
    if not grouped:
        assert out == units
        return
    assert names == ["single_prefill_sm90_jit_binding.cu", "single_prefill_sm90_kernel_mask_0.cu",
                     "single_prefill_sm90_kernel_mask_1.cu"]
    (group,) = [p for p in out if p.parent == tmp_path / "build" / "fivar_units"]
    assert group.read_text().splitlines() == [
        f'#include "{(tmp_path / n).resolve()}"' for n in ("single_prefill_sm90_kernel_mask_0.cu",
                                                            "single_prefill_sm90_kernel_mask_0_tile1.cu")]
    assert gen_module(fivar.load("softcap"), "single_prefill", "fa3").uri == m.uri
    # a module without a tile choice compiles its sources as they are
    plain = [tmp_path / n for n in gen_module(fivar.load("alibi"), "single_prefill", "fa3").sources if n.endswith(".cu")]
    assert toolchain.compile_units(plain, tmp_path / "b2") == plain


@pytest.mark.parametrize("bad,why", [
    ("128", "expected QxKV"), ("128x176,128x128,64x64", "expected QxKV"), ("128 by 176", "expected QxKV"),
    ("192x64|128x128|128x64,128x128", "a non-causal choice must name two different tiles"),
    ("128x128|128x128,128x128", "a non-causal choice must name two different tiles"), ("|128x128", "expected QxKV"),
    ("128x128,192x64|", "expected QxKV"), ("128x128,128x128|64x64", "CTA_Q is 64"),
    ("128x128,192x64|192x64", "must differ in CTA_Q"), ("128x128,128x128|128x64", "must differ in CTA_Q"),
    ("128x128|128x64", "must differ in CTA_Q.*A\\|B,C makes it non-causal only"),  # one choice, both modes
    ("96x128", "CTA_Q is 96; it must be 128 or 192"), ("64x128", "CTA_Q is 64; it must be 128 or 192"),
    ("128x100", "CTA_KV is 100; it must be a multiple of 16"), ("128x272", "CTA_KV is 272;.*from 16 to 256"),
    ("128x208", "take 240 KiB of shared memory"),  # Q, K and V at hd128
])
def test_tiles_fa3_cannot_run_are_refused_naming_variant_and_setting(bad, why, monkeypatch):
    softcap = fivar.load("softcap")
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': cta_tile=.*{why}") as info:
        gen_module(softcap, "single_prefill", "fa3", cta_tile=bad)
    if "CTA" in why:  # the rule that failed, not every rule
        assert "shared memory" not in str(info.value) and ("CTA_Q" in why) != ("CTA_KV" in str(info.value))
    monkeypatch.setenv(fa3.CTA_TILE_ENV, bad)
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': {fa3.CTA_TILE_ENV}=.*{why}"):
        gen_module(softcap, "single_prefill", "fa3")


def test_the_shared_memory_bound_depends_on_the_head_dim():
    softcap = fivar.load("softcap")
    assert gen_module(softcap, "single_prefill", "fa3", head_dim=64, cta_tile="128x256").options["cta_tile"]
    with pytest.raises(fivar.FivarError, match="tile 128x128 at head dim 256"):
        gen_module(softcap, "single_prefill", "fa3", head_dim=256, cta_tile="128x128")


def test_only_fa3_single_prefill_takes_a_tile():
    softcap = fivar.load("softcap")
    for op, target in (("single_prefill", "fa2"), ("batch_prefill", "fa3")):
        with pytest.raises(fivar.FivarError, match="only FA3 single prefill takes a CTA tile"):
            gen_module(softcap, op, target, cta_tile="128x128")


def test_a_tile_choice_on_many_cores_compiles_its_second_tile_as_a_unit_of_its_own(monkeypatch):
    """Many cores: a non-causal choice of two tiles renders its second tile as a unit of its own whose launcher is
    hidden (local to the library: two modules' launchers never clash), with kernels of the requested tiles only,
    none of FlashInfer's own. The few-cores way (the tile's unit inside its mode's) is what test_build's FA3 compile
    links here; the GPU suites build and load this way on their 16 cores."""
    from fivar.jit import toolchain
    monkeypatch.setattr(toolchain, "cpu_count", lambda: 16)
    m = gen_module(fivar.load("softcap"), "single_prefill", "fa3", cta_tile="128x176|192x128,128x128")
    units = [Path(u).name for u in toolchain.compile_units([f"/g/{n}" for n in m.sources if n.endswith(".cu")],
                                                           m.build_dir)]
    assert "single_prefill_sm90_kernel_mask_0_tile1.cu" in units and "single_prefill_sm90_kernel_mask_0.cu" in units
    tile_unit = m.sources["single_prefill_sm90_kernel_mask_0_tile1.cu"]
    assert ('__attribute__((visibility("hidden"))) cudaError_t fivar_single_prefill_mask_0_tile_1(' in tile_unit)
    kernels = "".join(m.sources[n] for n in m.sources if "kernel_mask" in n)
    assert sorted(set(_tiles_of(kernels))) == [(128, 128), (128, 176), (192, 128)]
    assert (128, 192) not in _tiles_of(kernels)  # FlashInfer's own non-causal tile is not built


def test_a_flashinfer_whose_dispatch_changed_gets_its_own_tiles(monkeypatch):
    """The specialization keeps everything of FlashInfer's SinglePrefillWithKVCacheDispatched but the tile: a
    FlashInfer that changed it builds its own tiles by default, and an explicit tile is refused, not guessed."""
    assert fa3.flashinfer_dispatch_problem() is None  # the installed FlashInfer is the one fivar mirrors
    monkeypatch.setattr(fa3_launchers, "DISPATCH_SHA256", "0" * 64)
    fa3_launchers.dispatch_problem.cache_clear()
    try:
        assert "changed since fivar's CTA-tile specialization" in fa3.flashinfer_dispatch_problem()
        softcap = fivar.load("softcap")
        assert gen_module(softcap, "single_prefill", "fa3").options["cta_tile"] == "flashinfer"
        with pytest.raises(fivar.FivarError, match="variant 'softcap': cta_tile='128x128': FlashInfer's.*; only "
                                                   "FlashInfer's own tiles \\('flashinfer'\\) can be built$"):
            gen_module(softcap, "single_prefill", "fa3", cta_tile="128x128")
        # the persistent schedule is built on the same dispatch: refused, saying so (not "use FlashInfer's tiles")
        with pytest.raises(fivar.FivarError, match="schedule='persistent': FlashInfer's.*; the persistent schedule "
                                                   "is built on it, so only 'grid' can be$"):
            gen_module(softcap, "single_prefill", "fa3", schedule="persistent", cta_tile="flashinfer")
        monkeypatch.setenv(fa3.CTA_TILE_ENV, "128x176")
        with pytest.raises(fivar.FivarError, match=f"{fa3.CTA_TILE_ENV}='128x176': FlashInfer's"):
            gen_module(softcap, "single_prefill", "fa3")
    finally:
        monkeypatch.undo()
        fa3_launchers.dispatch_problem.cache_clear()
