"""csrc/fivar_tile_mask.cuh's index arithmetic, replayed on the CPU: for every KV tile width FA3 uses, every thread's
scores of every tile the kernel visits read the right word and bit of CUT_BITS, and no read leaves the words the plan
writes (a request's own, the next request's, or the CUT_WORDS_PAST zeros after the last); and csrc/fivar_cut_bits.cuh
itself, compiled for the host, finds each score's bit in the words it is given."""
import random
import re
import shutil
import subprocess
import sys

import pytest

from fivar.paths import csrc_dir
from fivar.runtime.fa3_tile_list import CUT_WORDS_PAST

HEADER = (csrc_dir() / "fivar_cut_bits.cuh").read_text()
#: the KV tiles of FA3's paged kernel, which the tile-list form runs (96 keys at head dim 64 and 128, 32 at 256), and
#: other multiples of 8 the header takes, as a margin
WIDTHS = [32, 96, 64, 80, 128, 176, 192, 256]


def _slots(n: int) -> int:
    """The raw words a thread reads for a tile of n keys, as the header computes them."""
    expr = re.search(r"constexpr int RAW = (.+?);", HEADER).group(1)
    return eval(expr.replace("/", "//"), {"N": n})  # noqa: S307 - the header's own constant expression


def _thread_keeps(kv_last: int, whole: int, n: int, words_of) -> dict[int, int]:
    """{kv: kept} for the scores of one thread row of a tile, as the header reads them: RAW words from the thread's
    first key's, the score's bit at its key's offset from that word's first bit (CutBits' funnel shifts)."""
    c_first = kv_last - (n - 7) - whole
    w_first = c_first >> 5  # an arithmetic shift, as int32 >> in CUDA
    raw = [words_of(w_first + j) for j in range(_slots(n))]
    stream = sum(w << (32 * j) for j, w in enumerate(raw))
    out = {}
    for i in range(n // 8 * 4):  # the fragment ((2, 2, n / 8)): rows i >> 1 & 1 are the same keys
        if (i >> 1) & 1:
            continue
        p = (c_first & 31) + (i & 1) + 8 * (i >> 2)
        assert p >> 5 < len(raw), f"score {i}: bit {p} past the {len(raw)} words read"
        out[c_first + whole + (i & 1) + 8 * (i >> 2)] = (stream >> p) & 1
    return out


@pytest.mark.parametrize("n", WIDTHS)
def test_every_score_reads_its_own_bit_and_no_read_leaves_the_plan(n):
    rng = random.Random(n)
    for _ in range(200):
        keys = rng.randrange(1, 700)
        whole = 32 * rng.randrange(0, keys // 32 + 1) if rng.random() < 0.9 else -1  # -1: a request keeping none
        n_words = 0 if whole < 0 else (keys - whole + 31) // 32
        bits = [rng.getrandbits(32) for _ in range(n_words)]
        total = n_words + CUT_WORDS_PAST  # the last request's words and the zeros after them

        def words_of(w):
            if w < 0:
                return 0xFFFFFFFF  # a whole tile's word (fv_cut_word)
            if whole < 0:
                return 0  # a request keeping no key
            assert w < total, f"word {w} read past the {total} the plan writes ({keys} keys, {whole} whole, n={n})"
            return bits[w] if w < n_words else 0

        for tile in range((keys + n - 1) // n):  # every KV tile the kernel visits
            for lane in range(4):  # the thread's first key: 2 (lane % 4) into the tile
                kv_last = tile * n + 2 * lane + n - 7
                if kv_last < whole:
                    continue  # the header skips the tile: all its keys are whole
                for kv, kept in _thread_keeps(kv_last, whole, n, words_of).items():
                    if kv >= keys:
                        continue  # past the request's keys: FlashInfer masks them
                    want = 0 if whole < 0 else 1 if kv < whole else (bits[(kv - whole) >> 5] >> ((kv - whole) & 31)) & 1
                    assert kept == want, (n, keys, whole, tile, lane, kv)


def test_too_few_padding_words_fail_the_replay(monkeypatch):
    """The replay's bound is the plan's: with fewer zero words after the last request's, a tile reads past them."""
    monkeypatch.setattr(sys.modules[__name__], "CUT_WORDS_PAST", 2)
    with pytest.raises(AssertionError, match="read past"):
        test_every_score_reads_its_own_bit_and_no_read_leaves_the_plan(192)


_DRIVER = r"""
#include <cstdio>
#include <vector>
#include "fivar_cut_bits.cuh"
// one thread's tile as fivar_tile_mask.cuh masks it, its two rows' bits given as word lists (fv_cut_word's rules)
template <int N> void run(int kv_last, int whole, const std::vector<uint32_t> (&rows)[2]) {
  using Bits = fivar::CutBits<N>;
  if (kv_last < whole) { std::puts("whole"); return; }  // the updater skips the tile
  const int32_t c_first = Bits::first_key(kv_last, whole), w_first = Bits::word_of(c_first);
  uint32_t raw[2][Bits::RAW];
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < Bits::RAW; ++j) {
      const int32_t w = w_first + j;
      raw[r][j] = w < 0 ? ~0u : whole < 0 ? 0u : w < int32_t(rows[r].size()) ? rows[r][w] : 0u;
    }
  const Bits bits(raw, c_first);
  for (int i = 0; i < N / 2; ++i) std::putchar(bits.keeps(i) ? '1' : '0');
  std::putchar('\n');
}
int main() {
  int n, kv_last, whole, words;
  while (std::scanf("%d %d %d %d", &n, &kv_last, &whole, &words) == 4) {
    std::vector<uint32_t> rows[2];
    for (auto& row : rows) { row.resize(words); for (auto& w : row) if (std::scanf("%u", &w) != 1) return 1; }
    switch (n) {
CASES
      default: return 1;
    }
  }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler")
def test_cut_bits_keeps_exactly_each_scores_bit(tmp_path):
    """csrc/fivar_cut_bits.cuh compiled for the host, driven as fivar_tile_mask.cuh drives it (the thread's last
    score's key, the request's whole keys, its rows' bit words) over random requests, every KV tile and lane: each
    fragment value keeps exactly its row's bit of its key (every key of a whole tile, none where the request keeps
    none)."""
    cases = "\n".join(f"      case {n}: run<{n}>(kv_last, whole, rows); break;" for n in WIDTHS)
    (tmp_path / "driver.cpp").write_text(_DRIVER.replace("CASES", cases))
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", str(csrc_dir()), "-o", str(tmp_path / "driver"),
                    str(tmp_path / "driver.cpp")], check=True)
    rng = random.Random()
    lines, want = [], []
    for _ in range(60):
        n = rng.choice(WIDTHS)
        keys = rng.randrange(1, 700)
        whole = 32 * rng.randrange(0, keys // 32 + 1) if rng.random() < 0.9 else -1
        words = 0 if whole < 0 else (keys - whole + 31) // 32
        rows = [[rng.getrandbits(32) for _ in range(words)] for _ in range(2)]
        stream = [sum(w << (32 * j) for j, w in enumerate(row)) for row in rows]
        for tile in range((keys + n - 1) // n):
            for lane in range(4):
                kv_last = tile * n + 2 * lane + n - 7
                lines.append(f"{n} {kv_last} {whole} {words} " + " ".join(str(w) for row in rows for w in row))
                if kv_last < whole:
                    want.append("whole")
                    continue
                kv0 = kv_last - (n - 7)
                keep = []
                for i in range(n // 2):
                    kv = kv0 + (i & 1) + 8 * (i >> 2)
                    keep.append(0 if whole < 0 else 1 if kv < whole else (stream[(i >> 1) & 1] >> (kv - whole)) & 1)
                want.append("".join(map(str, keep)))
    got = subprocess.run([str(tmp_path / "driver")], input="\n".join(lines) + "\n", capture_output=True, text=True,
                         check=True).stdout.split()
    assert got == want
