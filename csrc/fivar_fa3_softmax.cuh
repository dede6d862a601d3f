// FA3's online softmax, with two things FlashInfer's OnlineSoftmax does not do.
//
// 1. Part of its exp2s move off the MUFU pipe. A Hopper SM quadrant finishes one warp-wide MUFU op per 8 cycles
// (16 lanes per SM) against one FMA-pipe op per cycle. A plain softmax spends one MUFU op per score (exp2); a
// logits transform that itself needs MUFU (tanh for soft-capping, exp for sigmoid) doubles that, and per tile the
// MUFU pipe then takes about as long as the two wgmmas. Computing 2^x for some score columns with fivar::exp2_fma
// (3 FADD, 3 FFMA, a clamp and an LEA, no MUFU) moves work to the FMA pipe; those slots are busy too, so only a
// small share pays (2 of 8 columns on an H200: fivar/codegen/fa3.py EXP2_EMULATED_OF_8). Which columns is a
// compile-time choice per unrolled column, so no branch is taken at run time.
//
// 2. BOUNDED: a logits transform that stays in [lo, hi] (fivar/spec/ranges.py; soft-capping's tanh) uses hi as a
// row max that never moves. Each tile then skips the max reduction (an FMNMX per score, two shuffles per row),
// the rescale factor (a MUFU op per row) and the rescale of the row sum and the output accumulator (an FMUL per
// output element). The host launches such a kernel only when the range times the softmax scale is narrow enough
// that no probability underflows (fivar.codegen.fa3.bounded_softmax_applies).
//
// finalize and the LSE are FlashInfer's OnlineSoftmax; so is everything when neither applies.
#pragma once
#include "fivar_ops.cuh"

namespace fivar {

template <int NUM_ROWS_PER_THREAD, int EMULATED_OF_8, bool BOUNDED = false>
struct Fa3OnlineSoftmax : flashinfer::OnlineSoftmax<NUM_ROWS_PER_THREAD, /*WITH_SCALE=*/true> {
  using Base = flashinfer::OnlineSoftmax<NUM_ROWS_PER_THREAD, /*WITH_SCALE=*/true>;
  static_assert(EMULATED_OF_8 >= 0 && EMULATED_OF_8 <= 8, "emulate 0 to 8 of every 8 columns");
  float fixed_max_scaled = 0.f;  // BOUNDED: hi * sm_scale_log2, subtracted from every scaled logit
  bool finalized = false;

  CUTLASS_DEVICE Fa3OnlineSoftmax(float sm_scale_log2) : Base(sm_scale_log2) {
    static_assert(!BOUNDED, "the bounded softmax takes the bound");
  }
  CUTLASS_DEVICE Fa3OnlineSoftmax(float sm_scale_log2, float hi) : Base(sm_scale_log2) {
    static_assert(BOUNDED, "a bound is for the bounded softmax");
    fixed_max_scaled = hi * sm_scale_log2;
  }

  template <typename Tensor0>
  __forceinline__ __device__ void exp2_row(Tensor0& scores, int mi, float max_scaled) {
#pragma unroll
    for (int ni = 0; ni < cute::size<1>(scores); ++ni) {
      const float x = scores(mi, ni) * this->sm_scale_log2 - max_scaled;
      scores(mi, ni) = (ni % 8) < EMULATED_OF_8 ? exp2_fma(x) : exp2f(x);
    }
  }

  template <typename Tensor0, typename Tensor1>
  __forceinline__ __device__ void exp2_rows(Tensor0& scores, const Tensor1& row_max) {
#pragma unroll
    for (int mi = 0; mi < cute::size<0>(scores); ++mi) {
      // a fully masked row (max -inf) gives exp2(-inf) = 0, as in FlashInfer's scale_apply_exp2
      exp2_row(scores, mi, ::fmaxf(row_max(mi) * this->sm_scale_log2, -cuda::std::numeric_limits<float>::max()));
    }
  }

  template <bool init, typename Tensor0>
  __forceinline__ __device__ void update(Tensor0& acc_s) {
    auto scores = cute::make_tensor(acc_s.data(), flashinfer::convert_layout_acc_rowcol(acc_s.layout()));
    static_assert(decltype(cute::size<0>(scores))::value == NUM_ROWS_PER_THREAD);
    if constexpr (BOUNDED) {  // the row sum needs no rescale: every tile's probabilities share the one max
#pragma unroll
      for (int mi = 0; mi < cute::size<0>(scores); ++mi) {
        if constexpr (init) this->row_max(mi) = fixed_max_scaled / this->sm_scale_log2;  // for the LSE
        exp2_row(scores, mi, fixed_max_scaled);
      }
      flashinfer::reduce_sum<init, /*warp_reduce=*/false>(scores, this->row_sum);
    } else if constexpr (init) {
      flashinfer::reduce_max</*init=*/true>(scores, this->row_max);
      exp2_rows(scores, this->row_max);
      flashinfer::reduce_sum</*init=*/true, /*warp_reduce=*/false>(scores, this->row_sum);
    } else {
      auto previous_max = cute::make_fragment_like(this->row_max);
      cute::copy(this->row_max, previous_max);
      flashinfer::reduce_max</*init=*/false>(scores, this->row_max);
#pragma unroll
      for (int mi = 0; mi < cute::size(this->row_max); ++mi) {
        const float current = ::fmaxf(this->row_max(mi), -cuda::std::numeric_limits<float>::max());
        this->scores_scale(mi) = exp2f((previous_max(mi) - current) * this->sm_scale_log2);
        this->row_sum(mi) *= this->scores_scale(mi);
      }
      exp2_rows(scores, this->row_max);
      flashinfer::reduce_sum</*init=*/false, /*warp_reduce=*/false>(scores, this->row_sum);
    }
  }

  template <typename Tensor0>
  __forceinline__ __device__ void finalize(Tensor0& acc_s, float pv_scale = 1.f) {
    Base::finalize(acc_s, pv_scale);
    finalized = true;
  }

  // The mainloop rescales the output after every update; with the fixed max only finalize's 1/sum is due.
  template <typename Tensor1>
  __forceinline__ __device__ void rescale_o(Tensor1& acc_o) {
    if (BOUNDED && !finalized) return;
    Base::rescale_o(acc_o);
  }
};

}  // namespace fivar
