"""Where a one-shot FA3 call of a mask that is more than a band (the document mask) spends its host time:
`v.prefill(..., backend="fa3")` plans its KV ranges on every call (fivar/runtime/kv_ranges.py). Prints the
call's wall time against the planned run's, then cProfile's top entries.

    python3 benchmarks/tools/profile_kv_range_oneshot.py [S]
"""
import cProfile
import pstats
import sys
import time

import torch

import fivar
from fivar.testing import example_params

S, H, D = (int(sys.argv[1]) if len(sys.argv) > 1 else 4096), 32, 128
v = fivar.load("document_mask")
q, k, vv = (torch.randn(S, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
params = example_params(v, num_qo_heads=H, num_kv_heads=H, batch_size=1, max_len=S, device="cuda")
call = lambda: v.prefill(q, k, vv, causal=True, backend="fa3", **params)  # noqa: E731
indptr = torch.tensor([0, S], dtype=torch.int32, device="cuda")
plan = v.plan_ragged(indptr, indptr, num_qo_heads=H, num_kv_heads=H, head_dim=D, causal=True, backend="fa3",
                     **params)
for _ in range(3):
    call(), plan.run(q, k, vv)
torch.cuda.synchronize()


def wall(fn, n=20):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


print(f"S={S} causal: one-shot {wall(call):.3f} ms per call, planned run {wall(lambda: plan.run(q, k, vv)):.3f} ms")
prof = cProfile.Profile()
prof.enable()
for _ in range(20):
    call()
torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
