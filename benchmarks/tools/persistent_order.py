"""Makespan model of the tile orders a static persistent FA3 schedule can take (csrc/fivar_fa3_persistent.cuh).

Single prefill, causal, with a left window: each (query tile, head) costs the KV tiles it visits plus a fixed part;
the query tiles whose windows are cut by the sequence start are light. G = min(tiles, SMs) CTAs take the tiles in
rounds, CTA c tile r * G + c (or r * G + G - 1 - c in odd rounds, "snake"). The order is head-major (a head's tiles
heavy-first, then the next head) or query-tile-major (every head's heaviest tile, then the next query tile). The
makespan is the largest CTA's sum; "ideal" is the mean. Costs are in CTA_Q x CTA_KV steps, reported in 128 x 128
equivalents so tiles compare (not counting that one tile may run its steps faster than another).

    python3 benchmarks/tools/persistent_order.py [--sms 132] [--heads 32] [--window 1024] [--fixed 0.5]
"""
import argparse
import math


def tile_costs(seqlen, cta_q, cta_kv, window, fixed):
    """Cost of each query tile, heaviest first (causal: the last tile first)."""
    costs = []
    for i in range(math.ceil(seqlen / cta_q)):
        first_key = max(0, i * cta_q - window)
        end_key = min(seqlen, i * cta_q + cta_q)
        costs.append(fixed + math.ceil(end_key / cta_kv) - first_key // cta_kv)
    return costs[::-1]


def makespan(costs, heads, sms, qo_tile_major, snake):
    order = ([c for c in costs for _ in range(heads)] if qo_tile_major
             else [c for _ in range(heads) for c in costs])
    ctas = min(len(order), sms)
    load = [0.0] * ctas
    for tile, cost in enumerate(order):
        rnd, cta = divmod(tile, ctas)
        load[ctas - 1 - cta if snake and rnd % 2 else cta] += cost
    return max(load), sum(order) / ctas


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--fixed", type=float, default=0.5, help="a tile's fixed cost, in its own KV steps")
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--tiles", default="128x128,192x64")
    args = ap.parse_args()
    orders = [("head-major", False, False), ("head-major snake", False, True),
              ("q-tile-major", True, False), ("q-tile-major snake", True, True)]
    print(f"{args.sms} SMs, {args.heads} heads, window {args.window}, fixed {args.fixed}; makespan in 128x128 steps")
    print(f"{'S':>6} {'tile':>8} {'ideal':>7} " + " ".join(f"{name:>19}" for name, *_ in orders))
    for seqlen in map(int, args.seqlens.split(",")):
        for tile in args.tiles.split(","):
            cta_q, cta_kv = map(int, tile.split("x"))
            scale = cta_q * cta_kv / (128 * 128)
            costs = tile_costs(seqlen, cta_q, cta_kv, args.window, args.fixed)
            spans = [makespan(costs, args.heads, args.sms, major, snake) for _, major, snake in orders]
            ideal = spans[0][1] * scale
            print(f"{seqlen:>6} {tile:>8} {ideal:7.1f} "
                  + " ".join(f"{m * scale:12.1f} ({m * scale / ideal:4.2f})" for m, _ in spans))


if __name__ == "__main__":
    main()
