"""Hopper: fivar's FA3 variants vs stock FlashInfer FA3, FlexAttention, and decode vs stock, in one run.

    python3 benchmarks/tools/bench_fa3.py [--json FILE] [--quick]

1. softcap on fa3 vs stock `single_prefill_with_kv_cache(..., logits_soft_cap=30, backend="fa3")`,
   bf16, hd128, 32 heads, S in {4096, 8192, 16384}, causal and not (target >= 0.97x);
2. every bundled variant on fa3 (and its Triton twin at --triton-seqlens) vs FlexAttention
   (torch.compile) running the same score_mod/mask_mod, at --flex-seqlens x --flex-causal (target >= 2.5x),
   and stock FA3 where FlashInfer has the same function built in (soft-cap, sliding window); for the document
   mask, stock FA3 batch prefill with each document as its own request (`stock_fa3_documents`, no mask: the same
   output, and what FA3 does on that work);
   TF/s count useful work only: masked-out pairs are not counted (kept fraction from the reference mask);
3. batch decode, paged (page 16), batch 128 x kv 8192, GQA 32/8: fivar softcap vs stock
   BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True) (target >= 0.95x), KV-read TB/s.
Every contender is checked against another (stock or the reference) before it is timed.

`--exp2-splits 0,3,4,6` adds, in part 2, one FA3 contender per split `fivar_fa3_exp2_K`: K of every 8 score
columns compute the softmax's exp2 on the FMA pipe (FIVAR_FA3_EXP2_EMULATION, fivar/codegen/fa3.py; 0 is
FlashInfer's own OnlineSoftmax): how EXP2_EMULATED_OF_8 was chosen. `--cta-tiles 128x176 128x160,128x96` adds one
per CTA tile `fivar_fa3_tile_QxKV[_QxKV]` (FIVAR_FA3_CTA_TILE: one tile, or non-causal then causal, or `flashinfer`:
128x192 non-causal, 128x128 causal at hd128; the soft-caps' default is fivar.codegen.fa3.MUFU_BOUND_TILE), at the
default split.
`--planned` adds `fivar_fa3_planned` for every variant (not only the KV-range form): FA3 batch prefill, ragged, one
request, planned once outside the timed call (FlashInfer's persistent tile scheduler in place of single prefill's
one CTA per tile). `--head-dim 64|256` runs every part at another head dim (default 128; part 2 builds its modules
first).
`--wave-splits 0,1x8,2x4` adds one per setting `fivar_fa3_wave_W` of FIVAR_FA3_WAVE_SPLIT (fivar/runtime/wave_split.py:
0 never splits FA3 single prefill's last wave, TxC runs the last T heads as C key chunks merged through their LSE;
fivar's default is the plan's choice); they use the default modules.
`--schedules persistent` adds `fivar_fa3_persistent`: FA3 single prefill with one CTA per SM walking the tiles
(FIVAR_FA3_SCHEDULE, csrc/fivar_fa3_persistent.cuh) in place of one CTA per tile (`grid`).
`--clock-trace` samples the SM clock, board power and clock-event reasons (nvidia-smi, fivar/bench/gpu_clocks.py)
through part 2's timing and records, per sample, its time, the contender timed before it and the clock it ran at.
`--sustained 4` times part 2's contenders each alone, back to back for 4 s after 1 s untimed
(fivar.bench.timing.time_sustained), in place of the interleaved rounds: the rate a kernel keeps under the power cap.
`--running-max` adds `fivar_fa3_running_max`: FlashInfer's running row max in place of fivar's default for bounded
transforms, whose max is the bound (FIVAR_FA3_BOUNDED_SOFTMAX=0, csrc/fivar_fa3_softmax.cuh). These, fivar's default modules and stock FA3's are built
first, in parallel.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import fivar
from fivar.bench.contenders import stock_documents, stock_mapping
from fivar.bench.timing import attention_flops, decode_kv_bytes, time_interleaved, time_sustained
from fivar.codegen.fa3 import bounded_softmax, cta_tile, exp2_split, schedule
from fivar.runtime.wave_split import wave_split
from fivar.testing import compare, example_params

H, HKV_DECODE, D = 32, 8, 128
CLOCK_TRACE = None  # a fivar.bench.gpu_clocks.ClockTrace under --clock-trace
SUSTAINED_S = 0.0  # --sustained
CONTENDERS = ("fivar_fa3", "fivar_fa3_planned", "fivar_triton", "stock_fa3", "stock_fa3_documents")
VARIANTS = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias", "softcap_sliding_window"]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def bench_softcap_vs_stock(seqlens, rounds):
    import flashinfer
    v = fivar.load("softcap")
    rows = []
    for S in seqlens:
        for causal in (False, True):
            q, k, vv = (torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
            fns = {
                "fivar_fa3": lambda: v.prefill(q, k, vv, causal=causal, softcap=30.0, backend="fa3"),
                "stock_fa3": lambda: flashinfer.single_prefill_with_kv_cache(
                    q, k, vv, causal=causal, logits_soft_cap=30.0, backend="fa3"),
                "fivar_fa2": lambda: v.prefill(q, k, vv, causal=causal, softcap=30.0, backend="fa2"),
            }
            ref = fns["stock_fa3"]()
            errs = {n: rel(fn(), ref) for n, fn in fns.items()}
            assert all(e < 1e-2 for e in errs.values()), errs
            t = time_interleaved(fns, rounds)
            fl = attention_flops(S, S, H, D, causal)
            rows.append(dict(S=S, causal=causal, rel_err_vs_stock=errs,
                             ms={n: x.median for n, x in t.items()}, spread_ms={n: x.spread for n, x in t.items()},
                             tflops={n: fl / x.median / 1e9 for n, x in t.items()},
                             ratio_vs_stock=t["stock_fa3"].median / t["fivar_fa3"].median))
            print(f"softcap S={S} causal={causal}: " + ", ".join(
                f"{n} {fl / x.median / 1e9:.0f} TF/s" for n, x in t.items()) +
                f", fivar/stock {rows[-1]['ratio_vs_stock']:.3f}", flush=True)
    return rows


def bench_variants_vs_flex(seqlens, causals, rounds, variants, triton_seqlens=(), on_row=None, options=(),
                           planned=False):
    rows = []
    for S in seqlens:
        for causal in causals:
            for name in variants:
                rows.append(_variant_vs_flex(name, S, causal, rounds, with_triton=S in triton_seqlens,
                                             options=options, planned=planned))
                if on_row:
                    on_row(rows)
    return rows


def option_contenders(exp2_splits=(), cta_tiles=(), running_max=False, wave_splits=(), schedules=()):
    """[(contender name, the context manager its calls run under)] for --exp2-splits/--cta-tiles/--running-max/
    --wave-splits/--schedules."""
    return ([(f"fivar_fa3_exp2_{k}", lambda k=k: exp2_split(k)) for k in exp2_splits]
            + [(f"fivar_fa3_tile_{t.replace(',', '_').replace('|', '_or_')}", lambda t=t: cta_tile(t)) for t in cta_tiles]
            + ([("fivar_fa3_running_max", lambda: bounded_softmax(False))] if running_max else [])
            + [(f"fivar_fa3_wave_{w}", lambda w=w: wave_split(w)) for w in wave_splits]
            + [(f"fivar_fa3_{s}", lambda s=s: schedule(s)) for s in schedules])


def _run_under(option, fn):
    def call():
        with option():
            return fn()
    return call


def build_option_modules(variants, exp2_splits, cta_tiles, running_max=False, planned=False, schedules=()):
    """The FA3 single-prefill modules of every split and tile and the default ones, in one parallel ninja, then
    (in another) stock FA3's, so no compile lands inside the benchmark."""
    from fivar.jit.build import serving_modules
    from prewarm_gpu import build_beside_stock, fa3_variants_at, stock_fa3_specs  # benchmarks/tools/: this script's dir
    mods = fa3_variants_at(variants, exp2_splits=exp2_splits, cta_tiles=cta_tiles, running_max=running_max,
                           head_dim=D, schedules=schedules)
    ops = ("single_prefill", "batch_prefill") if planned else ("single_prefill",)
    mods += [m for n in variants for op in ops for m in serving_modules(fivar.load(n), op, "fa3", head_dim=D)]
    seconds = build_beside_stock(mods, stock_fa3_specs(D, variants))
    print(f"built {len(mods)} fivar FA3 modules and stock FA3 in {seconds:.0f} s", flush=True)


def _variant_vs_flex(name, S, causal, rounds, with_triton, options=(), planned=False):
    from fivar.flex import flex_attention_fn
    v = fivar.load(name)
    q, k, vv = (torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    params = example_params(v, num_qo_heads=H, num_kv_heads=H, batch_size=1, max_len=S, device="cuda")
    if name in ("sliding_window", "softcap_sliding_window"):
        params["window"] = 1024
    fns = {"fivar_fa3": lambda: v.prefill(q, k, vv, causal=causal, backend="fa3", **params)}
    for contender, option in options:
        fns[contender] = _run_under(option, lambda: v.prefill(q, k, vv, causal=causal, backend="fa3", **params))
    stock = stock_mapping(v, params)
    if stock is not None:  # FlashInfer's built-in FA3 computing the same function (soft-cap, window)
        import flashinfer
        fns["stock_fa3"] = lambda: flashinfer.single_prefill_with_kv_cache(q, k, vv, causal=causal, backend="fa3",
                                                                           **stock[0])
    if v.scans_mask or planned:  # planned once (like Flex's block mask, built outside the timed call)
        indptr = torch.tensor([0, S], dtype=torch.int32, device="cuda")
        plan = v.plan_ragged(indptr, indptr, num_qo_heads=H, num_kv_heads=H, head_dim=D, causal=causal,
                             backend="fa3", **params)
        fns["fivar_fa3_planned"] = lambda: plan.run(q, k, vv)
    if name == "document_mask":
        fns["stock_fa3_documents"] = stock_documents(q, k, vv, params["doc_ids"][0], causal, backend="fa3")
    if with_triton:
        fns["fivar_triton"] = lambda: v.prefill(q, k, vv, causal=causal, backend="triton", **params)
    # correctness: against the reference on a slice of queries (the full reference would not fit)
    qs = q[-256:]
    ref = v.reference(qs, k, vv, causal=causal, **params)
    row = dict(variant=name, S=S, causal=causal, head_dim=D, checks={})
    for n in list(fns):
        check = compare(name, f"{n} vs reference (last 256 rows)", fns[n]()[-256:], ref, torch.bfloat16)
        row["checks"][n] = str(check)
        if not check.passed:
            row.setdefault("errors", {})[n] = "failed correctness; not timed"
            del fns[n]
    if "fivar_fa3" not in fns:
        print(row, flush=True)
        return row
    if v.softmax:
        try:
            flex = flex_attention_fn(v, params, q, k, vv, causal=causal)
            e = rel(flex(), fns["fivar_fa3"]())
            assert e < 2e-2, f"flex disagrees: {e}"
            fns["flex"] = flex
        except Exception as ex:  # report, do not hide
            row["flex_error"] = f"{type(ex).__name__}: {ex}"[:300]
    samples = {}

    def on_sample(n, previous, t0, t1, ms):
        samples.setdefault(n, []).append(dict(ms=ms, after=previous, **CLOCK_TRACE.during(t0, t1)))

    hook = on_sample if CLOCK_TRACE is not None else None
    t = (time_sustained(fns, SUSTAINED_S, on_sample=hook) if SUSTAINED_S else
         time_interleaved(fns, rounds, on_sample=hook))
    row["timing"] = f"sustained {SUSTAINED_S:g} s each" if SUSTAINED_S else f"interleaved, {rounds} rounds"
    if samples:
        row["samples"] = samples
        print("  clocks: " + ", ".join(
            f"{n} {statistics.median(x['mhz'] for x in xs if x['n']):.0f} MHz "
            f"{statistics.median(x['watts'] for x in xs if x['n']):.0f} W" for n, xs in samples.items()
            if any(x["n"] for x in xs)) + (f" ({CLOCK_TRACE.error})" if CLOCK_TRACE.error else ""), flush=True)
    # masked-out work is not useful work: count the kept pairs from the reference mask
    fl = attention_flops(S, S, H, D, causal)
    if v.mask is not None:
        fl *= _kept_fraction(v, params, S, causal)
    row.update(ms={n: x.median for n, x in t.items()}, spread_ms={n: x.spread for n, x in t.items()},
               tflops={n: fl / x.median / 1e9 for n, x in t.items()})
    if "fivar_triton" in t:
        from fivar.jit.triton_module import load_triton_module
        best = getattr(load_triton_module(v).prefill_kernel, "best_config", None)
        row["triton_config"] = str(best)
    for n in (*CONTENDERS, *(c for c, _ in options)):
        if "flex" in t and n in t:
            row[f"{n}_vs_flex"] = t["flex"].median / t[n].median
        if "stock_fa3" in t and n in t and n not in CONTENDERS:
            row[f"{n}_vs_stock_fa3"] = t["stock_fa3"].median / t[n].median
    if "stock_fa3" in t:
        row["fivar_fa3_vs_stock_fa3"] = t["stock_fa3"].median / t["fivar_fa3"].median
    if "stock_fa3_documents" in t and "fivar_fa3_planned" in t:
        ratio = t["stock_fa3_documents"].median / t["fivar_fa3_planned"].median
        row["fivar_fa3_planned_vs_stock_fa3_documents"] = ratio
    print(f"{name} S={S} causal={causal}: " + ", ".join(f"{n} {row['tflops'][n]:.0f} TF/s" for n in t) +
          "".join(f", {n}/flex {row[f'{n}_vs_flex']:.2f}x" for n in t if f"{n}_vs_flex" in row) +
          (f", fivar_fa3/stock_fa3 {row['fivar_fa3_vs_stock_fa3']:.3f}" if "stock_fa3" in t else "") +
          (f", fivar_fa3_planned/stock_fa3_documents {row['fivar_fa3_planned_vs_stock_fa3_documents']:.3f}"
           if "fivar_fa3_planned_vs_stock_fa3_documents" in row else ""), flush=True)
    return row


def _kept_fraction(v, params, S, causal):
    from fivar.codegen.torch_ref import TorchEvaluator
    from fivar.runtime.params import bind_params
    b = bind_params(v, params, num_qo_heads=H, num_kv_heads=H, batch_size=1, device="cuda")
    n = 1024  # sample rows
    rows = torch.linspace(0, S - 1, n, device="cuda").long().view(1, n, 1)
    kv = torch.arange(S, device="cuda").view(1, 1, S)
    env = {"batch": torch.tensor(0, device="cuda"), "qo_head": torch.arange(H, device="cuda").view(H, 1, 1),
           "kv_head": torch.arange(H, device="cuda").view(H, 1, 1), "q_idx": rows, "kv_idx": kv}
    keep = TorchEvaluator(env, {**b.scalars, **b.tensors}, torch.float32, "cuda").run(v.ir.mask)
    keep = keep.expand(H, n, S)
    if causal:
        keep = keep & (kv <= rows)
        return float(keep.float().mean()) / 0.5
    return float(keep.float().mean())


def bench_decode(rounds, batch=128, kv_len=8192, page=16):
    import flashinfer
    v = fivar.load("softcap")
    q = torch.randn(batch, H, D, dtype=torch.bfloat16, device="cuda")
    pages = kv_len // page
    total = batch * pages
    k_cache = torch.randn(total, page, HKV_DECODE, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    indptr = torch.arange(0, total + 1, pages, dtype=torch.int32, device="cuda")
    indices = torch.randperm(total, device="cuda").to(torch.int32)
    last = torch.full((batch,), page, dtype=torch.int32, device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    stock = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    stock.plan(indptr, indices, last, H, HKV_DECODE, D, page, logits_soft_cap=30.0, q_data_type=torch.bfloat16,
               kv_data_type=torch.bfloat16)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    planned = v.plan_decode(indptr, indices, last, num_qo_heads=H, num_kv_heads=HKV_DECODE, head_dim=D,
                            page_size=page, dtype=torch.bfloat16, backend="fa2", softcap=30.0)
    fns = {
        "stock_tc_decode": lambda: stock.run(q, (k_cache, v_cache)),
        "fivar_planned_decode": lambda: planned.run(q, (k_cache, v_cache)),
        "fivar_decode": lambda: v.decode(q, (k_cache, v_cache), indptr, indices, last, softcap=30.0),
        "fivar_paged_prefill_fa2": lambda: v.batch_prefill_paged(q, (k_cache, v_cache), qo_indptr, indptr, indices,
                                                                 last, softcap=30.0, backend="fa2"),
        "fivar_paged_prefill_fa3": lambda: v.batch_prefill_paged(q, (k_cache, v_cache), qo_indptr, indptr, indices,
                                                                 last, softcap=30.0, backend="fa3"),
    }
    ref = fns["stock_tc_decode"]()
    errs = {}
    for n, fn in list(fns.items()):
        try:
            errs[n] = rel(fn(), ref)
        except Exception as ex:
            errs[n] = f"{type(ex).__name__}: {ex}"[:200]
            del fns[n]
    bad = {n: e for n, e in errs.items() if not isinstance(e, float) or e > 1e-2}
    for n in bad:
        fns.pop(n, None)
    t = time_interleaved(fns, rounds)
    nbytes = decode_kv_bytes([kv_len] * batch, HKV_DECODE, D)
    row = dict(batch=batch, kv_len=kv_len, page=page, rel_err_vs_stock=errs,
               ms={n: x.median for n, x in t.items()}, kv_tbps={n: nbytes / x.median / 1e9 for n, x in t.items()})
    best = min((n for n in t if n != "stock_tc_decode"), key=lambda n: t[n].median)
    row["best_fivar"] = best
    row["best_vs_stock"] = t["stock_tc_decode"].median / t[best].median
    print("decode: " + ", ".join(f"{n} {row['kv_tbps'][n]:.2f} TB/s" for n in t) +
          f"; best fivar {best} = {row['best_vs_stock']:.3f}x stock", flush=True)
    return row


def _ints(text):
    return [int(x) for x in text.split(",") if x]


def main():
    global D, CLOCK_TRACE, SUSTAINED_S
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--rounds", type=int, help="timing rounds (default 4, --quick 2)")
    ap.add_argument("--parts", default="softcap,flex,decode")
    ap.add_argument("--softcap-seqlens", default="4096,8192,16384")
    ap.add_argument("--flex-seqlens", default="8192")
    ap.add_argument("--flex-causal", default="0,1", help="0 = non-causal, 1 = causal")
    ap.add_argument("--triton-seqlens", default="8192", help="flex sizes where the Triton twin is timed too")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--exp2-splits", default="", help="e.g. 0,3,4,6: FA3 contenders per exp2 split (see top)")
    ap.add_argument("--cta-tiles", nargs="*", default=[], help="e.g. 128x176 128x160,128x96: FA3 contenders per "
                    "CTA tile (see top)")
    ap.add_argument("--planned", action="store_true", help="a planned FA3 batch-prefill contender (see top)")
    ap.add_argument("--head-dim", type=int, default=D, help="every part's head dim (part 2 builds fivar's and stock's modules first)")
    ap.add_argument("--running-max", action="store_true",
                    help="an FA3 contender with the running-max softmax instead of the bounded one (see top)")
    ap.add_argument("--wave-splits", default="", help="e.g. 0,1x8,2x4: FA3 contenders per last-wave split (see top)")
    ap.add_argument("--sustained", type=float, default=0.0, metavar="SECONDS",
                    help="part 2 times each contender alone for SECONDS after 1 s untimed (see top)")
    ap.add_argument("--clock-trace", action="store_true", help="record SM clock and power per timing sample (see top)")
    ap.add_argument("--schedules", default="", help="e.g. persistent,grid: FA3 contenders per single-prefill schedule")
    args = ap.parse_args()
    D, SUSTAINED_S = args.head_dim, args.sustained
    torch.manual_seed(0)  # the same example params (document lengths) in every run: rows comparable across runs
    rounds = args.rounds or (2 if args.quick else 4)
    parts = args.parts.split(",")
    out = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__, head_dim=D)


    def write(data):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1, default=str)

    if "softcap" in parts:
        out["softcap_vs_stock"] = bench_softcap_vs_stock(_ints(args.softcap_seqlens), rounds)
    exp2_splits, cta_tiles = _ints(args.exp2_splits), args.cta_tiles
    schedules = [s for s in args.schedules.split(",") if s]
    options = option_contenders(exp2_splits, cta_tiles, args.running_max, [w for w in args.wave_splits.split(",") if w],
                                schedules)
    if (options or args.planned or D != 128) and "flex" in parts:
        build_option_modules(args.variants.split(","), exp2_splits, cta_tiles, args.running_max, args.planned,
                             schedules)
    if "flex" in parts:
        from fivar.bench.gpu_clocks import ClockTrace, cuda_device_ids

        def save(rows):  # after every row: a run cut short by a time limit keeps what it measured
            out["variants_vs_flex"] = rows
            write(out)
        trace = ClockTrace(gpus=cuda_device_ids()) if args.clock_trace else contextlib.nullcontext()
        with trace as CLOCK_TRACE:
            bench_variants_vs_flex(_ints(args.flex_seqlens), [bool(c) for c in _ints(args.flex_causal)], rounds,
                                   args.variants.split(","), _ints(args.triton_seqlens), on_row=save,
                                   options=options, planned=args.planned)
        if args.clock_trace:
            out["clock_trace"] = dict(nvidia_smi_id=trace.gpu, error=trace.error)
    if "decode" in parts:
        out["decode"] = bench_decode(rounds)
    write(out)


if __name__ == "__main__":
    main()
