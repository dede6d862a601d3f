"""FA3 single prefill's schedule (fivar.codegen.fa3.schedules, csrc/fivar_fa3_persistent.cuh): which kernel runs
FlashInfer's grid launch and which fivar's persistent launcher, what a module records, what is refused, and the
fallback when the installed FlashInfer's launcher is not the one fivar mirrors. The persistent kernels' results are
checked on the GPU (tests/test_gpu_kernels.py::test_fa3_persistent_schedule); the causal unit of the soft-capped
window compiles in test_build.py::test_fa3_module_compiles_for_sm90a."""
import pytest

import fivar
from fivar.codegen import fa3
from fivar.flashinfer_compat import fa3_launchers
from fivar.jit.build import gen_module, module_for

KERNELS = ("single_prefill_sm90_kernel_mask_0.cu", "single_prefill_sm90_kernel_mask_1.cu")
LAUNCHER = "fivar::single_prefill_persistent<"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for env in (fa3.SCHEDULE_ENV, fa3.CTA_TILE_ENV):
        monkeypatch.delenv(env, raising=False)


def _tile_of(source: str) -> tuple[int, int]:
    return tuple(int(source.split(f"/*{n}=*/")[1].split(",")[0]) for n in ("CTA_Q_", "CTA_KV_"))


def _persistent_kernels(m) -> list[bool]:
    return [LAUNCHER in m.sources[k] for k in KERNELS]


@pytest.mark.parametrize("name", ["softcap_sliding_window", "sliding_window"])
def test_window_variants_run_their_causal_kernel_persistent_at_hd128(name):
    m = gen_module(fivar.load(name), "single_prefill", "fa3")
    assert m.options["schedule"] == "grid,persistent" and _persistent_kernels(m) == [False, True]
    assert any("fivar_fa3_persistent.cuh" in text for text in m.sources.values())
    # the launcher takes FlashInfer's sliding-window kernel, with the tile the module records
    assert "LEFT_SLIDING_WINDOW=*/true" in m.sources[KERNELS[1]]
    assert m.options["cta_tile"] == fa3.default_cta_tile(m.variant, "single_prefill", 128)


@pytest.mark.parametrize("name,op,head_dim", [
    ("softcap", "single_prefill", 128), ("alibi", "single_prefill", 128),  # no window: tile costs differ
    ("sliding_window", "single_prefill", 64), ("softcap_sliding_window", "single_prefill", 256),  # not measured
    ("sliding_window", "batch_prefill", 128),  # FlashInfer's planned schedule
])
def test_everything_else_stays_on_flashinfers_grid(name, op, head_dim):
    m = gen_module(fivar.load(name), op, "fa3", head_dim=head_dim)
    assert m.options["schedule"] == "grid"
    assert not any(LAUNCHER in text or "fivar_fa3_persistent.cuh" in text for text in m.sources.values())


def test_a_schedule_is_chosen_per_mask_mode_by_argument_or_environment(monkeypatch):
    softcap = fivar.load("softcap")
    grid = gen_module(softcap, "single_prefill", "fa3")
    both = gen_module(softcap, "single_prefill", "fa3", schedule="persistent")
    assert both.options["schedule"] == "persistent" and _persistent_kernels(both) == [True, True]
    assert both.uri != grid.uri and both.options["cta_tile"] == grid.options["cta_tile"] == fa3.MUFU_BOUND_TILE
    assert _persistent_kernels(gen_module(softcap, "single_prefill", "fa3", schedule="persistent,grid")) == [True, False]
    # FlashInfer's tiles on fivar's launcher: rendered explicitly, recorded as FlashInfer's
    stock_tiles = gen_module(softcap, "single_prefill", "fa3", schedule="persistent", cta_tile="flashinfer")
    assert stock_tiles.options["cta_tile"] == "flashinfer" and _persistent_kernels(stock_tiles) == [True, True]
    assert tuple(_tile_of(stock_tiles.sources[k]) for k in KERNELS) == fa3.FLASHINFER_SINGLE_PREFILL_TILES[128]
    with fa3.schedule("persistent"):
        assert module_for(softcap, "single_prefill", "fa3", "bf16", 128).uri == both.uri
        # a module re-rendered from its manifest passes its recorded schedule, whatever the environment says
        assert gen_module(softcap, "single_prefill", "fa3", schedule="grid").uri == grid.uri
        assert gen_module(softcap, "batch_prefill", "fa3").options["schedule"] == "grid"  # single prefill's only
    assert module_for(softcap, "single_prefill", "fa3", "bf16", 128).uri == grid.uri
    window = fivar.load("sliding_window")
    monkeypatch.setenv(fa3.SCHEDULE_ENV, "grid")
    assert _persistent_kernels(gen_module(window, "single_prefill", "fa3")) == [False, False]


@pytest.mark.parametrize("text", ["round-robin", "grid,persistent,grid", "Persistent", "grid;persistent"])
def test_a_bad_schedule_names_the_variant_and_the_setting(text, monkeypatch):
    softcap = fivar.load("softcap")
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': schedule='{text}': expected grid or persistent"):
        gen_module(softcap, "single_prefill", "fa3", schedule=text)
    monkeypatch.setenv(fa3.SCHEDULE_ENV, text)
    with pytest.raises(fivar.FivarError, match=f"variant 'softcap': {fa3.SCHEDULE_ENV}='{text}': expected"):
        gen_module(softcap, "single_prefill", "fa3")
    # the variable is single prefill's, like FIVAR_FA3_CTA_TILE: batch prefill builds as if it were unset
    assert gen_module(softcap, "batch_prefill", "fa3").options["schedule"] == "grid"


def test_only_fa3_single_prefill_takes_a_schedule():
    softcap = fivar.load("softcap")
    with pytest.raises(fivar.FivarError, match="variant 'softcap': schedule='persistent': only FA3 single prefill"):
        gen_module(softcap, "batch_prefill", "fa3", schedule="persistent")
    with pytest.raises(fivar.FivarError, match="variant 'softcap': schedule='persistent': only FA3 single prefill"):
        gen_module(softcap, "single_prefill", "fa2", schedule="persistent")
    assert gen_module(softcap, "batch_prefill", "fa3", schedule="grid").options["schedule"] == "grid"


def test_a_changed_flashinfer_launcher_falls_back_to_the_grid_or_refuses_an_explicit_schedule(monkeypatch):
    """fivar's launcher mirrors FlashInfer 0.7.2's: if the installed one differs, the default is the grid (always
    right) and an explicit persistent schedule is refused with the reason, never built against other arguments."""
    window = fivar.load("softcap_sliding_window")
    monkeypatch.setattr(fa3_launchers, "LAUNCHER_SHA256", "0" * 64)
    fa3_launchers.launcher_problem.cache_clear()
    try:
        m = gen_module(window, "single_prefill", "fa3")
        assert m.options["schedule"] == "grid" and _persistent_kernels(m) == [False, False]
        with pytest.raises(fivar.FivarError, match="variant 'softcap_sliding_window': schedule='persistent': "
                                                   "FlashInfer's SinglePrefillWithKVCacheKernelTraitsDispatched .* "
                                                   "changed since fivar's persistent schedule .*; "
                                                   "the persistent schedule is built on it, so only 'grid' can be$"):
            gen_module(window, "single_prefill", "fa3", schedule="persistent")
    finally:
        monkeypatch.undo()
        fa3_launchers.launcher_problem.cache_clear()
    assert fa3.flashinfer_launcher_problem() is None  # the installed FlashInfer is the one mirrored
