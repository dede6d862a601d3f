"""What each path skips of a variant's mask, and how: the text of `fivar show NAME --explain`.

One line per path, read off the same analyses the runtime uses (fivar.spec.bounds' band, fivar.spec.sparsity's
block map, fivar.codegen's window forms), so the text cannot drift from what runs. Each path's decision is made
once (_fa3_form, _fa2_form, _decode_form, _triton_cut_tiles) and rendered twice: short (the default answer) and
long (--verbose).
"""
from __future__ import annotations

from ..codegen import fa2, fa3
from ..codegen.tile_list import TILE_WIDTH, reads_heads, runs_unmapped
from .attention import trims_decode_pages
from .decode_pages import HULL_SLACK
from ..spec import ir, sparsity
from ..spec.ir import format_expr
from ..spec.params import Scalar

#: The shape the block-map summary is shown at (a long prefill, FA3's 128-row tile, a 128-key tile).
SAMPLE_LEN, SAMPLE_Q_BLOCK, SAMPLE_KV_BLOCK = 8192, 128, 128


def _shifted(sign: int, e) -> str:
    """`q_idx + sign * e` as a person writes it: the sum flattened into terms, negations carried into their signs and
    constants summed (`q_idx`, `q_idx - 3`, `q_idx - params.w + 1`; never `q_idx + -3` or `q_idx - (-w)`)."""
    terms, const = [], 0

    def walk(x, s):
        nonlocal const
        if isinstance(x, ir.Const):
            const += s * x.value
        elif isinstance(x, ir.Unary) and x.op == "neg":
            walk(x.x, -s)
        elif isinstance(x, ir.Binary) and x.op in ("add", "sub"):
            walk(x.a, s)
            walk(x.b, s if x.op == "add" else -s)
        else:
            terms.append((s, format_expr(x)))
    walk(e, sign)
    if const:
        terms.append((1 if const > 0 else -1, str(abs(const))))
    return "q_idx" + "".join(f" {'+' if s > 0 else '-'} {t}" for s, t in terms)


def _band_text(v) -> str:
    band = v.kv_band
    sides = [f"kv_idx >= {_shifted(-1, band.left)}"] if band.left is not None else []
    sides += [f"kv_idx <= {_shifted(1, band.right)}"] if band.right is not None else []
    if not sides:
        return "the mask implies no band"
    return f"the mask {'is exactly' if band.exact else 'implies'} the band {' and '.join(sides)}"


def _block_map_shares(v, causal: bool = True) -> dict[str, str] | str | None:
    """The block map's share of empty, full and partial tiles at SAMPLE_LEN with the params' defaults; "per call"
    where it depends on tensors or params without defaults; None without a mask."""
    if v.ir.mask is None:
        return None
    read = {e.name if isinstance(e, ir.ScalarParam) else e.param for root in v.ir.mask.exprs() for e in ir.walk(root)
            if isinstance(e, (ir.ScalarParam, ir.Load))}  # the params the mask reads (the logits' do not matter)
    if any(not isinstance(v.params[n], Scalar) or v.params[n].default is None for n in read):
        return "per call"
    scalars = {n: p.default for n, p in v.scalar_params.items()}
    bm = sparsity.classify(v.ir.mask, qo_len=SAMPLE_LEN, kv_len=SAMPLE_LEN, q_block=SAMPLE_Q_BLOCK,
                           kv_block=SAMPLE_KV_BLOCK, scalars=scalars, causal=causal)
    c = bm.counts()
    total = sum(c.values())
    return {k: f"{100.0 * n / total:.1f}%" for k, n in c.items()}


def block_map_summary(v, causal: bool = True) -> str:
    """The block map at SAMPLE_LEN with the params' defaults, or why it is computed per call."""
    shares = _block_map_shares(v, causal)
    if shares is None:
        return "block map: no mask (causal only skips tiles)"
    if shares == "per call":
        return ("block map: depends on tensor params or params without defaults; the runtime reads it per call "
                "(fivar.spec.sparsity.classify)")
    return (f"block map ({SAMPLE_Q_BLOCK}x{SAMPLE_KV_BLOCK} tiles, S={SAMPLE_LEN}, causal, default params): "
            f"{shares['empty']} empty (never visited where a path skips), {shares['full']} full (no mask needed), "
            f"{shares['partial']} partial")


def _fa3_form(v) -> str:
    """How FA3 prefill runs this variant's mask: the one decision both the long and the short text key on."""
    if v.ir.mask is None:
        return "no mask"
    if v.scans_mask:
        return "tile list"
    if fa3.runs_as_window(v):
        return "window"
    return "band" if v.kv_band.left is not None else "every tile"


def _cut_tiles(v) -> str:
    return ("read their pairs from precomputed bits (one word per row and tile"
            + (", per query head" if fa3.mask_reads_head(v) else "") + ")")


def _fa3_short(v) -> str:
    form = _fa3_form(v)
    if form == "tile list":
        return ("fa3 prefill: tile-list form, a request per 128-row query tile over its non-empty 32-key tiles "
                "(device block map); whole tiles unmasked, cut tiles " + _cut_tiles(v)
                + " once per KV tile; no mask in the kernel: one module per logits and sink"
                + ("; causal documents as segments (kCausal)" if runs_unmapped(v) else "")
                + ("; a request per head where heads differ" if fa3.mask_reads_head(v) and not reads_heads(v) else ""))
    return "fa3 prefill: " + {
        "no mask": "FlashInfer's kernel; causal skips the upper triangle; no mask",
        "window": ("FlashInfer's sliding window (window_left from the band): skips tiles left of it; only its "
                   "boundary tiles are masked, no mask in the struct"),
        "band": ("FlashInfer's sliding-window schedule skips the tiles left of the band; the mask per element on "
                 "every tile visited"),
        "every tile": "FlashInfer's kernel visits every tile (causal: the lower triangle); the mask per element",
    }[form]


def _fa3_line(v) -> str:
    form = _fa3_form(v)
    if form == "no mask":
        return "fa3 prefill: causal only skips tiles (no mask)"
    if form == "tile list":
        return ("fa3 prefill (single, ragged, paged): the device block map (the mask on every 128-row x 32-key tile, "
                "causal and lengths folded in: empty, cut or whole) makes each query tile (192 rows at head_dim 64) a "
                "request of FA3's paged kernel over the keys of its non-empty tiles, read as pages of up to 32 keys (a "
                "paged cache through its page table), whole tiles first: keys of whole tiles keep every pair with one "
                "compare, keys of cut tiles " + _cut_tiles(v) + "; the plan's keys_read gives the keys read and "
                "what a request per query tile over all its keys would read")
    if form == "window":
        return ("fa3 prefill: FlashInfer's own sliding window (window_left = the band's left edge): tiles left of it "
                "are skipped, only its boundary tiles are masked, the struct carries no mask")
    if form == "band":
        return ("fa3 prefill: FlashInfer's sliding-window schedule skips the tiles left of the band (window_left from "
                "it); the mask runs element-wise on every tile visited")
    return "fa3 prefill: visits every tile (causal skips the upper triangle); the mask runs element-wise"


def _fa2_form(v) -> str:
    """How FA2 prefill runs this variant's mask: the one decision both the long and the short text key on."""
    if v.ir.mask is None:
        return "no mask"
    if v.scans_mask:
        return "tile list"
    return "causal window" if fa2.window_form(v) else "custom"


def _fa2_short(v) -> str:
    form = _fa2_form(v)
    unsplit = "" if form not in ("causal window", "custom") or v.kv_band.causal_window else "; non-causal runs unsplit"
    return "fa2 prefill: " + {
        "no mask": "FlashInfer's kernel; causal skips the tiles right of the diagonal; no mask",
        "tile list": ("tile-list form, as fa3's: a request per query tile (128 / GQA group rows) over its non-empty "
                      "32-key tiles (device block map), kNone; whole tiles unmasked, cut tiles " + _cut_tiles(v)
                      + "; causal documents as segments (kCausal, no mask)"),
        "causal window": ("window_left from the band skips tiles left of it; called causally, kCausal: tiles right of "
                          "the diagonal skipped, only cut tiles evaluate the mask"),
        "custom": ("window_left from the band skips tiles left of it; kCustom: the mask per element on every tile "
                   "visited, right of the diagonal included"),
    }[form] + unsplit


def _fa2_line(v) -> str:
    form = _fa2_form(v)
    if form == "no mask":
        return "fa2 prefill: causal only skips tiles (no mask)"
    if form == "tile list":
        return ("fa2 prefill (single, ragged; called causally): when the mask pre-pass finds that every row keeps "
                "exactly the keys from its segment's first key to itself (documents, chunks), a request of FA2's "
                "ragged kernel per segment in kCausal mode, as stock FA2 runs documents: no mask evaluated, the "
                "struct's key segments map each request back to q_idx and kv_idx. "
                "Otherwise (and paged): the tile-list form, as on fa3: the device block map makes each query tile "
                "(128 / GQA group rows, one FA2 query tile of packed rows) a request of FA2's paged kernel in kNone "
                "mode over the keys of its non-empty 32-key tiles, read as pages of up to 32 keys, whole tiles "
                "first: keys of whole tiles keep every pair with one compare, keys of cut tiles " + _cut_tiles(v)
                + ". A paged batch of one query a request runs decode's forms, an FP8 cache the block form "
                "(fivar.runtime.fa2_blocks: a query block a request over the pages it may keep)")
    how = ("; called causally (a causal window: however called) it runs in kCausal mode: the tiles right of the "
           "diagonal are skipped too, and only the tiles the window or the diagonal cut evaluate the mask"
           if form == "causal window" else
           "; kCustom mode: the mask runs on every tile visited, and the tiles right of the diagonal are visited")
    if not v.kv_band.causal_window:
        how += ("; a non-causal call runs unsplit (FlashInfer sizes a window's split-KV chunks for a causal window)")
    return ("fa2 prefill (ragged, paged; single runs as a batch of one): window_left = the band's left edge, so "
            "each query tile starts its KV loop there" + how)


def _decode_form(v) -> str:
    """How decode runs this variant's mask: the one decision both the long and the short text key on."""
    if v.ir.mask is None:
        return "no mask"
    if v.kv_band.exact and v.kv_band.left is not None:
        return "window"
    return "trimmed pages" if trims_decode_pages(v) else "every page"


def _decode_short(v) -> str:
    return "decode: " + {
        "no mask": "FlashInfer's paged kernel reads every page; no mask",
        "window": "the tensor-core paged kernel with window_left: reads only the window's pages, like stock decode",
        "trimmed pages": ("the pages the block map may keep (key-segments form; one run a request: kCausal, the mask "
                          "on its first and last tile, else on every key read)"
                          + ("; many runs: the tile list" if v.scans_mask else "")),
        "every page": "reads every page (the mask does not depend on the key position); the mask on every key",
    }[_decode_form(v)]


def _decode_line(v) -> str:
    form = _decode_form(v)
    if form == "no mask":
        return "decode: reads every page of each request"
    if form == "window":
        return ("decode: the tensor-core paged kernel with window_left = the band's left edge: it reads only the "
                "pages from q_idx - window_left on (FlashInfer's scheduler sizes each request's work by the window), "
                "like stock decode with window_left")
    if form == "trimmed pages":
        return ("decode (v.decode, and FA2 plans of one query per request): each request's pages are trimmed to "
                "those that may hold kept keys (the block map per page, on the device): the first run of such pages "
                "and the hull of the rest, read on the tensor-core paged kernel in the key-segments form "
                "(fivar.runtime.decode_pages), which maps each key back to its kv_idx; a mask keeping more than two "
                "runs would read the gaps after the first. A batch keeping one run a request (a chunk, a document) "
                "runs in kCausal mode, as stock decode runs a window: the mask is evaluated only on the first KV tile "
                "(a partial first page) and the last; two runs (sinks and a window) evaluate it on every key read"
                + (f"; where the hull would read more than {HULL_SLACK}x the keys of the {TILE_WIDTH}-key tiles "
                   "holding kept keys (global keys, a dilated or periodic pattern), the batch runs in the tile-list "
                   "form instead: only those tiles, whole ones with no mask, cut ones from their bits"
                   if v.scans_mask else ""))
    return "decode: reads every page of each request (the mask does not depend on the key position)"


def _triton_cut_tiles(v) -> tuple[bool, int]:
    """(whether the twin's cut tiles read the block map's bits, the mask's cost per pair): codegen.triton's choice."""
    from ..codegen.triton import TritonEmitter, reads_mask_bits
    return reads_mask_bits(v), TritonEmitter(v).mask_element_cost()


def _triton_short(v) -> str:
    from ..codegen.triton import MASK_BITS_COST
    if v.ir.mask is None or not v.scans_mask:
        return _triton_line(v)
    bits, cost = _triton_cut_tiles(v)
    return ("triton: a block map made on the device skips empty tiles, runs full ones unmasked; cut tiles "
            + (f"read precomputed bits (the mask: ~{cost} ops a pair > the bits' {MASK_BITS_COST})" if bits else
               f"evaluate the mask (~{cost} ops a pair <= the bits' {MASK_BITS_COST})"))


def _triton_line(v) -> str:
    if v.ir.mask is None:
        return "triton: causal only bounds the KV loop"
    if not v.scans_mask:
        return "triton: the band bounds the KV loop; only the tiles its edges cut evaluate the mask"
    from ..codegen.triton import MASK_BITS_COST
    bits, cost = _triton_cut_tiles(v)
    cut = (f"read the bits a pass over the mask stored for them (the mask costs about {cost} operations a pair, "
           f"more than the bits' {MASK_BITS_COST})" if bits else
           f"evaluate the mask (about {cost} operations a pair, no more than reading bits would cost)")
    return ("triton: the block map (made on the device from the mask, once per call signature and params): each "
            "query tile visits only its non-empty key tiles, the tiles the mask keeps whole with no mask at all, "
            "the tiles it cuts " + cut + ("; decode reads only the pages that may keep a key, from a list of them per "
                                          "request (any number of runs)" if trims_decode_pages(v) else ""))


def mask_skipping(v) -> list[str]:
    """`fivar show NAME --explain`'s lines on what each path skips and how."""
    return [
        f"mask: {_band_text(v)}",
        block_map_summary(v),
        _fa3_line(v),
        _fa2_line(v),
        _decode_line(v),
        _triton_line(v),
        ("one-shot calls (v.prefill, v.batch_prefill_*, v.decode): the plan of a call is kept (8 most recent) and "
         "reused for the same shapes, dtype, device, flags, scalar params and the same index/param tensors "
         "unchanged (identity and version counter: a tensor written in place is planned again)"),
        _mixed_line(v),
        _position_tables_line(v),
    ]


def _mixed_line(v) -> str:
    """How an auto paged batch of short and long requests runs (fivar.runtime.mixed)."""
    from .mixed import batch_dims
    dims = batch_dims(v)
    if dims is None:
        return ("paged batches, backend auto: one plan on FA3 (sm90) whatever the requests' query counts (the variant "
                "reads the request's index other than as a batch-sized tensor's row, which a part of the batch would "
                "renumber); short requests alone: FA2")
    rows = f" (each part with its requests' rows of {', '.join(sorted(dims))})" if dims else ""
    return ("paged batches, backend auto: requests of at most a quarter of FA3's query tile (decodes, drafts) run as "
            "an FA2 plan, which packs a GQA group's rows in one tile, the rest as an FA3 plan, each writing its rows of "
            f"one output{rows}, the FA2 part on a second stream where each part's rows are consecutive; short "
            "requests alone: FA2")


def short_paths(v) -> list[str]:
    """The short answer's lines on the mask and each path, keyed on the same decisions as mask_skipping's."""
    shares, band = _block_map_shares(v), _band_text(v).removeprefix("the mask ")
    if shares is None:
        mask = "mask: none"
    elif shares == "per call":
        mask = f"mask: {band}; block map made per call (it reads tensors or params without defaults)"
    else:
        mask = (f"mask: {band}; block map at S={SAMPLE_LEN}, causal: {shares['empty']} of "
                f"{SAMPLE_Q_BLOCK}x{SAMPLE_KV_BLOCK} tiles empty, {shares['full']} full, {shares['partial']} cut")
    out = [mask, _fa3_short(v), _fa2_short(v), _decode_short(v), _triton_short(v)]
    if v.lowered.position_tables:
        names = ", ".join(t.name for t in v.lowered.position_tables)
        out.append(f"position-only logits terms: tabulated once per call into {names}, gathered by fa2, fa3 and triton")
    return out


def _position_tables_line(v) -> str:
    """What the compiled targets do with logits terms of only the head and kv_idx - q_idx (fivar.spec.positions)."""
    from ..config import lowering_config
    mode = lowering_config().position_tables
    tables = v.lowered.position_tables
    if not tables:
        return (f"position-only logits terms: none tabulated (position_tables={mode!r}: none of the logits' terms of "
                "only the head and kv_idx - q_idx is costly enough); evaluated per element")
    terms = "; ".join(f"{format_expr(t.term.result)} -> {t.name}[{'qo_head' if t.per_head else '0'}, kv_idx - q_idx "
                      "+ offset]" for t in tables)
    return (f"position-only logits terms (position_tables={mode!r}): evaluated once per call (per plan for planned "
            f"calls) over every head and distance into a float32 table the fa2, fa3 and triton kernels gather from "
            f"(the reference evaluates the expression itself): {terms}")
