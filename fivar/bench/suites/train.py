"""Training steps: forward + backward of a variant at S = 8192 (bf16, head dim 128, GQA 32/8, causal), fivar's
`v.attention` (the Triton twin's forward and its generated backward) against FlexAttention (torch.compile, forward
+ backward of the same score_mod/mask_mod; the baseline) and plain SDPA (flash backend, no variant: its own work).
Flex's gradients are compared with fivar's before timing (`grad_rel_err_vs_fivar`); gradients against float64
autograd are the GPU tests' (tests/test_gpu_backward.py). Useful TFLOP/s count the pairs the mask keeps."""
from __future__ import annotations

from ..runner import Case, Measurement, Prepared

VARIANTS = ("softcap", "alibi", "document_mask", "relative_bias")
SEQLEN = 8192
LABELS = {"fivar": "v.attention: Triton forward + generated backward",
          "flex": "torch.compile flex_attention, forward + backward",
          "sdpa": "plain attention, flash backend (no variant, its own work)"}


def measurements(rows: list[dict]) -> list[Measurement]:
    """fivar.bench.train.bench_train rows as the runner's measurements (ms and useful TFLOP/s per contender)."""
    out = []
    for r in rows:
        label = LABELS.get(r["contender"], "")
        if r.get("ms") is None:
            out.append(Measurement(r["contender"], "ms", None, "error", label, {"error": r.get("error")}))
            continue
        detail = {"spread_ms": r.get("ms_spread")}
        if r.get("vs_fivar") is not None:
            detail["grad_rel_err_vs_fivar"] = r["vs_fivar"]
        out.append(Measurement(r["contender"], "ms", r["ms"], label=label, detail=detail))
        out.append(Measurement(r["contender"], "tflops_useful", r["tflops"], label=label, detail=detail))
    return out


def _measure(name: str, seqlen: int):
    import fivar

    from ..train import bench_train
    return measurements(bench_train(fivar.load(name), seqlen=seqlen, causal=True))


def cases(quick: bool = False) -> list:
    seqlen = 2048 if quick else SEQLEN
    return [Case("train", f"{name} train S={seqlen} causal", "train",
                 {"seqlen": seqlen, "heads": "32/8", "head_dim": 128, "dtype": "bf16", "causal": True},
                 lambda n=name: Prepared(measure=lambda: _measure(n, seqlen)), baseline="flex")
            for name in VARIANTS]


def result_rows(rows: list[dict], env: dict) -> list[dict]:
    """bench_train rows as results-file rows (the runner's fields, ratios against Flex per variant and causal)."""
    from ..runner import ROW_FIELDS, add_ratios
    out = []
    for key in dict.fromkeys((r["variant"], r["causal"], r["seqlen"]) for r in rows):
        name, causal, seqlen = key
        group = [r for r in rows if (r["variant"], r["causal"], r["seqlen"]) == key]
        shape = {"seqlen": seqlen, "heads": group[0]["heads"], "head_dim": group[0]["head_dim"],
                 "dtype": "bf16" if group[0]["dtype"] == "bfloat16" else group[0]["dtype"], "causal": causal}
        made = [{"contender": m.contender, "label": m.label, "metric": m.metric, "value": m.value, "check": m.check,
                 "detail": m.detail} for m in measurements(group)]
        for r in add_ratios(made, "flex"):
            r.update(suite="train", case=f"{name} train S={seqlen}{' causal' if causal else ''}", op="train",
                     shape=shape)
            out.append({k: {**env, **r}.get(k) for k in ROW_FIELDS})
    return out
