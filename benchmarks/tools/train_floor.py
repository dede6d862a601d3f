"""The training step's floor: fivar's and Flex's forward + backward on plain attention (logits = score, no mask
beyond causal), the same shapes as the train suite. What a variant costs each is its suite time less this.

    python3 benchmarks/tools/train_floor.py [--seqlen 8192]

A diagnostic, not a suite row: plain attention is no variant a user writes (SDPA, a suite contender, is the same
function on FlashAttention-2's kernels). Contenders are checked against each other before timing, as in the suite.
"""
from __future__ import annotations

import argparse

import torch

from fivar import AttentionVariant
from fivar.bench.train import bench_train


def logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score


PLAIN = AttentionVariant(name="plain", logits=logits)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=8192)
    args = ap.parse_args(argv)
    print(torch.cuda.get_device_name(), f"plain attention, S={args.seqlen} causal, bf16, hd128, GQA 32/8")
    for r in bench_train(PLAIN, seqlen=args.seqlen, causal=True):
        if r["ms"] is None:
            print(f"{r['contender']:14s} error: {r['error']}")
            continue
        agree = "" if r.get("vs_fivar") is None else f"  grads vs fivar {r['vs_fivar']:.1e}"
        print(f"{r['contender']:14s} {r['ms']:8.3f} ms  {r['tflops']:6.1f} TFLOP/s{agree}")


if __name__ == "__main__":
    main()
