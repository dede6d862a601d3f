// The tile-list form's mask on FA3, applied once per KV tile rather than once per score.
//
// FlashInfer's FA3 mainloop calls the variant's LogitsTransform on every score of every tile it visits, and the
// compiler predicates a mask written there: a cut tile's bit lookup is issued for every score of every tile, whole
// tiles too (2.8x the instructions of the unmasked main loop). The updater's update() is called once per tile with the
// thread's whole score fragment, right after those LogitsTransform calls: WithTileMask masks there, behind one
// branch a tile. LogitsTransform only records the indices of the thread's last score (fv_kv_last, fv_q_last: after
// inlining, one register move a tile); a tile whose keys all lie in the request's whole tiles (kv < fv_whole) skips
// the mask, any other reads the variant's fv_cut_word(q, word): the bits of keys fv_whole + 32 word .. + 31 of row q
// (all ones for a whole tile's word, none for a request keeping no key).
//
// A score's indices come from the last one's through the Hopper GMMA accumulator layout (PTX ISA, wgmma D fragment):
// a thread's fragment ((2, 2, N / 8), 1, 1) holds value (v0, v1, v2) at row +8 v1, key +v0 + 8 v2 from its first; the
// mainloop's own index loop walks it in that order, so the last score is (1, 1, N / 8 - 1), the thread's largest key.
// CutBits (fivar_cut_bits.cuh) lines the words up with the fragment once a tile, so each score costs one bit test.
#pragma once
#include <cute/tensor.hpp>

#include "fivar_cut_bits.cuh"

namespace fivar {

template <typename Updater, typename Variant>
struct WithTileMask : Updater {
  const Variant* fv_variant;

  CUTLASS_DEVICE WithTileMask(const Updater& updater, const Variant* variant)
      : Updater(updater), fv_variant(variant) {}

  template <bool init, typename Tensor0>
  __forceinline__ __device__ void update(Tensor0& acc_s) {
    static_assert(decltype(cute::rank(acc_s.layout()))::value == 3);
    static_assert(decltype(cute::size<0, 0>(acc_s))::value == 2 && decltype(cute::size<0, 1>(acc_s))::value == 2);
    static_assert(decltype(cute::size<1>(acc_s))::value == 1 && decltype(cute::size<2>(acc_s))::value == 1,
                  "one GMMA atom a thread in each dimension (FA3's consumer warpgroups, 64 rows each)");
    constexpr int N = 8 * decltype(cute::size<0, 2>(acc_s))::value;  // the tile's keys
    using Bits = CutBits<N>;
    const int32_t kv_last = fv_variant->fv_kv_last, whole = fv_variant->fv_whole;
    if (kv_last >= whole) {  // warp-uniform: a warp's last keys share one 32-key tile
      const int32_t q_last = fv_variant->fv_q_last;
      const int32_t c_first = Bits::first_key(kv_last, whole), w_first = Bits::word_of(c_first);
      // one load a (row, word) rather than one a score: the thread's two rows, Bits::RAW words each
      uint32_t raw[2][Bits::RAW];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j < Bits::RAW; ++j) raw[r][j] = fv_variant->fv_cut_word(q_last - 8 + 8 * r, w_first + j);
      const Bits bits(raw, c_first);
#pragma unroll
      for (int i = 0; i < cute::size(acc_s); ++i)
        if (!bits.keeps(i)) acc_s(i) = Updater::fill_value;
    }
    Updater::template update<init>(acc_s);
  }
};

}  // namespace fivar
