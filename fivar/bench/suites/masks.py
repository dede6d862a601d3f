"""The mask battery: masks real models and papers use that no special form covers (benchmarks/masks/*.py, written
with the public API as a user would) and seeded random masks drawn from the spec grammar (random_masks), on prefill
at S = 8192, bf16, head dim 128, GQA 32/8; the battery's masks where one query at the end means something also on
paged decode (batch 32 x 32768 keys).

Prefill contenders: fivar FA3 (the default call on sm90), FA2, FA3's tile-list form planned once, the Triton
twin, FlexAttention with its block mask from the same mask, and two stock FlashInfer
yardsticks computing other functions: `plain` (no mask over the whole square, causal where the case is) and
`plain-tiles` (FlashInfer's block-sparse wrapper, no mask, over the mask's non-empty 128 x 128 tiles found by brute
force on the device: what a kernel that skips every empty tile and masks nothing would take), checked against
attention restricted to those tiles. Every row's detail carries the mask's `kept_fraction` (pairs kept, of the whole
square) and `tile_fraction` (non-empty tiles, of all). Decode: fivar planned, the one-shot call, the Triton twin,
plain stock decode as the yardstick.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ...spec import ir
from ..contenders import AUTO, Contender
from ._attention import case
from . import random_masks

PREFILL_S = 8192
DECODE = (32, 32768)  # batch, keys per request
TILE = 128  # FA3's tile for head dim 128: the yardstick runs every tile the mask does not empty
RANDOM = (0, 30)  # seed, count
QUICK_RANDOM = 6


def masks_dir() -> Path:
    from ..runner import repo_root
    root = repo_root()
    return (root if root else Path.cwd()) / "benchmarks" / "masks"


def load(name: str):
    from ...registry import load_file
    return load_file(masks_dir() / f"{name}.py")


@dataclass(frozen=True)
class Entry:
    causal: bool
    decode: bool = False  # the last query's row is a mask of its own worth timing


BATTERY = {
    "causal_window_global": Entry(True, decode=True),
    "dilated_window": Entry(True, decode=True),
    "longformer_global": Entry(False, decode=True),
    "frame_causal": Entry(False),
    "document_window": Entry(True, decode=True),
    "bigbird": Entry(False),
    "strided_sparse": Entry(True, decode=True),
    "speculative_tree": Entry(True),
    "random_keys": Entry(True, decode=True),
    "longnet_heads": Entry(True, decode=True),
}


# -------------------------------------------------------------------------------------------- the tiles

def _tile_mask(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return params.tiles[q_idx // TILE, kv_idx // TILE] == 1


@lru_cache(maxsize=1)
def tiles_variant():
    """Attention restricted to a table of (TILE x TILE) tiles: the function the block-sparse yardstick computes."""
    from ...spec import AttentionVariant
    from ...spec.params import Tensor
    return AttentionVariant(name="mask_tiles", mask=_tile_mask,
                            params={"tiles": Tensor("int32", ("q_tile", "kv_tile"))})


def mask_tiles(variant, params: dict, *, seqlen: int, num_qo_heads: int, num_kv_heads: int, causal: bool,
               device, tile: int = TILE, rows: int = 1024) -> tuple[torch.Tensor, float]:
    """(tiles, kept): bool [tiles, tiles], the (tile x tile) blocks of one square request where the mask (and
    causal) keeps a pair for some head, and the share of all pairs kept (a mean over heads), by brute force: every
    pair evaluated by the torch reference's evaluator on `device`, `rows` query rows at a time."""
    from ...codegen.torch_ref import TorchEvaluator
    from ...runtime.params import bind_params
    b = bind_params(variant, params, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, batch_size=1,
                    device=device)
    mask = variant.ir.mask
    per_head = mask is not None and bool({"qo_head", "kv_head"} & ir.uses(mask))
    heads = num_qo_heads if per_head else 1
    h = torch.arange(heads, device=device).view(-1, 1, 1)
    kv = torch.arange(seqlen, device=device).view(1, 1, -1)
    n = -(-seqlen // tile)
    tiles = torch.zeros(n, n, dtype=torch.bool, device=device)
    kept = 0.0
    step = max(tile, rows // heads // tile * tile)  # whole tile rows, about `rows` x heads rows a chunk
    for lo in range(0, seqlen, step):
        q = torch.arange(lo, min(lo + step, seqlen), device=device).view(1, -1, 1)
        env = {"batch": torch.tensor(0, device=device), "qo_head": h, "kv_head": h // (num_qo_heads // num_kv_heads),
               "q_idx": q, "kv_idx": kv}
        keep = (TorchEvaluator(env, {**b.scalars, **b.tensors}, torch.float32, device).run(mask).bool()
                if mask is not None else torch.ones(1, 1, 1, dtype=torch.bool, device=device))
        keep = keep.expand(heads, q.shape[1], seqlen)
        if causal:
            keep = keep & (kv <= q)
        kept += float(keep.sum()) / heads
        any_head = torch.nn.functional.pad(keep.any(0), (0, n * tile - seqlen, 0, -q.shape[1] % tile))
        tiles[lo // tile: lo // tile + any_head.shape[0] // tile] = any_head.view(-1, tile, n, tile).any(3).any(1)
    return tiles, kept / seqlen / seqlen


def _yardsticks(variant, p) -> tuple[list[Contender], dict]:
    """The stock FlashInfer yardsticks of a prefill case and the mask's kept and non-empty-tile shares."""
    import flashinfer
    from ..contenders import selected
    if not (selected("plain") or selected("plain-tiles")):
        return [], {}
    if p.seqlen % TILE:  # FlashInfer's block-sparse wrapper takes whole key blocks
        raise ValueError(f"the tile yardstick needs a sequence length divisible by {TILE}, got {p.seqlen}")
    t = p.tensors
    q, k, v = t["q"], t["k"], t["v"]
    tiles, kept = mask_tiles(variant, p.params, seqlen=p.seqlen, num_qo_heads=p.num_qo_heads,
                             num_kv_heads=p.num_kv_heads, causal=p.causal, device=p.device)
    rows = tiles.sum(1)
    indptr = torch.cat([rows.new_zeros(1), rows.cumsum(0)]).to(torch.int32)
    indices = tiles.nonzero()[:, 1].to(torch.int32)
    w = flashinfer.BlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=p.device))
    w.plan(indptr, indices, p.seqlen, p.seqlen, TILE, TILE, p.num_qo_heads, p.num_kv_heads, p.head_dim,
           q_data_type=p.dtype, kv_data_type=p.dtype, o_data_type=p.dtype)
    out = [Contender("plain", lambda: flashinfer.single_prefill_with_kv_cache(q, k, v, causal=p.causal),
                     "plain attention over the whole square, stock FlashInfer (no mask: a yardstick)",
                     checks_variant=False),
           Contender("plain-tiles", lambda: w.run(q, k, v),
                     f"stock FlashInfer block-sparse, no mask, over the mask's non-empty {TILE}x{TILE} tiles "
                     "(a yardstick)", reference=(tiles_variant(), {"tiles": tiles.to(torch.int32)}, False))]
    return out, {"kept_fraction": kept, "tile_fraction": float(tiles.float().mean())}


# -------------------------------------------------------------------------------------------- the cases

def _prefill(name: str, loader, causal: bool):
    return case("masks", f"{name} prefill S={PREFILL_S}", loader, "prefill", PREFILL_S, causal,
                wanted=("triton", "flex"), stock=lambda p, s: None, baseline=("flex", "triton"), extra=_yardsticks)


def cases(quick: bool = False) -> list:
    out = []
    for name, e in BATTERY.items():
        out.append(_prefill(name, lambda n=name: load(n), e.causal))
        if e.decode:
            batch, kv = (DECODE[0], 8192) if quick else DECODE
            out.append(case("masks", f"{name} decode {batch}x{kv}", lambda n=name: load(n), "decode", kv,
                            batch=batch, wanted=("stock", "triton", "call"), stock=AUTO, baseline="triton"))
    seed, n = RANDOM
    drawn = random_masks.generate(seed, n)
    for m in drawn[:QUICK_RANDOM] if quick else drawn:
        out.append(_prefill(m.name, lambda m=m: random_masks.load(m), m.causal))
    return out
