"""fivar against stock FlashInfer where a mask's structure should be skipped, each pair checked first.

    python benchmarks/tools/sparsity_probe.py [--quick]

Rows (bf16, head_dim 128, GQA 32/8):
  decode     Gemma-2 local layer (soft-cap 50, window 4096), batch 32 x 32768 keys, page 16: fivar one-shot and
             planned vs stock tensor-core decode with window_left + logits_soft_cap
  streaming  StreamingLLM (4 sinks + window 4096), same batch: fivar (trimmed pages) against the copy bandwidth
             on the bytes of the pages holding kept keys
  fa2        the same layer, single prefill S=8192 causal: fivar backend="fa2" vs stock FA2 single prefill and
             stock FA2 ragged batch prefill, both with window_left + logits_soft_cap
  one-shot   chunked local mask (causal inside 256-token chunks), S=8192: v.prefill vs the planned run, per backend
Every contender is compared with fivar's output (and fivar with the float reference on a slice) before it is timed;
a pair that disagrees is reported and not timed. Times are medians of CUDA-event timings.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from fivar import AttentionVariant, Scalar, tanh
from fivar.testing import _ragged_reference, _to_paged, compare


def _gemma_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.cap * tanh(score / params.cap)


def _gemma_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx - kv_idx < params.window


def _chunk_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return q_idx // params.chunk == kv_idx // params.chunk


def _sinks_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.n_sink or q_idx - kv_idx < params.window


STREAMING = AttentionVariant(name="streaming_llm_sparsity_probe", mask=_sinks_mask,
                             params={"n_sink": Scalar(int, default=4), "window": Scalar(int, default=4096)})
GEMMA = AttentionVariant(name="gemma2_local_sparsity_probe", logits=_gemma_logits, mask=_gemma_mask,
                         params={"cap": Scalar(float, default=50.0), "window": Scalar(int, default=4096)})
CHUNKED = AttentionVariant(name="chunked_sparsity_probe", mask=_chunk_mask, params={"chunk": Scalar(int, default=256)})
CAP, WINDOW = 50.0, 4096
HQ, HKV, D, DT = 32, 8, 128, torch.bfloat16


def time_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _agree(name: str, out, want, ref_name: str) -> bool:
    r = compare(name, f"vs {ref_name}", out, want, DT)
    print(f"  check {r}")
    return r.passed


def decode_row(batch: int, kv_len: int, page: int = 16):
    import flashinfer
    print(f"decode: {GEMMA.name} soft-cap {CAP} window {WINDOW}, batch {batch} x {kv_len}, page {page}")
    kv_lens = [kv_len] * batch
    q = torch.randn(batch, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(batch * kv_len, HKV, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    cache, indptr, indices, last = _to_paged(k, v, kv_lens, page)
    fivar_oneshot = lambda: GEMMA.decode(q, cache, indptr, indices, last)  # noqa: E731
    plan = GEMMA.plan_decode(indptr, indices, last, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=page,
                             dtype=DT)
    fivar_planned = lambda: plan.run(q, cache)  # noqa: E731
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    stock = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    stock.plan(indptr, indices, last, HQ, HKV, D, page, window_left=WINDOW - 1, logits_soft_cap=CAP,
               q_data_type=DT, kv_data_type=DT)
    stock_run = lambda: stock.run(q, cache)  # noqa: E731
    out = fivar_oneshot()
    n = 2  # the float reference on the first requests
    ok = _agree(GEMMA.name, out[:n], _ragged_reference(GEMMA, q[:n], k[:n * kv_len], v[:n * kv_len], [1] * n,
                                                       kv_lens[:n], False, {}), "reference")
    ok &= _agree(GEMMA.name, fivar_planned(), out, "fivar one-shot")
    ok &= _agree(GEMMA.name, stock_run(), out, "stock decode")
    if not ok:
        print("  not timed: a check failed")
        return
    window_bytes = batch * min(WINDOW, kv_len) * HKV * D * 2 * 2
    rows = {"stock tc decode (window_left + soft-cap)": time_ms(stock_run), "fivar planned": time_ms(fivar_planned),
            "fivar one-shot": time_ms(fivar_oneshot)}
    base = rows["stock tc decode (window_left + soft-cap)"]
    for name, ms in rows.items():
        print(f"  {name:42s} {ms:8.4f} ms  {window_bytes / ms / 1e9:6.2f} TB/s of window KV  {base / ms:5.2f}x stock")


def streaming_row(batch: int, kv_len: int, page: int = 16):
    """No stock decode computes sinks + window: the yardstick is the copy bandwidth on the bytes of the pages
    holding kept keys (what decode has to read at least)."""
    print(f"decode: {STREAMING.name} (4 sink tokens + window 4096), batch {batch} x {kv_len}, page {page}")
    kv_lens = [kv_len] * batch
    q = torch.randn(batch, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(batch * kv_len, HKV, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    cache, indptr, indices, last = _to_paged(k, v, kv_lens, page)
    oneshot = lambda: STREAMING.decode(q, cache, indptr, indices, last)  # noqa: E731
    plan = STREAMING.plan_decode(indptr, indices, last, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                                 page_size=page, dtype=DT, backend="fa2")
    planned = lambda: plan.run(q, cache)  # noqa: E731
    out = oneshot()
    n = 2
    ok = _agree(STREAMING.name, out[:n], _ragged_reference(STREAMING, q[:n], k[:n * kv_len], v[:n * kv_len],
                                                           [1] * n, kv_lens[:n], False, {}), "reference")
    ok &= _agree(STREAMING.name, planned(), out, "fivar planned")
    if not ok:
        print("  not timed: a check failed")
        return
    read, total = plan.pages_read or (None, None)
    print(f"  pages read {read} of {total}")
    kept_pages = batch * (-(-4 // page) + -(-4096 // page) + 1)  # sink pages + window pages (+1: unaligned window)
    kept_bytes = kept_pages * page * HKV * D * 2 * 2
    src = torch.empty(kept_bytes // 2, dtype=DT, device="cuda")
    dst = torch.empty_like(src)
    copy = time_ms(lambda: dst.copy_(src))
    copy_bw = 2 * kept_bytes / copy / 1e9  # read + write
    for name, fn in (("fivar planned (fa2)", planned), ("fivar one-shot", oneshot)):
        ms = time_ms(fn)
        bw = kept_bytes / ms / 1e9
        print(f"  {name:42s} {ms:8.4f} ms  {bw:6.2f} TB/s on kept pages' bytes  ({bw / copy_bw:5.2f}x copy "
              f"bandwidth {copy_bw:.2f} TB/s)")


def fa2_row(seq: int):
    import flashinfer
    print(f"fa2 prefill: {GEMMA.name} soft-cap {CAP} window {WINDOW}, S={seq} causal")
    q = torch.randn(seq, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(seq, HKV, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    fivar_run = lambda: GEMMA.prefill(q, k, v, causal=True, backend="fa2")  # noqa: E731
    stock_single = lambda: flashinfer.single_prefill_with_kv_cache(  # noqa: E731
        q, k, v, causal=True, window_left=WINDOW - 1, logits_soft_cap=CAP, backend="fa2")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa2")
    indptr = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    ragged.plan(indptr, indptr, HQ, HKV, D, causal=True, window_left=WINDOW - 1, logits_soft_cap=CAP,
                q_data_type=DT, kv_data_type=DT)
    stock_ragged = lambda: ragged.run(q, k, v)  # noqa: E731
    out = fivar_run()
    rows = slice(seq - 256, seq)  # the reference on the last rows (their keys: all of k)
    ref = GEMMA.reference(q[rows], k, v, causal=True)
    ok = _agree(GEMMA.name, out[rows], ref, "reference (last 256 rows)")
    ok &= _agree(GEMMA.name, stock_single(), out, "stock fa2 single")
    ok &= _agree(GEMMA.name, stock_ragged(), out, "stock fa2 ragged")
    if not ok:
        print("  not timed: a check failed")
        return
    times = {"stock fa2 single (window_left + soft-cap)": time_ms(stock_single),
             "stock fa2 ragged (window_left + soft-cap)": time_ms(stock_ragged), "fivar fa2": time_ms(fivar_run)}
    base = min(times["stock fa2 single (window_left + soft-cap)"], times["stock fa2 ragged (window_left + soft-cap)"])
    for name, ms in times.items():
        print(f"  {name:42s} {ms:8.4f} ms  {base / ms:5.2f}x the faster stock")


def oneshot_row(seq: int, backends=("fa2", "fa3")):
    print(f"one-shot vs planned: {CHUNKED.name} (chunk 256, causal), S={seq}")
    q = torch.randn(seq, HQ, D, dtype=DT, device="cuda")
    k = torch.randn(seq, HKV, D, dtype=DT, device="cuda")
    v = torch.randn_like(k)
    indptr = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    for backend in backends:
        if backend == "fa3" and torch.cuda.get_device_capability() != (9, 0):
            continue
        plain = lambda: CHUNKED.prefill(q, k, v, causal=True, backend=backend)  # noqa: E731
        plan = CHUNKED.plan_ragged(indptr, indptr, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, dtype=DT,
                                   causal=True, backend=backend)
        planned = lambda: plan.run(q, k, v)  # noqa: E731
        out = plain()
        rows = slice(seq - 256, seq)
        ok = _agree(CHUNKED.name, out[rows], CHUNKED.reference(q[rows], k, v, causal=True), f"reference [{backend}]")
        ok &= _agree(CHUNKED.name, planned(), out, f"planned [{backend}]")
        if not ok:
            print("  not timed: a check failed")
            continue
        t_plain, t_planned = time_ms(plain), time_ms(planned)
        blocks = getattr(plan, "_blocks", None)
        read = f", keys read {blocks.keys_read[0] / blocks.keys_read[1]:.3f} of the requests'" if blocks else ""
        print(f"  {backend}: plain {t_plain:.4f} ms, planned {t_planned:.4f} ms, plain/planned "
              f"{t_plain / t_planned:.3f}{read}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    args = ap.parse_args(argv)
    print(f"device: {torch.cuda.get_device_name()}")
    if args.quick:
        decode_row(4, 8192)
        streaming_row(4, 8192)
        fa2_row(4096)
        oneshot_row(2048)
    else:
        decode_row(32, 32768)
        streaming_row(32, 32768)
        fa2_row(8192)
        oneshot_row(8192)


if __name__ == "__main__":
    main()
