// fivar: FlashInfer's FA2 single-prefill launcher entry, SinglePrefillWithKVCacheDispatched, whose
// DISPATCH_CTA_TILE_Q cases each call one flashinfer::fivar_single_prefill_tile (single_prefill_tile.cuh),
// explicitly instantiated in the kernel units, one unit per tile. Host code only: fivar.jit.build includes
// this file in the module's host unit.
//
// Mirrors FlashInfer 0.7.2, include/flashinfer/attention/prefill.cuh:2723-2750: the text between the
// "BEGIN/END FlashInfer preamble" markers is FlashInfer's (same tokens; fivar.jit.build checks it against
// the installed FlashInfer and renders FlashInfer's own unsplit instantiation if it differs), so the
// kCausal check and the tile choice (FA2DetermineCtaTileQ) are FlashInfer's. DISPATCH_CTA_TILE_Q is
// FlashInfer's macro (include/flashinfer/utils.cuh), so an unknown cta_tile_q fails the same way.
#pragma once
#include <flashinfer/attention/mask.cuh>
#include <flashinfer/pos_enc.cuh>
#include <flashinfer/utils.cuh>

namespace flashinfer {

template <uint32_t CTA_TILE_Q, uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, PosEncodingMode POS_ENCODING_MODE,
          bool USE_FP16_QK_REDUCTION, MaskMode MASK_MODE, typename AttentionVariant, typename Params>
cudaError_t fivar_single_prefill_tile(Params params, typename Params::DTypeO* tmp, cudaStream_t stream);

template <uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, PosEncodingMode POS_ENCODING_MODE,
          bool USE_FP16_QK_REDUCTION, MaskMode MASK_MODE, typename AttentionVariant,
          typename Params>
cudaError_t SinglePrefillWithKVCacheDispatched(Params params, typename Params::DTypeO* tmp,
                                               cudaStream_t stream) {
  // ---- BEGIN FlashInfer preamble (prefill.cuh:2728-2748) ----
  using DTypeQ = typename Params::DTypeQ;
  using DTypeKV = typename Params::DTypeKV;
  using DTypeO = typename Params::DTypeO;
  const uint32_t num_qo_heads = params.num_qo_heads;
  const uint32_t num_kv_heads = params.num_kv_heads;
  const uint32_t qo_len = params.qo_len;
  const uint32_t kv_len = params.kv_len;
  if (kv_len < qo_len && MASK_MODE == MaskMode::kCausal) {
    std::ostringstream err_msg;
    err_msg << "When mask_mode is set to MaskMode::kCausal, kv_len must be greater than or equal "
               "to qo_len, got kv_len"
            << kv_len << " and qo_len " << qo_len;
    FLASHINFER_ERROR(err_msg.str());
  }

  const uint32_t group_size = num_qo_heads / num_kv_heads;
  constexpr uint32_t NUM_MMA_D_QK = HEAD_DIM_QK / 16;
  constexpr uint32_t NUM_MMA_D_VO = HEAD_DIM_VO / 16;
  int64_t packed_qo_len = qo_len * group_size;
  uint32_t cta_tile_q =
      FA2DetermineCtaTileQ(packed_qo_len, HEAD_DIM_VO, HEAD_DIM_QK, sizeof(DTypeKV));
  // ---- END FlashInfer preamble ----

  DISPATCH_CTA_TILE_Q(cta_tile_q, CTA_TILE_Q, {
    return fivar_single_prefill_tile<CTA_TILE_Q, HEAD_DIM_QK, HEAD_DIM_VO, POS_ENCODING_MODE,
                                     USE_FP16_QK_REDUCTION, MASK_MODE, AttentionVariant>(
        params, tmp, stream);
  });
  return cudaSuccess;
}

}  // namespace flashinfer
