"""Training steps: forward + backward of a variant at S = 8192 (bf16, head dim 128, GQA 32/8, causal), fivar's
`v.attention` (its default forward, FA3 on sm90, and the generated Triton backward; `fivar-triton`: the Triton
twin's forward) against FlexAttention (torch.compile, forward + backward of the same score_mod/mask_mod; the
baseline, or `flex-frozen` where Flex cannot compile the gradient of a captured tensor: Flex with the learnable
tensors held constant, less work than fivar does) and plain SDPA (flash backend, no variant: its own work).
Flex's gradients are compared with fivar's before timing (`grad_rel_err_vs_fivar`); gradients against float64
autograd are the GPU tests' (tests/test_gpu_backward.py). Useful TFLOP/s count the pairs the mask keeps.

After the bundled four, the training battery: the variants of `benchmarks/train/*.py`, written with the public API
as a user would (learnable per-head or table params where the kind has them), loaded like a user's file and run the
same way (a variant with a sink against Flex of the rest, the sink joined from Flex's log-sum-exp)."""
from __future__ import annotations

from pathlib import Path

from ..runner import Case, Prepared
from ..train import BASELINES

VARIANTS = ("softcap", "alibi", "document_mask", "relative_bias")
#: benchmarks/train/NAME.py, each run causal
BATTERY = ("kerple_log", "kerple_power", "learned_alibi", "learned_softcap", "t5_buckets_learned", "learned_sinks",
           "doc_causal_window", "strided_causal")
SEQLEN = 8192


def battery_dir() -> Path:
    from ..runner import repo_root
    root = repo_root()
    return (root if root else Path.cwd()) / "benchmarks" / "train"


def load(name: str):
    """A bundled variant by name, or a battery variant from its file."""
    import fivar
    if name in BATTERY:
        from ...registry import load_file
        return load_file(battery_dir() / f"{name}.py")
    return fivar.load(name)


def _measure(name: str, seqlen: int):
    from ..contenders import selected
    from ..train import TRAIN_CONTENDERS, bench_train, measurements
    wanted = tuple(c for c in TRAIN_CONTENDERS if selected(c))  # --contender: the others never compile
    return measurements(bench_train(load(name), seqlen=seqlen, causal=True, wanted=wanted))


def _forward_modules(name: str) -> list:
    """The FA3 modules `v.attention`'s default forward runs on sm90 (one request: single prefill, which a scanned
    mask runs in the tile-list form), for the runner's parallel prebuild; none elsewhere (Triton compiles on use)."""
    from ...jit.build import serving_modules
    from ._attention import HEAD_DIM, _sm90
    if not _sm90():
        return []
    return serving_modules(load(name), "single_prefill", "fa3", "bf16", HEAD_DIM)


def cases(quick: bool = False) -> list:
    seqlen = 2048 if quick else SEQLEN
    return [Case("train", f"{name} train S={seqlen} causal", "train",
                 {"seqlen": seqlen, "heads": "32/8", "head_dim": 128, "dtype": "bf16", "causal": True},
                 lambda n=name: Prepared(measure=lambda: _measure(n, seqlen)), baseline=BASELINES,
                 modules=lambda n=name: _forward_modules(n))
            for name in VARIANTS + BATTERY]
