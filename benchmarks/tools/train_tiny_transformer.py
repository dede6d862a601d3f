"""A 50-step training loop of a tiny causal transformer whose attention has a learned relative-position bias
(variants/relative_bias.py with the table declared learnable), run twice from the same initial weights and
batches: once with fivar's differentiable Triton attention (`variant.attention`), once with the eager float32
torch reference. The loss curves should fall the same way.

The task needs the bias: each sequence repeats a random block of PERIOD tokens, so the next token is the one
PERIOD - 1 positions back, a fixed relative offset the bias table can single out.

    python benchmarks/tools/train_tiny_transformer.py                 # GPU (bf16 attention inputs)
    TRITON_INTERPRET=1 python benchmarks/tools/train_tiny_transformer.py --steps 5 --device cpu   # slow, fp16
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import fivar
from fivar.bench.train import learnable_copy
from fivar.codegen.torch_ref import reference_attention

VOCAB, PERIOD, MAX_DISTANCE = 32, 7, 16


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, variant, use_fivar: bool, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(heads, 2 * MAX_DISTANCE + 1))
        self.variant, self.use_fivar, self.dtype = variant, use_fivar, dtype

    def forward(self, x: torch.Tensor, indptr: torch.Tensor, seq: int) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, -1, self.head_dim).split([self.heads, self.kv_heads, self.kv_heads], 1)
        if self.use_fivar:  # the whole batch as one ragged launch
            o = self.variant.attention(q.to(self.dtype), k.to(self.dtype), v.to(self.dtype), causal=True,
                                       qo_indptr=indptr, kv_indptr=indptr, bias=self.bias,
                                       max_distance=MAX_DISTANCE).float()
        else:  # eager float32 reference, sequence by sequence
            o = torch.cat([reference_attention(self.variant, q[s:s + seq], k[s:s + seq], v[s:s + seq], causal=True,
                                               params={"bias": self.bias, "max_distance": MAX_DISTANCE})
                           for s in range(0, tokens, seq)])
        return self.out(o.reshape(tokens, -1))


class TinyTransformer(nn.Module):
    def __init__(self, variant, use_fivar: bool, dtype, dim=64, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "norm1": nn.LayerNorm(dim), "attn": Attention(dim, heads, kv_heads, variant, use_fivar, dtype),
                "norm2": nn.LayerNorm(dim),
                "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))}))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        batch, seq = tokens.shape
        indptr = torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=tokens.device)
        x = self.embed(tokens.reshape(-1))
        for b in self.blocks:
            x = x + b["attn"](b["norm1"](x), indptr, seq)
            x = x + b["mlp"](b["norm2"](x))
        return self.head(x).view(batch, seq, VOCAB)


def batches(steps: int, batch: int, seq: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        block = torch.randint(0, VOCAB, (batch, PERIOD), generator=g)
        yield block.repeat(1, math.ceil(seq / PERIOD))[:, :seq].to(device)


def train(use_fivar: bool, steps: int, device, dtype, batch=32, seq=64, lr=1e-2) -> list[float]:
    torch.manual_seed(0)
    variant = learnable_copy(fivar.load("relative_bias"))
    model = TinyTransformer(variant, use_fivar, dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for tokens in batches(steps, batch, seq, device):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float16  # the interpreter has no bf16
    fivar_losses = train(True, args.steps, args.device, dtype)
    eager_losses = train(False, args.steps, args.device, dtype)
    print(f"{'step':>5}{'fivar':>10}{'eager':>10}")
    for i, (a, b) in enumerate(zip(fivar_losses, eager_losses)):
        if i % 5 == 0 or i == args.steps - 1:
            print(f"{i:>5}{a:>10.4f}{b:>10.4f}")
    gap = max(abs(a - b) for a, b in zip(fivar_losses, eager_losses))
    print(f"loss {fivar_losses[0]:.3f} -> {fivar_losses[-1]:.3f} (fivar), {eager_losses[0]:.3f} -> "
          f"{eager_losses[-1]:.3f} (eager); largest per-step gap {gap:.4f}")
    # "the same way": both fall, to within 5% of each other (bf16 attention inputs vs float32 eager)
    same = abs(fivar_losses[-1] - eager_losses[-1]) <= 0.05 * eager_losses[-1]
    falls = fivar_losses[-1] < 0.8 * fivar_losses[0] and eager_losses[-1] < 0.8 * eager_losses[0]
    print("PASS" if same and (falls or args.steps < 50) else "FAIL")
    return 0 if same and (falls or args.steps < 50) else 1


if __name__ == "__main__":
    raise SystemExit(main())
