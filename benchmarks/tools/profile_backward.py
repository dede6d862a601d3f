"""Where a training step's time goes: the generated backward's kernels (dK/dV, dQ, the o.do rows) per launch config.

    python3 benchmarks/tools/profile_backward.py alibi document_mask [--seqlen 8192] [--configs all|suite] [--backend auto]
    FIVAR_TRITON_TMA=0 python3 benchmarks/tools/profile_backward.py alibi      # full tiles through pointers
    FIVAR_TRITON_GLUON=0 python3 benchmarks/tools/profile_backward.py alibi    # dK/dV in the Triton kernel on sm90

Not a benchmark (`python -m fivar.bench --suite train` is, with Flex and SDPA in the same run and the gradients
checked): for each variant, the train suite's inputs (the same seeded draw, so a document mask gets the same
documents), one step to autotune, then every config's autotuning time per kernel, the per-kernel GPU time of five
steps under torch.profiler and a do_bench of the step (Triton forward + generated backward). With `--configs all`
the kernels tune over a wider list than the template's (block shapes, warps, stages), to see what the grid misses.
Prints one JSON object per variant.
"""
from __future__ import annotations

import argparse
import json
import time
import zlib

import torch

import fivar
from fivar.bench.train import learnable_copy
from fivar.testing import example_params

#: (short side, long side, warps, stages): dK/dV programs hold the long side of keys, dQ programs of queries
WIDE = [(32, 128, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3),
        (32, 64, 4, 3), (64, 128, 4, 2)]


def _inputs(name: str, seqlen: int, heads=(32, 8), head_dim: int = 128):
    """The train suite's draw for `name` (fivar.bench.runner seeds each case with crc32 of its name)."""
    torch.manual_seed(zlib.crc32(f"{name} train S={seqlen} causal".encode()))
    var = fivar.load(name)
    var = learnable_copy(var) if not any(p.learnable for p in var.tensor_params.values()) else var
    hq, hkv = heads
    q = torch.randn(seqlen, hq, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(seqlen, hkv, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(seqlen, hkv, head_dim, dtype=torch.bfloat16, device="cuda")
    params = example_params(var, num_qo_heads=hq, num_kv_heads=hkv, batch_size=1, max_len=seqlen, device="cuda")
    return var, q, k, v, params


def _widen(module) -> None:
    """Tune both kernels over WIDE instead of the template's grid (the order pre-hooks kept)."""
    from triton import Config
    for kernel, dq in ((module.bwd_dkdv_kernel, False), (module.bwd_dq_kernel, True)):
        hook = kernel.configs[0].pre_hook
        kernel.configs = [Config({"BLOCK_M": long, "BLOCK_N": short} if dq else {"BLOCK_M": short, "BLOCK_N": long},
                                 num_warps=w, num_stages=s, pre_hook=hook) for short, long, w, s in WIDE]


def profile(name: str, seqlen: int, wide: bool, backend: str = "triton") -> dict:
    import triton

    from fivar.jit.triton_module import load_triton_module
    var, q, k, v, params = _inputs(name, seqlen)
    learn = [n for n, p in var.tensor_params.items() if p.learnable]
    params = {n: (t.detach().clone().requires_grad_(True) if n in learn else t) for n, t in params.items()}
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    do = torch.randn_like(q)
    module = load_triton_module(var, training=True)
    if wide:
        _widen(module)

    def step():
        o = var.attention(*leaves, causal=True, backend=backend, **params)
        return torch.autograd.grad(o, leaves + [params[n] for n in learn], do)

    out = {"variant": name, "seqlen": seqlen, "backend": backend, "gpu": torch.cuda.get_device_name(),
           "tma_dkdv": module.tma_loads(q, do), "tma_dq": module.tma_loads(k, v),
           "gluon_dkdv": module.gluon_dkdv(q, k, v, do)}
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    out["first_step_s"] = round(time.perf_counter() - t0, 1)  # compiles and autotunes
    for kernel in ("bwd_dkdv_kernel", "bwd_dq_kernel"):
        tuner = getattr(module, kernel)
        if not hasattr(tuner, "best_config"):  # not launched: dK/dV ran in the Gluon kernel (gluon_dkdv)
            continue
        timings = getattr(tuner, "configs_timings", None) or {}  # Triton's autotuning timings, where it keeps them
        out[kernel] = {"best": str(tuner.best_config),  # median ms: Triton's benchmark gives (p50, p20, p80)
                       "ms_by_config": {str(c): round(t[0] if isinstance(t, (list, tuple)) else t, 4)
                                        for c, t in timings.items()}}
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        total = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if total > 0:
            kernels[e.key[:60]] = round(total / 5 / 1000, 4)  # per step
    out["kernel_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12])
    out["step_ms"] = round(triton.testing.do_bench(step, warmup=5, rep=50), 4)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="+")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--configs", choices=("suite", "all"), default="suite")
    ap.add_argument("--backend", default="triton", help="the forward: triton (default) or auto (FA3 on sm90)")
    args = ap.parse_args(argv)
    for name in args.names:
        print(json.dumps(profile(name, args.seqlen, args.configs == "all", args.backend)), flush=True)


if __name__ == "__main__":
    main()
