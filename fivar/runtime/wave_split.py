"""FA3 single prefill's last wave, split along the keys so that it fills the GPU.

FA3's single prefill launches one CTA per (query tile, query head), one CTA per SM at a time, every CTA the same
length when nothing is masked. 32 heads × 128 query tiles of 128 rows (S=16384) are 4096 CTAs: 31 waves of 132 on
an H100 or H200 and a 32nd of 4, during which 128 SMs idle, about 3% of the kernel. The soft-caps run 192-row tiles
from 6144 rows (fivar.codegen.fa3.LONG_QO_LEN): at S=8192 that is 43 x 32 = 1376 CTAs, 10 waves and a 42% one.

When a variant's logits read nothing but the score and scalar params (soft-capping), the last few heads can run
as C shorter launches over a C-th of the keys each, whose outputs merge exactly through their log-sum-exp
(`fivar.triton_ops.merge_states`). The first heads launch on a stream of higher priority, so the GPU hands out
their CTAs first; the short pieces then fill the SMs as the full-length CTAs drain, and the kernel ends about when
the total work divided by the SM count says it should.

`plan` simulates that schedule (greedy, in launch order; costs in KV-tile times, with a per-CTA fixed cost and
one for the merge) and splits only when it gains at least MIN_GAIN. `FIVAR_FA3_WAVE_SPLIT=0` (or
`with wave_split(False)`) turns it off; `=TxC` forces T tail heads in C chunks (to measure the cost model).
"""
from __future__ import annotations

import functools
import heapq
import math
import re
from dataclasses import dataclass

import torch

from .. import config
from ..errors import FivarError
from ..spec import ir

ENV = config.ENV["wave_split"]
CHUNK_COUNTS = (2, 4, 8)  # powers of two: the merge kernel's chunk axis is a tl.arange
MIN_CHUNK_TILES = 4  # shorter pieces are mostly prologue and epilogue
CTA_FIXED_TILES = 2.0  # a CTA's fixed cost (Q load, first wgmma's wait, epilogue), in KV-tile times
MERGE_TILES = 8.0  # the merge and the streams' join, in KV-tile times (~2 us each at hd128 on an H100)
MIN_GAIN = 0.015


@dataclass(frozen=True)
class WaveSplit:
    tail_heads: int  # the last query heads, run as `chunks` launches over a chunk of the keys each
    chunks: int
    makespan: float  # estimated, in KV-tile times (NaN when forced)


def applies(variant, causal: bool, window_left: int, schedule: str = "grid") -> bool:
    """A variant whose output does not depend on which keys a launch sees beside their scores: softmax, no mask,
    no window, logits from the score and scalar params only (kv_idx, heads and tensor params would be off in a
    launch over a slice), on FlashInfer's grid (a persistent kernel holds every SM to its end, so the tail's
    launches could only start after it)."""
    low = variant.lowered
    if causal or window_left >= 0 or not variant.softmax or low.mask is not None or schedule != "grid" \
            or variant.sink is not None:  # each launch over a slice of the keys would add the sink again
        return False
    from ..flashinfer_compat import active
    if not (active("single_prefill_run") and active("fa3_flashinfer_tiles")):  # launches and plans as FlashInfer
        return False
    return low.logits is None or ir.uses(low.logits) <= {"score", *(f"params.{n}" for n in variant.scalar_params)}


def _setting(variant_name: str) -> tuple[int, int] | bool:
    """FIVAR_FA3_WAVE_SPLIT: "0" off, "1" or unset `plan`'s choice, "TxC" T tail heads in C chunks wherever the
    split applies (for measuring the plan's cost model)."""
    text, where = config.setting("wave_split")
    text = text.lower()
    if text in ("", *config.ON_WORDS, *config.OFF_WORDS):
        return text not in config.OFF_WORDS
    m = re.fullmatch(r"(\d+)x(\d+)", text)
    if not m or int(m.group(2)) not in CHUNK_COUNTS or int(m.group(1)) < 1:
        raise FivarError(f"variant '{variant_name}': {where}={text!r}: expected 0, 1 (or off, on) or TxC (tail heads x chunks, "
                         f"chunks one of {', '.join(map(str, CHUNK_COUNTS))})")
    return int(m.group(1)), int(m.group(2))


def wave_split(on: bool | str = True):
    """Within the block, FA3 single prefill splits its last wave as planned (True), never (False), or as
    "TxC" says."""
    return config.override(wave_split=on)


def _makespan(full_ctas: int, full_len: float, pieces: int, piece_len: float, sms: int) -> float:
    """When the last SM finishes: `full_ctas` CTAs of `full_len`, then `pieces` of `piece_len`, each handed to
    the SM that frees first."""
    waves, rest = divmod(full_ctas, sms)
    free = [waves * full_len] * (sms - rest) + [(waves + 1) * full_len] * rest
    heapq.heapify(free)
    for _ in range(pieces):
        heapq.heapreplace(free, free[0] + piece_len)
    return max(free)


@functools.lru_cache(maxsize=256)
def plan(q_tiles: int, num_qo_heads: int, group_size: int, kv_tiles: int, sms: int) -> WaveSplit | None:
    """The split (this module's docstring) for one launch shape, or None where it would not gain MIN_GAIN. Tail heads
    come in whole KV-head groups (each piece is one GQA launch); the tail need not be more than four waves."""
    full_len = kv_tiles + CTA_FIXED_TILES
    unsplit = math.ceil(q_tiles * num_qo_heads / sms) * full_len
    best = None
    for tail in range(group_size, num_qo_heads, group_size):
        if q_tiles * tail > 4 * sms:
            break
        for chunks in CHUNK_COUNTS:
            if kv_tiles < MIN_CHUNK_TILES * chunks:
                break
            t = _makespan(q_tiles * (num_qo_heads - tail), full_len, q_tiles * tail * chunks,
                          math.ceil(kv_tiles / chunks) + CTA_FIXED_TILES, sms) + MERGE_TILES
            if best is None or t < best.makespan:
                best = WaveSplit(tail, chunks, t)
    return best if best is not None and best.makespan <= unsplit * (1 - MIN_GAIN) else None


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


_streams: dict = {}


def _first_stream(device) -> torch.cuda.Stream:
    """A stream of higher priority than a default one: its CTAs are handed out before the pieces' on the caller's
    stream (a default-priority one)."""
    s = _streams.get(device)
    if s is None:
        s = _streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return s


def plan_for(variant, q, k, tile: tuple[int, int]) -> WaveSplit | None:
    """The split for a launch of q [qo_len, H, D] against k [kv_len, H_kv, D] with FA3 CTA tile (q, kv)."""
    setting = _setting(variant.name)
    heads, group, kv_tiles = q.shape[1], q.shape[1] // k.shape[1], -(-k.shape[0] // tile[1])
    if isinstance(setting, tuple):
        tail, chunks = setting
        if tail % group or tail >= heads or kv_tiles < chunks:
            raise FivarError(f"variant '{variant.name}': {ENV}={tail}x{chunks}: the tail must be whole KV-head groups "
                             f"({group} query heads each) short of all {heads} heads, and there are {kv_tiles} KV "
                             f"tiles to cut into {chunks}")
        return WaveSplit(tail, chunks, float("nan"))
    if not setting:
        return None
    return plan(-(-q.shape[0] // tile[0]), heads, group, kv_tiles, _sm_count(q.device.index))


def run(launch, q, k, v, out, split: WaveSplit, kv_tile: int) -> torch.Tensor:
    """`launch(q, k, v, o, lse)` (one FA3 single-prefill launch, writing o and, if given, lse) on the first heads
    and on `split.chunks` key chunks (whole KV tiles) of the last `split.tail_heads`, merged into `out`; returns
    `out`."""
    from ..triton_ops.merge_states import merge_states
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    first, first_kv = heads - split.tail_heads, (heads - split.tail_heads) // group
    caller = torch.cuda.current_stream(q.device)
    stream = _first_stream(q.device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        launch(q[:, :first], k[:, :first_kv], v[:, :first_kv], out[:, :first], None)
    qo_len, kv_len = q.shape[0], k.shape[0]
    o_parts = out.new_empty((split.chunks, qo_len, split.tail_heads, v.shape[-1]))
    lse_parts = torch.empty((split.chunks, qo_len, split.tail_heads), dtype=torch.float32, device=q.device)
    tiles = -(-kv_len // kv_tile)
    edges = [min(kv_len, j * tiles // split.chunks * kv_tile) for j in range(split.chunks + 1)]
    q_tail, k_tail, v_tail = q[:, first:], k[:, first_kv:], v[:, first_kv:]
    for j in range(split.chunks):
        keys = slice(edges[j], edges[j + 1])
        launch(q_tail, k_tail[keys], v_tail[keys], o_parts[j], lse_parts[j])
    merge_states(o_parts, lse_parts, out[:, first:])
    caller.wait_stream(stream)
    return out
