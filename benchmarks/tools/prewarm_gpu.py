"""Build, in one parallel ninja, the modules a device call needs: `--all` for the whole GPU test suite,
else the benchmark set."""
import time

import fivar
from fivar.jit.build import build_many, gen_module, serving_modules

BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias",
           "softcap_sliding_window"]


def wanted():
    mods = []
    for name in BUNDLED:
        v = fivar.load(name)
        mods += [gen_module(v, op=op, target="fa2") for op in ("single_prefill", "batch_prefill", "batch_decode")]
        mods += [m for op in ("single_prefill", "batch_prefill") for m in serving_modules(v, op, "fa3")]
    mods += exp2_extremes_set()
    mods += fa3_variants_at(["softcap"], cta_tiles=CTA_TILES_TESTED)  # test_fa3_cta_tile_override
    mods += bounded_softmax_set()  # test_fa3_bounded_softmax
    mods += test_variant_set()
    for name in ("softcap", "alibi", "document_mask"):
        v = fivar.load(name)
        for target in ("fa2", "fa3") if name in ("softcap", "document_mask") else ("fa2",):
            for dtype, hd in (("fp16", 64), ("fp16", 128), ("bf16", 256)):
                mods += serving_modules(v, "single_prefill", target, dtype, hd)
    return mods


def test_variant_set():
    """The variants the GPU tests define inline: the signed logits factors (FA2 and FA3 single prefill, with the
    bounded softmax's running-max twin) and the Triton twin's per-program cases (FA2, which they agree with)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from test_gpu_kernels import SIGNED_FACTORS
    from test_gpu_triton import PER_PROGRAM
    return ([m for v in SIGNED_FACTORS for t in ("fa2", "fa3") for m in serving_modules(v, "single_prefill", t)]
            + [gen_module(v, op="single_prefill", target="fa2") for v in PER_PROGRAM])


def bench_set():
    """What the benchmarks and the quick GPU tests need: FA2 and FA3 single prefill of every variant (the
    Flex benchmark, Triton agreement tests), FA3 batch prefill for the window tests. Fusion benchmarks
    build their own modules."""
    mods = []
    for name in BUNDLED:
        v = fivar.load(name)
        mods += [m for t in ("fa2", "fa3") for m in serving_modules(v, "single_prefill", t)]
    mods.append(gen_module(fivar.load("sliding_window"), op="batch_prefill", target="fa3"))
    return mods


def triton_agreement_set():
    """What tests/test_gpu_triton.py compares the Triton twins against: FA2 single/batch prefill, decode."""
    return [gen_module(fivar.load(name), op=op, target="fa2") for name in BUNDLED
            for op in ("single_prefill", "batch_prefill", "batch_decode")]


def kv_range_set():
    """FA3's KV-range form of the document mask at the tested dtypes / head dims."""
    v = fivar.load("document_mask")
    return [m for dt, hd in (("bf16", 128), ("fp16", 64), ("fp16", 128), ("bf16", 256))
            for m in serving_modules(v, "batch_prefill", "fa3", dt, hd)]


def window_set():
    """FA3's own sliding window (masks that are exactly a window), the planned-ragged tests, the window
    benchmark: FA3 single + batch prefill of the window variants and of softcap/alibi, FA2 batch prefill."""
    mods = []
    for name in ("softcap", "alibi", "sliding_window", "softcap_sliding_window"):
        v = fivar.load(name)
        mods += [gen_module(v, op="batch_prefill", target=t) for t in ("fa2", "fa3")]
        mods.append(gen_module(v, op="single_prefill", target="fa3"))
    return mods


EXP2_SPLITS = (2, 4, 6)


#: tiles test_fa3_cta_tile_override runs: one FlashInfer never instantiates at hd128 per mode
CTA_TILES_TESTED = ("128x176,192x128",)


def fa3_variants_at(names, exp2_splits=(), cta_tiles=(), running_max=False, head_dim=128, schedules=()):
    """FA3 single prefill (bf16, `head_dim`) of each variant at each exp2 split, then at each CTA tile (default split),
    then with the running-max softmax, then on each schedule: the modules a call run under
    fivar.codegen.fa3.exp2_split(k), cta_tile(t), bounded_softmax(False) or schedule(s) loads."""
    single = lambda n, **opt: gen_module(fivar.load(n), op="single_prefill", target="fa3",  # noqa: E731
                                         head_dim=head_dim, **opt)
    return ([single(n, exp2_emulated_of_8=k) for k in exp2_splits for n in names]
            + [single(n, cta_tile=t) for t in cta_tiles for n in names]
            + ([single(n, bounded_softmax=False) for n in names] if running_max else [])
            + [single(n, schedule=s) for s in schedules for n in names])


def bounded_softmax_set():
    """FA3 with the bounded softmax and without: what test_fa3_bounded_softmax runs (single prefill of both
    soft-capped variants, batch prefill ragged and paged of softcap; a cap of 50 runs the running-max modules), and
    the default modules the bounded-softmax comparison (bench_fa3.py) times it against."""
    from fivar.codegen.fa3 import bounded_softmax
    with bounded_softmax():  # serving_modules then gives each bounded module and its running-max fallback
        return [m for n, op in (("softcap", "single_prefill"), ("softcap_sliding_window", "single_prefill"),
                                ("softcap", "batch_prefill")) for m in serving_modules(fivar.load(n), op, "fa3")]


def exp2_extremes_set():
    """test_fa3_exp2_split_extremes: the soft-capped window at splits 0 and 8, bounded softmax and running max."""
    v = fivar.load("softcap_sliding_window")
    return [gen_module(v, op="single_prefill", target="fa3", exp2_emulated_of_8=k, bounded_softmax=b)
            for k in (0, 8) for b in (True, False)]


def exp2_split_set():
    """The soft-capped variants at every split bench_fa3.py --exp2-splits times,
    and the split-extremes GPU test's K=8 modules."""
    return (fa3_variants_at(["softcap", "softcap_sliding_window"], exp2_splits=EXP2_SPLITS)
            + [m for m in exp2_extremes_set() if m.options["exp2_emulated_of_8"] == 8])


def stock_fa3_spec(head_dim: int, window: bool, softcap: bool):
    """FlashInfer's own FA3 single-prefill JitSpec, bf16, with or without its sliding window and soft-cap."""
    import torch
    from flashinfer.jit.attention.modules import gen_single_prefill_module
    bf = torch.bfloat16
    return gen_single_prefill_module("fa3", bf, bf, bf, head_dim, head_dim, 0, window, softcap, False)


def stock_fa3_specs(head_dim=128, variants=BUNDLED):
    """Stock FA3 single prefill (bf16, `head_dim`) with the built-ins (soft-cap, window or both) that compute
    `variants` (fivar.bench.contenders.stock_mapping, what the benchmarks compare with): their yardsticks."""
    from fivar.bench.contenders import stock_mapping
    kwargs = [stock_mapping(fivar.load(n), {"softcap": 30.0, "window": 1024}) for n in variants]
    flags = sorted({("window_left" in kw, "logits_soft_cap" in kw) for kw, _ in filter(None, kwargs)})
    return [stock_fa3_spec(head_dim, window, softcap) for window, softcap in flags]


def build_beside_stock(modules, stock_specs) -> float:
    """fivar's modules in one parallel ninja while FlashInfer's stock specs build in another, so no compile lands
    inside a benchmark; returns the wall seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.jit.core import build_jit_specs
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        [f.result() for f in (pool.submit(build_many, modules), pool.submit(build_jit_specs, stock_specs))]
    return time.perf_counter() - t0


def wave_split_set():
    """For wave_quantization.py: soft-cap's FA3 single prefill, bf16 (the bounded module and its running-max fallback)
    and fp16 at hd128, fp16 hd64 and bf16 hd256: what test_fa3_wave_split runs and the wave benchmarks time."""
    v = fivar.load("softcap")
    return [m for dt, hd in (("bf16", 128), ("fp16", 128), ("fp16", 64), ("bf16", 256))
            for m in serving_modules(v, "single_prefill", "fa3", dt, hd)]


#: test_fa3_persistent_schedule's variants (the soft-caps on fivar's tile, the others on FlashInfer's)
PERSISTENT_TESTED = ("softcap", "softcap_sliding_window", "alibi", "sliding_window")


def persistent_set():
    """For the persistent-schedule runs: FA3 single prefill on the persistent schedule (fivar_fa3_persistent.cuh), bf16
    hd128 of PERSISTENT_TESTED and soft-cap at fp16 hd64 and bf16 hd256 (the bounded modules and their running-max
    fallbacks), beside the default modules of the variants the window tests run and the benchmark times."""
    from fivar.codegen.fa3 import schedule
    with schedule("persistent"):
        mods = [m for n in PERSISTENT_TESTED for m in serving_modules(fivar.load(n), "single_prefill", "fa3")]
        mods += [m for dt, hd in (("fp16", 64), ("bf16", 256))
                 for m in serving_modules(fivar.load("softcap"), "single_prefill", "fa3", dt, hd)]
    return mods + [m for n in ("softcap", "softcap_sliding_window", "sliding_window")
                   for m in serving_modules(fivar.load(n), "single_prefill", "fa3")]


def verify_set():
    """For the persistent-schedule check: soft-cap's FA3 single prefill on the persistent schedule (the non-causal choice's
    192x64 case of test_fa3_persistent_schedule) and on its default one (what `fivar bench softcap` times)."""
    from fivar.codegen.fa3 import schedule
    v = fivar.load("softcap")
    with schedule("persistent"):
        mods = serving_modules(v, "single_prefill", "fa3")
    return mods + serving_modules(v, "single_prefill", "fa3")


HEAD_DIMS_BENCHED = (64, 256)


def head_dim_set():
    """For the head-dim runs: soft-cap's FA3 single prefill, bounded softmax and running max, at head dims 64 and
    256 (bench_fa3.py --head-dim --running-max)."""
    v = fivar.load("softcap")  # serving_modules: the bounded module and its running-max fallback
    return [m for hd in HEAD_DIMS_BENCHED for m in serving_modules(v, "single_prefill", "fa3", head_dim=hd)]


if __name__ == "__main__":
    import sys
    mods = (wanted() if "--all" in sys.argv else triton_agreement_set() if "--triton" in sys.argv
            else test_variant_set() if "--test-variants" in sys.argv
            else kv_range_set() if "--kv-ranges" in sys.argv else window_set() if "--window" in sys.argv
            else exp2_extremes_set() if "--exp2-extremes" in sys.argv
            else exp2_split_set() if "--exp2" in sys.argv else bounded_softmax_set() if "--bounded" in sys.argv
            else head_dim_set() if "--hdims" in sys.argv else wave_split_set() if "--wave" in sys.argv
            else persistent_set() if "--persistent" in sys.argv else verify_set() if "--verify" in sys.argv
            else bench_set())
    t0 = time.perf_counter()
    res = build_many(mods)
    if "--stock" in sys.argv:  # then FlashInfer's own modules, in one ninja of their own (errors propagate)
        from flashinfer.jit.core import build_jit_specs
        head_dims, names = ((HEAD_DIMS_BENCHED, ["softcap"]) if "--hdims" in sys.argv
                            else ((128,), ["softcap"]) if "--wave" in sys.argv or "--verify" in sys.argv
                            else ((128,), ["softcap", "softcap_sliding_window", "sliding_window"])
                            if "--persistent" in sys.argv
                            else ((128,), BUNDLED))
        build_jit_specs([spec for hd in head_dims for spec in stock_fa3_specs(hd, names)])
    kinds = [k for k, _ in res]
    print(f"prewarm: {len(mods)} modules ({kinds.count('cold')} compiled, {kinds.count('disk')} cached) "
          f"in {time.perf_counter() - t0:.0f} s")
