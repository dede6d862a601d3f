"""Training with a variant: the forward+backward benchmark (`--op train`), fivar's Triton forward+backward against
FlexAttention's and SDPA's flash backend (the gradient checks against float64 autograd of the reference:
fivar.testing.check_gradients).
"""
from __future__ import annotations

import torch


def learnable_copy(variant, names=None, learnable: bool = True):
    """The variant with its float tensor params (or those in `names`) declared learnable=True; with `learnable`
    False, none of them learnable (what training through it costs with the tensors held)."""
    from dataclasses import replace

    from ..spec import Tensor
    params = {n: (replace(p, learnable=learnable, where=p.where) if isinstance(p, Tensor) and p.ir_type == "f32"
                  and (names is None or n in names) else p) for n, p in variant.params.items()}
    return replace(variant, params=params)


# --- `--op train`: forward + backward, fivar vs Flex vs SDPA's flash backend -------------------------------------
TRAIN_CONTENDERS = ("fivar", "fivar-triton", "fivar-frozen", "flex", "flex-frozen", "sdpa")
#: ratios are against Flex, or against Flex with the learnable tensors frozen where Flex cannot compile their gradient
BASELINES = ("flex", "flex-frozen")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def flex_with_sink_fn(variant, params, q, k, v, *, causal, compile=True):
    """fivar.flex.flex_attention_fn, and for a variant with a sink (which Flex's score_mod cannot add to the
    denominator) Flex of the rest with its log-sum-exp, the sink joined after: o * sigmoid(lse - sink)
    (fivar.flex.join_sink), so that its gradients reach the sink's tensors too."""
    import math

    from ..flex import flex_attention_fn, flex_block_mask, flex_mods, flex_sink, join_sink, without_sink
    if variant.sink is None:
        return flex_attention_fn(variant, params, q, k, v, causal=causal, compile=compile)
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    rest = without_sink(variant)
    (qo_len, hq, d), (kv_len, hkv, _) = q.shape, k.shape
    scale = 1.0 / math.sqrt(d)
    score_mod, mask_mod = flex_mods(rest, params, qo_len=qo_len, kv_len=kv_len, num_qo_heads=hq, num_kv_heads=hkv,
                                    sm_scale=scale, causal=causal, device=q.device)
    block_mask = flex_block_mask(rest, mask_mod, qo_len, kv_len, hq, q.device)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)  # as flex_attention_fn
    fa = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))

    def run():  # the sink evaluated in the step: its gradient reaches the params it reads
        sink = flex_sink(variant, params, num_qo_heads=hq, num_kv_heads=hkv, device=q.device)  # [1, heads]
        out, lse = fa(qb, kb, vb, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=hq != hkv,
                      return_lse=True)  # lse: natural log, [1, heads, queries]
        return join_sink(out, lse, sink.unsqueeze(-1)).squeeze(0).transpose(0, 1)
    return run


def train_contenders(variant, q, k, v, *, causal, params, wanted=TRAIN_CONTENDERS):
    """name -> zero-argument callable running forward + backward once and returning the gradients (q, k, v, then
    the learnable tensor params; "flex-frozen": q, k, v only); each starts from the same leaves and the same upstream
    gradient."""
    import torch.nn.functional as F

    learn = [n for n, p in variant.tensor_params.items() if p.learnable]
    params = {n: (t.detach().clone().requires_grad_(True) if n in learn else t) for n, t in params.items()}
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    inputs = leaves + [params[n] for n in learn]
    do = torch.randn_like(q)
    fns = {}
    for name, backend in (("fivar", "auto"), ("fivar-triton", "triton")):  # the default forward, and the twin's
        if name in wanted:
            def fivar_step(backend=backend):
                o = variant.attention(*leaves, causal=causal, backend=backend, **params)
                return torch.autograd.grad(o, inputs, do)
            fns[name] = fivar_step
    if "fivar-frozen" in wanted and learn:
        # the same work as flex-frozen: the learnable tensors held constant (a variant declaring none learnable,
        # whose backward computes no gradient for them), gradients of q, k, v only
        held = learnable_copy(variant, learnable=False)
        held_params = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in params.items()}

        def fivar_frozen_step():
            return torch.autograd.grad(held.attention(*leaves, causal=causal, **held_params), leaves, do)
        fns["fivar-frozen"] = fivar_frozen_step
    if "flex" in wanted and variant.softmax:
        run = flex_with_sink_fn(variant, params, *leaves, causal=causal)

        def flex_step():
            return torch.autograd.grad(run(), inputs, do)
        fns["flex"] = flex_step
    if "flex-frozen" in wanted and variant.softmax and learn:
        # Flex with the learnable tensors captured as constants: gradients of q, k, v only (less work than the
        # others do), for variants whose captured-tensor gradient Flex cannot compile (ALiBi's slopes, a learned
        # table on torch 2.11); absent when nothing is learnable, where it is "flex"
        frozen = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in params.items()}
        run_frozen = flex_with_sink_fn(variant, frozen, *leaves, causal=causal)

        def flex_frozen_step():
            return torch.autograd.grad(run_frozen(), leaves, do)
        fns["flex-frozen"] = flex_frozen_step
    if "sdpa" in wanted:  # plain attention (no variant), heads expanded outside the timed step
        from torch.nn.attention import SDPBackend, sdpa_kernel
        group = q.shape[1] // k.shape[1]
        plain = [x.detach().transpose(0, 1).unsqueeze(0).requires_grad_(True) for x in
                 (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))]
        do_plain = do.transpose(0, 1).unsqueeze(0)

        def sdpa_step():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(*plain, is_causal=causal)
            return torch.autograd.grad(o, plain, do_plain)
        fns["sdpa"] = sdpa_step
    return fns


def bench_train(variant, *, seqlen: int = 8192, heads=(32, 8), head_dim: int = 128, causal: bool = True,
                dtype=torch.bfloat16, params: dict | None = None, wanted=TRAIN_CONTENDERS, rounds: int = 3,
                device: str = "cuda") -> list[dict]:
    """One tidy row per contender: median ms of forward + backward, and useful TFLOP/s (3.5x the forward's
    matmul work on the pairs the mask and causal keep: the backward's five matmuls are 2.5x the forward's two).
    Flex's gradients are checked against fivar's (`vs_fivar`: relative error of dq, dk, dv, params)."""
    from ..testing import example_params
    from .timing import attention_flops, time_interleaved
    from .work import kept_fraction
    hq, hkv = heads
    variant = learnable_copy(variant) if not any(p.learnable for p in variant.tensor_params.values()) else variant
    q = torch.randn(seqlen, hq, head_dim, dtype=dtype, device=device)
    k = torch.randn(seqlen, hkv, head_dim, dtype=dtype, device=device)
    v = torch.randn(seqlen, hkv, head_dim, dtype=dtype, device=device)
    params = {**example_params(variant, num_qo_heads=hq, num_kv_heads=hkv, batch_size=1, max_len=seqlen,
                               device=device), **(params or {})}
    fns = train_contenders(variant, q, k, v, causal=causal, params=params, wanted=wanted)
    grads, errors = {}, {}
    for name, fn in list(fns.items()):  # also compiles / autotunes outside the timing
        try:
            grads[name] = fn()
        except Exception as e:  # noqa: BLE001 - a contender that cannot run is reported, the others still timed
            errors[name] = f"{type(e).__name__}: {e}"[:300]
            del fns[name]
    agree = {}
    for name in ("fivar-triton", "fivar-frozen", "flex", "flex-frozen"):  # the gradients both computed (frozen: q, k, v)
        if "fivar" in grads and name in grads:
            agree[name] = max(_rel(a, b) for a, b in zip(grads[name], grads["fivar"]))
    timings = time_interleaved(fns, rounds=rounds, device=device)
    useful = 3.5 * attention_flops(seqlen, seqlen, hq, head_dim, causal) * kept_fraction(
        variant, params, qo_len=seqlen, kv_len=seqlen, num_qo_heads=hq, num_kv_heads=hkv, causal=causal,
        device=device)
    plain = 3.5 * attention_flops(seqlen, seqlen, hq, head_dim, causal)
    rows = []
    for name, t in timings.items():
        work = plain if name == "sdpa" else useful  # SDPA runs no mask: its own (causal or full) work
        rows.append({"variant": variant.name, "op": "train", "contender": name, "seqlen": seqlen,
                     "heads": f"{hq}/{hkv}", "head_dim": head_dim, "causal": causal, "dtype": str(dtype).removeprefix("torch."),
                     "ms": t.median, "ms_spread": list(t.spread), "tflops": work / t.median / 1e9,
                     "vs_fivar": agree.get(name)})
    rows += [{"variant": variant.name, "op": "train", "contender": name, "seqlen": seqlen, "heads": f"{hq}/{hkv}",
              "head_dim": head_dim, "causal": causal, "dtype": str(dtype).removeprefix("torch."), "ms": None,
              "tflops": None, "error": err} for name, err in errors.items()]
    return rows


def format_rows(rows: list[dict]) -> str:
    """A small text table of `bench_train` rows, with each contender's speed relative to fivar."""
    base = {(r["variant"], r["causal"]): r["ms"] for r in rows if r["contender"] == "fivar"}
    lines = [f"{'variant':<24}{'causal':<8}{'contender':<10}{'ms':>9}{'TFLOP/s':>9}{'fivar x':>9}"]
    for r in rows:
        speed = base.get((r["variant"], r["causal"]))
        if r["ms"] is None:
            lines.append(f"{r['variant']:<24}{str(r['causal']):<8}{r['contender']:<10}  error: {r['error'][:60]}")
            continue
        lines.append(f"{r['variant']:<24}{str(r['causal']):<8}{r['contender']:<10}{r['ms']:>9.3f}{r['tflops']:>9.1f}"
                     f"{(r['ms'] / speed if speed else float('nan')):>9.2f}")
    return "\n".join(lines)


# --- results rows: the runner's format (python -m fivar.bench --suite train) ---------------------------------------
LABELS = {"fivar": "v.attention: the default forward (FA3 on sm90, else Triton) + generated backward",
          "fivar-triton": "v.attention(backend='triton'): Triton forward + generated backward",
          "fivar-frozen": "v.attention, learnable tensors held constant (dq, dk, dv only: flex-frozen's work)",
          "flex": "torch.compile flex_attention, forward + backward",
          "flex-frozen": "flex_attention, learnable tensors held constant (dq, dk, dv only)",
          "sdpa": "plain attention, flash backend (no variant, its own work)"}


#: the largest relative difference of another contender's gradients from fivar's (worst of dq, dk, dv, params) that
#: is bf16 noise (measured 0.0015-0.0034 at S=8192); beyond it one of them is wrong, and fivar's rows fail
GRAD_AGREEMENT = 0.02


def measurements(rows: list[dict]) -> list:
    """fivar.bench.train.bench_train rows as the runner's measurements (ms and useful TFLOP/s per contender).
    fivar's own rows (fivar, fivar-triton) fail, with no number, when any contender's gradients disagree with
    fivar's beyond GRAD_AGREEMENT: Flex is the independent check, the other forward the consistency one."""
    from .runner import Measurement
    disagree = {r["contender"]: r["vs_fivar"] for r in rows
                if r.get("vs_fivar") is not None and not r["vs_fivar"] <= GRAD_AGREEMENT}  # NaN disagrees
    out = []
    for r in rows:
        label = LABELS.get(r["contender"], "")
        if r.get("ms") is None:
            out.append(Measurement(r["contender"], "ms", None, "error", label, {"error": r.get("error")}))
            continue
        if disagree and r["contender"].startswith("fivar"):
            out.append(Measurement(r["contender"], "ms", None, "fail", label, {"grad_rel_err_vs_fivar": disagree}))
            continue
        detail = {"spread_ms": r.get("ms_spread")}
        if r.get("vs_fivar") is not None:
            detail["grad_rel_err_vs_fivar"] = r["vs_fivar"]
        out.append(Measurement(r["contender"], "ms", r["ms"], label=label, detail=detail))
        out.append(Measurement(r["contender"], "tflops_useful", r["tflops"], label=label, detail=detail))
    return out


def result_rows(rows: list[dict], env: dict) -> list[dict]:
    """bench_train rows as results-file rows (the runner's fields, ratios against BASELINES per variant and causal)."""
    from .runner import ROW_FIELDS, add_ratios
    out = []
    for key in dict.fromkeys((r["variant"], r["causal"], r["seqlen"]) for r in rows):
        name, causal, seqlen = key
        group = [r for r in rows if (r["variant"], r["causal"], r["seqlen"]) == key]
        shape = {"seqlen": seqlen, "heads": group[0]["heads"], "head_dim": group[0]["head_dim"],
                 "dtype": "bf16" if group[0]["dtype"] == "bfloat16" else group[0]["dtype"], "causal": causal}
        made = [{"contender": m.contender, "label": m.label, "metric": m.metric, "value": m.value, "check": m.check,
                 "detail": m.detail} for m in measurements(group)]
        for r in add_ratios(made, BASELINES):
            r.update(suite="train", case=f"{name} train S={seqlen}{' causal' if causal else ''}", op="train",
                     shape=shape)
            out.append({k: {**env, **r}.get(k) for k in ROW_FIELDS})
    return out


def main(argv=None) -> None:
    """python -m fivar.bench.train [NAME ...] [--causal both|yes|no] [--seqlen 8192] [--heads 32/8]
    [--vs fivar-triton,fivar-frozen,flex,flex-frozen,sdpa]"""
    import argparse
    import json

    import fivar
    ap = argparse.ArgumentParser(prog="python -m fivar.bench.train", description=main.__doc__)
    ap.add_argument("names", nargs="*", default=["softcap", "alibi", "document_mask", "relative_bias"])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vs", default="fivar-triton,fivar-frozen,flex,flex-frozen,sdpa",
                    help="contenders besides fivar, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jsonl", default=None, help="append the rows to this results file (the runner's row format; "
                    "python -m fivar.bench --suite train writes the same rows to benchmarks/results/<gpu>.jsonl)")
    args = ap.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    wanted = ("fivar",) + tuple(x for x in args.vs.split(",") if x)
    rows = []
    for name in args.names:
        for causal in {"both": (True, False), "yes": (True,), "no": (False,)}[args.causal]:
            rows += bench_train(fivar.load(name), seqlen=args.seqlen, heads=(hq, hkv), head_dim=args.head_dim,
                                causal=causal, wanted=wanted, rounds=args.rounds)
    for r in rows:
        print(json.dumps(r))
    if args.jsonl:
        from .runner import environment
        with open(args.jsonl, "a") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in result_rows(rows, environment()))
    print(format_rows(rows))


if __name__ == "__main__":
    main()


__all__ = ["bench_train", "flex_with_sink_fn", "learnable_copy", "measurements", "result_rows", "train_contenders"]
