// A thread's kept bits of one FA3 KV tile, lined up with its score fragment (csrc/fivar_tile_mask.cuh).
//
// The thread's scores of an N-key tile sit at keys c + p from its first key c, p = (i & 1) + 8 (i >> 2) for its
// fragment's value i (the thread's second row reads the same keys). Their bits start at bit `off` = c % 32 of the
// word holding key c. Shifting each pair of raw words by `off` once a tile (a funnel shift) puts score i's bit of
// row r at a position known at compile time: word i >> 4, bit (i & 1) + 8 ((i >> 2) & 3). The per-score test is
// then one bit test of a register, however the tile starts against the 32-key words.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define FIVAR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FIVAR_HOST_DEVICE inline
#endif

namespace fivar {

template <int N>
struct CutBits {
  static_assert(N % 8 == 0, "a KV tile is a whole number of GMMA atoms (8 keys)");
  // raw 32-key words a thread's keys can touch from its first key's word (its first key is even: off <= 30)
  static constexpr int RAW = (N - 7 + 30) / 32 + 1;
  static constexpr int ALIGNED = (N + 31) / 32;  // words of bits from the thread's first key on
  uint32_t aligned[2][ALIGNED];

  // the thread's first key of a tile counted from the request's cut keys, from its last score's key (the fragment
  // walks keys +(i & 1) + 8 (i >> 2), so its last is N - 7 past its first): negative where the tile holds whole keys
  static FIVAR_HOST_DEVICE int32_t first_key(int32_t kv_last, int32_t whole) { return kv_last - (N - 7) - whole; }
  // the word holding cut key c (an arithmetic shift: negative, a whole tile's word)
  static FIVAR_HOST_DEVICE int32_t word_of(int32_t c) { return c >> 5; }

  // raw[r][j]: row r's word word_of(c_first) + j
  FIVAR_HOST_DEVICE CutBits(const uint32_t (&raw)[2][RAW], int32_t c_first) {
    const int off = c_first & 31;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int j = 0; j < ALIGNED; ++j) {
        // a word past RAW holds no key of the thread's: its bits are never tested
        const uint64_t pair = (uint64_t(j + 1 < RAW ? raw[r][j + 1] : 0u) << 32) | raw[r][j];
        aligned[r][j] = uint32_t(pair >> off);
      }
  }

  // whether fragment value i (the thread's row (i >> 1) & 1) is kept
  FIVAR_HOST_DEVICE bool keeps(int i) const {
    return (aligned[(i >> 1) & 1][i >> 4] >> ((i & 1) + 8 * ((i >> 2) & 3))) & 1u;
  }
};

}  // namespace fivar
