"""Where FA3's KV-range form spends its time (GPU kernels by name, host planning), next to stock FA3 dense.

    python3 benchmarks/tools/profile_kv_ranges.py [--json FILE]

Contenders at S=8192, 32 heads, head_dim 128, bf16, non-causal: the document mask planned once and run, the
same one-shot (plans every call), the KV-range form with one document (every block's range is every key and
every key is in its full range: the mask never runs, so this is the form's per-tile cost), and stock FA3
(single prefill, and ragged with one request per 128 query rows over all keys; no mask). Every contender is checked against stock FA3 or the torch
reference on the last rows first.
"""
import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fivar
from fivar.testing import compare

S, H, D = 8192, 32, 128


def kernel_times(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            out[e.key[:90]] = round(e.device_time_total / reps, 1)  # us per call
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:6])


def wall_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / reps * 1e6, 1)


def main():
    import flashinfer
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    v = fivar.load("document_mask")
    q, k, vv = (torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    docs = v.example(num_qo_heads=H, num_kv_heads=H, batch_size=1, max_len=S, device="cuda")
    one_doc = {"doc_ids": torch.zeros(1, S, dtype=torch.int32, device="cuda")}
    indptr = torch.tensor([0, S], dtype=torch.int32, device="cuda")
    t0 = time.perf_counter()
    plan = v.plan_ragged(indptr, indptr, num_qo_heads=H, num_kv_heads=H, head_dim=D, backend="fa3", **docs)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan_one = v.plan_ragged(indptr, indptr, num_qo_heads=H, num_kv_heads=H, head_dim=D, backend="fa3", **one_doc)
    plan_one_s = time.perf_counter() - t0
    stock_ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), kv_layout="NHD", backend="fa3")
    blocks = S // 128  # stock FA3 over the one-doc layout: 128-row requests, each over all S keys (copied)
    k_rep, v_rep = k.repeat(blocks, 1, 1), vv.repeat(blocks, 1, 1)
    stock_ragged.plan(torch.arange(0, S + 1, 128, dtype=torch.int32, device="cuda"),
                      torch.arange(0, blocks * S + 1, S, dtype=torch.int32, device="cuda"), H, H, D,
                      q_data_type=torch.bfloat16)
    fns = {
        "doc_planned": lambda: plan.run(q, k, vv),
        "doc_oneshot": lambda: v.prefill(q, k, vv, backend="fa3", **docs),
        "one_doc_planned": lambda: plan_one.run(q, k, vv),
        "stock_fa3_single": lambda: flashinfer.single_prefill_with_kv_cache(q, k, vv, backend="fa3"),
        "stock_fa3_ragged_128_row_requests": lambda: stock_ragged.run(q, k_rep, v_rep),
    }
    ref_rows = v.reference(q[-256:], k, vv, **docs)
    checks = {"doc_planned": compare("document_mask", "planned", fns["doc_planned"]()[-256:], ref_rows,
                                     torch.bfloat16).passed,
              "one_doc_planned": compare("document_mask", "one doc vs stock", fns["one_doc_planned"](),
                                         fns["stock_fa3_single"]().float(), torch.bfloat16).passed}
    lay = plan._kv_ranges.layout
    checks["stock_ragged_blocks"] = compare("none", "stock ragged blocks vs single", fns["stock_fa3_ragged_128_row_requests"](),
                                            fns["stock_fa3_single"]().float(), torch.bfloat16).passed
    res = dict(gpu=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), checks=checks,
               row_runs={"docs": plan._kv_ranges.row_runs, "one_doc": plan_one._kv_ranges.row_runs},
               plan_ms={"docs": plan_s * 1e3, "one_doc": plan_one_s * 1e3},
               layout=dict(blocks=int(lay.kv_lens.numel()),
                           work_fraction=float((lay.kv_lens.double() * 128).sum() / S / S),
                           full_fraction=float(((lay.blocks[:, 4] - lay.blocks[:, 3]).clamp(min=0).sum()
                                                / lay.kv_lens.sum()))),
               wall_us={}, kernels_us={})
    for n, fn in fns.items():
        res["wall_us"][n] = wall_us(fn)
        res["kernels_us"][n] = kernel_times(fn)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
