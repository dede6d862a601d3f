"""Seeded random masks drawn from the spec grammar, written as variant files and loaded like any user's.

A mask is `(<body>) or <anchor>`: the body combines (and / or / not, up to three levels) terms of the kinds real masks
are made of: causal, bounded, symmetric and offset bands of random widths, dilations and key strides (`%`), chunks
and frames (`//`), sinks (the first keys), global rows, and tensor lookups (per-key flags, per-position document
ids, a per-query left edge, a block table read at `[q_idx // B, kv_idx // B]`); the anchor (the diagonal, a sink,
or a short causal band) keeps a key in every row. Each mask comes with its source text (a `mask` function, an
`example` building its tensors from a seeded generator, the `variant`) and a plain torch evaluator of the same
expression written independently of fivar's, and is kept only if it keeps between 0.5% and 90% of the visible
pairs at the size it was drawn for (sampled rows, the evaluator's count). `generate(seed, n)` is deterministic.
"""
from __future__ import annotations

import math
import os
import random
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from ...errors import FivarError

SIZE = 8192  # the benchmark's sequence length: widths are drawn for it, and the kept share judged at it
MIN_KEPT, MAX_KEPT = 0.005, 0.90
SAMPLE_ROWS = 64  # enough to tell 0.5% from 90%; listing the suite draws every mask
MIN_SIZE = 32  # the narrowest widths drawn (4 to 16 keys) still cut inside the sequence
MAX_DRAWS = 50  # candidates per accepted mask before giving up (a grammar that cannot meet the bounds)


def _floordiv(a, b):
    return torch.div(a, b, rounding_mode="floor")


@dataclass(frozen=True)
class Tensor_:
    """A tensor param a term reads: its declaration and the example lines that build it (`g`: a seeded
    torch.Generator, `max_len`, `batch_size` in scope; the last line assigns the name)."""
    name: str
    dtype: str
    dims: tuple
    build: tuple


@dataclass(frozen=True)
class Term:
    text: str  # a bool expression of the spec language
    fn: Callable  # (q, kv, batch, params) -> bool tensor, q [R, 1] and kv [1, K] int64
    tensors: tuple = ()


def _width(r: random.Random, lo: int, hi: int) -> int:
    """Log-uniform in [lo, hi]: narrow and wide bands alike."""
    hi = max(lo, hi)
    return int(round(math.exp(r.uniform(math.log(lo), math.log(hi)))))


class _Drawer:
    def __init__(self, r: random.Random, size: int):
        self.r, self.size, self.count = r, size, 0

    def tname(self, kind: str) -> str:
        self.count += 1
        return f"{kind}{self.count}"

    def atom(self) -> Term:
        r, n = self.r, self.size
        kind = r.choice(["causal_band", "band", "symmetric", "offset_band", "dilation", "key_stride", "sink",
                         "global_rows", "chunk", "frame", "flags", "documents", "left_edge", "blocks"])
        if kind == "causal_band":
            w = _width(r, 4, n // 2)
            return Term(f"q_idx - kv_idx < {w}", lambda q, kv, b, P: q - kv < w)
        if kind == "band":
            w = _width(r, 4, n // 2)
            return Term(f"0 <= q_idx - kv_idx < {w}", lambda q, kv, b, P: (q - kv >= 0) & (q - kv < w))
        if kind == "symmetric":
            w = _width(r, 4, n // 4)
            return Term(f"abs(q_idx - kv_idx) < {w}", lambda q, kv, b, P: (q - kv).abs() < w)
        if kind == "offset_band":
            lo, w = _width(r, 4, n // 4), _width(r, 4, n // 4)
            return Term(f"{lo} <= q_idx - kv_idx < {lo + w}",
                        lambda q, kv, b, P: (q - kv >= lo) & (q - kv < lo + w))
        if kind == "dilation":
            s = r.randint(2, 64)
            o = r.randrange(s)
            return Term(f"(q_idx - kv_idx) % {s} == {o}", lambda q, kv, b, P: torch.remainder(q - kv, s) == o)
        if kind == "key_stride":
            s = r.randint(2, 256)
            o = r.randrange(s)
            return Term(f"kv_idx % {s} == {o}", lambda q, kv, b, P: torch.remainder(kv, s) == o)
        if kind == "sink":
            k = r.randint(1, 64)
            return Term(f"kv_idx < {k}", lambda q, kv, b, P: kv < k)
        if kind == "global_rows":
            k = r.randint(1, 64)
            return Term(f"q_idx < {k}", lambda q, kv, b, P: q < k)
        if kind == "chunk":
            c = _width(r, 16, n // 4)
            return Term(f"q_idx // {c} == kv_idx // {c}", lambda q, kv, b, P: _floordiv(q, c) == _floordiv(kv, c))
        if kind == "frame":
            c = _width(r, 16, n // 4)
            return Term(f"kv_idx // {c} <= q_idx // {c}", lambda q, kv, b, P: _floordiv(kv, c) <= _floordiv(q, c))
        if kind == "flags":
            name, d = self.tname("flags"), r.choice([64, 16, 4])
            t = Tensor_(name, "int32", ("position",),
                        (f"{name} = (torch.rand(max_len, generator=g) < 1 / {d}).to(torch.int32)",))
            return Term(f"params.{name}[kv_idx] == 1", lambda q, kv, b, P: P[name][kv] == 1, (t,))
        if kind == "documents":
            name, docs = self.tname("docs"), r.randint(2, 16)
            t = Tensor_(name, "int32", ("batch", "position"), (
                f"cuts = torch.randint(1, max(2, max_len), ({docs - 1},), generator=g)",
                "starts = torch.zeros(max_len, dtype=torch.int32)",
                "starts[cuts.clamp(max=max_len - 1)] = 1",
                f"{name} = starts.cumsum(0).to(torch.int32).repeat(batch_size, 1)"))
            return Term(f"params.{name}[batch, q_idx] == params.{name}[batch, kv_idx]",
                        lambda q, kv, b, P: P[name][b, q] == P[name][b, kv], (t,))
        if kind == "left_edge":
            name, w = self.tname("left"), _width(r, 8, n // 2)
            t = Tensor_(name, "int32", ("position",), (
                f"{name} = (torch.arange(max_len) - torch.randint(0, {w}, (max_len,), generator=g)).to(torch.int32)",))
            return Term(f"kv_idx >= params.{name}[q_idx]", lambda q, kv, b, P: kv >= P[name][q], (t,))
        # blocks: a random block table, as block-sparse models learn or pick them
        name, B, d = self.tname("blocks"), r.choice([32, 64, 128]), r.choice([16, 8, 4, 2])
        t = Tensor_(name, "int32", ("q_block", "kv_block"), (
            f"nb = (max_len + {B - 1}) // {B}",
            f"{name} = (torch.rand(nb, nb, generator=g) < 1 / {d}).to(torch.int32)"))
        return Term(f"params.{name}[q_idx // {B}, kv_idx // {B}] == 1",
                    lambda q, kv, b, P: P[name][_floordiv(q, B), _floordiv(kv, B)] == 1, (t,))

    def expr(self, depth: int) -> Term:
        r = self.r
        if depth == 0 or r.random() < 0.3:
            return self.atom()
        op = r.choice(["and", "or", "and", "or", "not"])
        a = self.expr(depth - 1)
        if op == "not":
            return Term(f"not ({a.text})", lambda q, kv, b, P: ~a.fn(q, kv, b, P), a.tensors)
        c = self.expr(depth - 1)
        fn = ((lambda q, kv, b, P: a.fn(q, kv, b, P) & c.fn(q, kv, b, P)) if op == "and" else
              (lambda q, kv, b, P: a.fn(q, kv, b, P) | c.fn(q, kv, b, P)))
        return Term(f"({a.text} {op} {c.text})", fn, a.tensors + c.tensors)

    def anchor(self) -> Term:
        r = self.r
        kind = r.choice(["diagonal", "sink", "band"])
        if kind == "diagonal":
            return Term("q_idx == kv_idx", lambda q, kv, b, P: q == kv)
        if kind == "sink":  # with the diagonal: a row before the sink keys (non-causal calls) keeps a key too
            k = r.choice([1, 4])
            return Term(f"kv_idx < {k} or q_idx == kv_idx", lambda q, kv, b, P: (kv < k) | (q == kv))
        w = r.randint(1, 16)
        return Term(f"0 <= q_idx - kv_idx < {w}", lambda q, kv, b, P: (q - kv >= 0) & (q - kv < w))


@dataclass
class RandomMask:
    """One generated mask: its variant file's text, how it is called, and an evaluator of its own."""
    name: str
    seed: int
    index: int
    size: int
    causal: bool
    source: str
    #: keep(q_idx, kv_idx, batch, params) -> bool: the mask (causal not applied), q_idx [R, 1], kv_idx [1, K] int64
    keep: Callable
    kept: float  # share of the visible pairs kept at `size` (sampled rows)
    example: Callable = field(repr=False, default=None)

    def keep_matrix(self, params: dict, qo_len: int, kv_len: int, batch: int = 0) -> torch.Tensor:
        """bool [qo_len, kv_len]: every pair, by this evaluator (bottom-right aligned, causal applied if called so)."""
        q = torch.arange(qo_len).view(-1, 1) + (kv_len - qo_len)
        kv = torch.arange(kv_len).view(1, -1)
        tensors = {k: v.long() for k, v in params.items() if isinstance(v, torch.Tensor)}
        keep = self.keep(q, kv, batch, tensors).expand(qo_len, kv_len)
        return keep & (kv <= q) if self.causal else keep

    def path(self, directory: Path | None = None) -> Path:
        return Path(directory or default_dir()) / f"{self.name}.py"


def _render(name: str, seed: int, size: int, causal: bool, body: Term, anchor: Term, ex_seed: int) -> tuple[str, str]:
    """(the variant file's text, the example function's text)."""
    tensors = {t.name: t for t in body.tensors}  # a term's tensor appears once even if the term does twice
    head = (f'"""Random mask {name} (seed {seed}, drawn for S = {size}), written by fivar.bench.suites.random_masks '
            f'and\nrewritten when it changes. Run {"causal" if causal else "non-causal"}."""\n')
    imports = ("import torch\n\nfrom fivar import AttentionVariant, Tensor\n" if tensors else
               "from fivar import AttentionVariant\n")
    mask = ("def mask(batch, qo_head, kv_head, q_idx, kv_idx, params):\n"
            f"    return {body.text} or {anchor.text}\n")
    example = ""
    if tensors:
        lines = [f"g = torch.Generator().manual_seed({ex_seed})"]
        for t in tensors.values():
            lines += list(t.build)
        ret = ", ".join(f'"{n}": {n}.to(device)' for n in tensors)
        example = ("def example(num_qo_heads, num_kv_heads, batch_size, max_len, device):\n"
                   + "".join(f"    {x}\n" for x in lines) + f"    return {{{ret}}}\n")
    dims = lambda t: "(" + ", ".join(f'"{d}"' for d in t.dims) + ("," if len(t.dims) == 1 else "") + ")"  # noqa: E731
    decls = "".join(f'    "{t.name}": Tensor("{t.dtype}", {dims(t)}),\n' for t in tensors.values())
    variant = (f'variant = AttentionVariant(name="{name}", mask=mask'
               + (", example=example" if tensors else "") + (", params={\n" + decls + "})\n" if tensors else ")\n"))
    return head + "\n" + imports + "\n\n" + "\n\n".join([mask] + ([example] if example else []) + [variant]), example


def _compile_example(text: str) -> Callable | None:
    if not text:
        return None
    ns = {"torch": torch}
    exec(compile(text, "<random mask example>", "exec"), ns)  # noqa: S102 - the text rendered just above
    return ns["example"]


def _kept(keep: Callable, params: dict, causal: bool, size: int) -> float:
    """Share of the visible pairs kept (causal: of the lower triangle), over SAMPLE_ROWS rows spread evenly."""
    rows = torch.linspace(0, size - 1, min(SAMPLE_ROWS, size)).round().long().view(-1, 1)
    kv = torch.arange(size).view(1, -1)
    tensors = {k: v.long() for k, v in params.items() if isinstance(v, torch.Tensor)}
    k = keep(rows, kv, 0, tensors).expand(rows.numel(), size)
    if causal:
        visible = kv <= rows
        return float((k & visible).sum()) / float(visible.sum())
    return float(k.float().mean())


def _name(seed: int, index: int, size: int) -> str:
    return f"rmask{seed}_{index:02d}" + ("" if size == SIZE else f"_n{size}")


@lru_cache(maxsize=16)
def _generate(seed: int, n: int, size: int) -> tuple:
    r = random.Random(f"fivar-random-masks-{seed}")
    out = []
    draws = 0
    while len(out) < n:
        draws += 1
        if draws > MAX_DRAWS * n:
            raise FivarError(f"random masks (seed {seed}, S={size}): {draws - 1} draws gave only {len(out)} masks "
                             f"keeping {MIN_KEPT:.1%}..{MAX_KEPT:.0%} of their pairs")
        d = _Drawer(r, size)
        body, anchor = d.expr(3), d.anchor()
        causal = r.random() < 0.5
        ex_seed = r.randrange(1 << 30)
        name = _name(seed, len(out), size)
        source, ex_text = _render(name, seed, size, causal, body, anchor, ex_seed)
        example = _compile_example(ex_text)
        params = example(1, 1, 1, size, "cpu") if example else {}
        keep = (lambda b_, a_: lambda q, kv, bi, P: b_.fn(q, kv, bi, P) | a_.fn(q, kv, bi, P))(body, anchor)
        kept = _kept(keep, params, causal, size)
        if MIN_KEPT <= kept <= MAX_KEPT:
            out.append(RandomMask(name, seed, len(out), size, causal, source, keep, kept, example))
    return tuple(out)


def generate(seed: int = 0, n: int = 30, size: int = SIZE) -> list[RandomMask]:
    """`n` random masks for `seed`, drawn for sequences of `size` tokens; the same list for the same arguments."""
    if not isinstance(seed, int) or not isinstance(n, int) or n < 0 or not isinstance(size, int) or size < MIN_SIZE:
        raise FivarError(f"random masks: seed must be an int, n an int >= 0 and size an int >= {MIN_SIZE}; got "
                         f"seed={seed!r}, n={n!r}, size={size!r}")
    return list(_generate(seed, n, size))


def default_dir() -> Path:
    from ...cache import cache_dir
    return cache_dir() / "bench" / "random_masks"


def write(mask: RandomMask, directory: Path | None = None) -> Path:
    """The mask's variant file, (re)written atomically where its text differs; returns its path."""
    path = mask.path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.read_text() == mask.source:
            return path
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(mask.source)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load(mask: RandomMask, directory: Path | None = None):
    """The mask's AttentionVariant, loaded from its file by fivar's registry as a user's file would be."""
    from ...registry import load_file
    return load_file(write(mask, directory))
