"""csrc/fivar_cut_bits.cuh compiled for the host and driven as csrc/fivar_tile_mask.cuh drives it: for every KV tile
width FA3's paged kernel uses (and a margin of others), every thread's scores of every tile the kernel visits keep
exactly their row's bit of CUT_BITS, and no read leaves the words the plan writes (a request's own, the next
request's, or the CUT_WORDS_PAST zeros after the last)."""
import random
import shutil
import subprocess

import pytest

from fivar.paths import csrc_dir
from fivar.runtime.fa3_tile_list import CUT_WORDS_PAST

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler")
#: the KV tiles of FA3's paged kernel, which the tile-list form runs (96 keys at head dim 64 and 128, 32 at 256), and
#: other multiples of 8 the header takes, as a margin
WIDTHS = [32, 96, 64, 80, 128, 176, 192, 256]

_DRIVER = r"""
#include <cstdio>
#include <vector>
#include "fivar_cut_bits.cuh"
// one thread's tile as fivar_tile_mask.cuh masks it, its two rows' bits given as word lists (fv_cut_word's rules)
template <int N> void run(int kv_last, int whole, int past, const std::vector<uint32_t> (&rows)[2]) {
  using Bits = fivar::CutBits<N>;
  if (kv_last < whole) { std::puts("whole"); return; }  // the updater skips the tile
  const int32_t c_first = Bits::first_key(kv_last, whole), w_first = Bits::word_of(c_first);
  uint32_t raw[2][Bits::RAW];
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < Bits::RAW; ++j) {
      const int32_t w = w_first + j, written = int32_t(rows[r].size()) + past;  // the request's words, the zeros
      if (w >= 0 && whole >= 0 && w >= written) { std::printf("read-past-%d\n", w); return; }
      raw[r][j] = w < 0 ? ~0u : whole < 0 ? 0u : w < int32_t(rows[r].size()) ? rows[r][w] : 0u;
    }
  const Bits bits(raw, c_first);
  for (int i = 0; i < N / 2; ++i) std::putchar(bits.keeps(i) ? '1' : '0');
  std::putchar('\n');
}
int main() {
  int n, kv_last, whole, past, words;
  while (std::scanf("%d %d %d %d %d", &n, &kv_last, &whole, &past, &words) == 5) {
    std::vector<uint32_t> rows[2];
    for (auto& row : rows) { row.resize(words); for (auto& w : row) if (std::scanf("%u", &w) != 1) return 1; }
    switch (n) {
CASES
      default: return 1;
    }
  }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cases = "\n".join(f"      case {n}: run<{n}>(kv_last, whole, past, rows); break;" for n in WIDTHS)
    work = tmp_path_factory.mktemp("cut_bits")
    (work / "driver.cpp").write_text(_DRIVER.replace("CASES", cases))
    subprocess.run(["g++", "-std=c++17", "-O1", "-I", str(csrc_dir()), "-o", str(work / "driver"),
                    str(work / "driver.cpp")], check=True)
    return work / "driver"


def _run(driver, past: int, widths=WIDTHS, requests: int = 60) -> tuple[list[str], list[str]]:
    """(what the driver says, what each tile should keep) for every tile and lane of random requests: `past` zero
    words written after each request's (the bound a read must stay within)."""
    rng = random.Random()
    lines, want = [], []
    for _ in range(requests):
        n = rng.choice(widths)
        keys = rng.randrange(1, 700)
        whole = 32 * rng.randrange(0, keys // 32 + 1) if rng.random() < 0.9 else -1  # -1: a request keeping none
        words = 0 if whole < 0 else (keys - whole + 31) // 32
        rows = [[rng.getrandbits(32) for _ in range(words)] for _ in range(2)]
        stream = [sum(w << (32 * j) for j, w in enumerate(row)) for row in rows]
        for tile in range((keys + n - 1) // n):  # every KV tile the kernel visits
            for lane in range(4):  # the thread's first key: 2 (lane % 4) into the tile
                kv_last = tile * n + 2 * lane + n - 7
                lines.append(f"{n} {kv_last} {whole} {past} {words} " + " ".join(str(w) for row in rows for w in row))
                if kv_last < whole:
                    want.append("whole")  # the updater skips the tile
                    continue
                kv0 = kv_last - (n - 7)
                keep = []
                for i in range(n // 2):
                    kv = kv0 + (i & 1) + 8 * (i >> 2)
                    keep.append(0 if whole < 0 else 1 if kv < whole else (stream[(i >> 1) & 1] >> (kv - whole)) & 1)
                want.append("".join(map(str, keep)))
    got = subprocess.run([str(driver)], input="\n".join(lines) + "\n", capture_output=True, text=True,
                         check=True).stdout.split()
    return got, want


def test_cut_bits_keeps_exactly_each_scores_bit_and_reads_only_what_the_plan_writes(driver):
    """Each fragment value keeps exactly its row's bit of its key (every key of a whole tile, none where the request
    keeps none), and no tile reads past the CUT_WORDS_PAST zero words the plan writes after the last request's."""
    got, want = _run(driver, CUT_WORDS_PAST)
    assert not [g for g in got if g.startswith("read-past")], "a read past the plan's words"
    assert got == want


def test_too_few_padding_words_fail_the_bound(driver):
    """The bound is the plan's: with fewer zero words after the last request's, a wide tile reads past them."""
    got, _ = _run(driver, 2, widths=[192], requests=20)
    assert any(g.startswith("read-past") for g in got)
