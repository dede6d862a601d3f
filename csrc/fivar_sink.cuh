// An attention sink on FA3: a logit per (request, query head) that joins the softmax denominator with no value row.
//
// FA3's variant interface has no output hook; the updater's finalize is where the row's sum becomes its 1/sum and
// its log-sum-exp. WithSink runs the wrapped updater's finalize (FlashInfer's OnlineSoftmax, or fivar's
// Fa3OnlineSoftmax), then adds the sink to what it left: with lse the keys' log2-sum-exp and s the sink (both log2),
// lse' = log2(2^lse + 2^s), and the output's factor 1/sum becomes 1/sum * 2^(lse - lse'). The LSE FA3 writes is lse',
// as in FlashInfer's own sink kernels. Once per row, after the KV loop: the loop itself is untouched.
//
// A query tile that visits no KV tile at all (kv_len 0, or every row of the tile above the causal diagonal when
// qo_len > kv_len) never reaches finalize: FlashInfer's epilogue writes zeros, as the reference does, but lse -inf
// where the reference (and FA2) has the sink's. Every row that visits a tile gets the sink.
#pragma once
#include "fivar_ops.cuh"

namespace fivar {

template <typename Updater>
struct WithSink : Updater {
  float log2_sink;

  CUTLASS_DEVICE WithSink(const Updater& updater, float log2_sink) : Updater(updater), log2_sink(log2_sink) {}

  template <typename Tensor0>
  __forceinline__ __device__ void finalize(Tensor0& acc_s, float pv_scale = 1.f) {
    Updater::finalize(acc_s, pv_scale);  // row_sum: the LSE (-inf for a row with nothing kept), scores_scale: 1/sum
#pragma unroll
    for (int mi = 0; mi < cute::size(this->row_sum); ++mi) {
      const float lse = this->row_sum(mi);
      const float top = ::fmaxf(lse, log2_sink);
      if (top == -INFINITY) continue;  // nothing kept and a -inf sink: zeros and -inf, as without it
      const float lse_new = top + log2f(exp2f(lse - top) + exp2f(log2_sink - top));
      this->scores_scale(mi) *= exp2f(lse - lse_new);
      this->row_sum(mi) = lse_new;
    }
  }
};

}  // namespace fivar
