// fivar: ONE CTA_TILE_Q of FlashInfer's FA2 single-prefill launcher, so that each tile's kernels compile in a
// translation unit of their own (fivar.jit.build renders one per mask mode and tile from
// single_prefill_tile_inst.jinja).
//
// Mirrors FlashInfer 0.7.2, include/flashinfer/attention/prefill.cuh:2723-2925,
// SinglePrefillWithKVCacheDispatched. That function picks cta_tile_q at run time (FA2DetermineCtaTileQ) and
// switches over DISPATCH_CTA_TILE_Q {128, 64, 32, 16}, so the one unit that instantiates it compiles the
// launcher body, and the kernels it launches (one per NUM_MMA_KV), for every tile. Here it is cut at that
// switch:
//   - flashinfer::fivar_single_prefill_tile<CTA_TILE_Q, ...> (below) is the body for one tile. The text
//     between the "BEGIN/END FlashInfer DISPATCH_CTA_TILE_Q body" markers is FlashInfer's
//     (prefill.cuh:2751-2920), the same tokens: fivar.jit.build compares the two at generation time and
//     renders FlashInfer's own unsplit instantiation instead when the installed FlashInfer's text differs.
//     The lines above the marker are the locals of FlashInfer's preamble that the body reads
//     (prefill.cuh:2728-2734, 2743-2745; checked too).
//   - flashinfer::SinglePrefillWithKVCacheDispatched (single_prefill_dispatch.cuh, compiled in the host
//     unit) keeps FlashInfer's preamble (the kCausal check, FA2DetermineCtaTileQ) and its
//     DISPATCH_CTA_TILE_Q, each case calling the tile function instead of holding the body.
// Same tile choice, same kernels (the same SASS), same launch configuration and split-KV/MergeStates
// decision: only the translation unit each tile's code is compiled in differs.
#pragma once
#include <flashinfer/attention/prefill.cuh>

namespace flashinfer {

// In namespace flashinfer, like the function it is cut from, so every name in the body resolves as there.
template <uint32_t CTA_TILE_Q, uint32_t HEAD_DIM_QK, uint32_t HEAD_DIM_VO, PosEncodingMode POS_ENCODING_MODE,
          bool USE_FP16_QK_REDUCTION, MaskMode MASK_MODE, typename AttentionVariant, typename Params>
cudaError_t fivar_single_prefill_tile(Params params, typename Params::DTypeO* tmp, cudaStream_t stream) {
  using DTypeQ = typename Params::DTypeQ;
  using DTypeKV = typename Params::DTypeKV;
  using DTypeO = typename Params::DTypeO;
  const uint32_t num_qo_heads = params.num_qo_heads;
  const uint32_t num_kv_heads = params.num_kv_heads;
  const uint32_t qo_len = params.qo_len;
  const uint32_t kv_len = params.kv_len;
  const uint32_t group_size = num_qo_heads / num_kv_heads;
  constexpr uint32_t NUM_MMA_D_QK = HEAD_DIM_QK / 16;
  constexpr uint32_t NUM_MMA_D_VO = HEAD_DIM_VO / 16;
  // ---- BEGIN FlashInfer DISPATCH_CTA_TILE_Q body (prefill.cuh:2751-2920) ----
  {
    // hd512 uses the 2-Q x 2-KV-warp layout at CTA_TILE_Q=32. FP8 must take it
    // too: it stays on the split-D merge path whose cta_sync_o_smem buffer
    // (NUM_WARPS_KV x CTA_TILE_Q x 256 floats) only fits ~99KB-per-block parts
    // (SM120/121) with NUM_WARPS_KV=2. FP4 large-head single-prefill
    // additionally uses VO-split output so it avoids that cta_sync_o_smem
    // traffic entirely.
    constexpr bool kLargeHeadWarpSplit = ((sizeof(DTypeKV) <= 2) || is_fp4_type_v<DTypeKV>) &&
                                         (HEAD_DIM_VO >= 512) && (CTA_TILE_Q == 32);
    constexpr uint32_t NUM_WARPS_Q = kLargeHeadWarpSplit ? 2 : get_num_warps_q(CTA_TILE_Q);
    constexpr uint32_t NUM_WARPS_KV = kLargeHeadWarpSplit ? 2 : get_num_warps_kv(CTA_TILE_Q);
    constexpr uint32_t NUM_MMA_Q = kLargeHeadWarpSplit ? 1 : get_num_mma_q(CTA_TILE_Q);

    using DTypeQKAccum =
        typename std::conditional<USE_FP16_QK_REDUCTION && std::is_same_v<DTypeQ, half>, half,
                                  float>::type;

    int dev_id = 0;
    FLASHINFER_CUDA_CALL(cudaGetDevice(&dev_id));
    int max_smem_per_sm = 0;
    FLASHINFER_CUDA_CALL(cudaDeviceGetAttribute(
        &max_smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev_id));
    int max_smem_per_block_optin = 0;
    FLASHINFER_CUDA_CALL(cudaDeviceGetAttribute(&max_smem_per_block_optin,
                                                cudaDevAttrMaxSharedMemoryPerBlockOptin, dev_id));
    // we expect each sm execute two threadblocks
    // Per-NUM_MMA_KV K/V shared-memory cost, including the single 16-bit repack
    // staging buffer (sized max(HEAD_DIM_QK, HEAD_DIM_VO)) when the repack path is
    // active for this variant, so NUM_MMA_KV is chosen to keep base+staging within
    // the occupancy budget. Single prefill uses the repack for NVFP4 only, but the
    // buffer lives in SharedStorageQKVO for FP8 too, so it must be accounted.
    constexpr bool kUseRepack =
        use_kv_repack<DTypeKV, CTA_TILE_Q, HEAD_DIM_QK, HEAD_DIM_VO>(kPrefillLauncherRepacksFp4);
    constexpr bool kKVShared = !is_fp4_type_v<DTypeKV> && (HEAD_DIM_VO / 16 > 16) &&
                               ((HEAD_DIM_VO / 16) % NUM_WARPS_KV == 0) &&
                               (HEAD_DIM_QK == HEAD_DIM_VO) &&
                               (sizeof(DTypeKV) == 2 || CTA_TILE_Q > 16);
    constexpr bool kSinglePrefillVOSplitDispatch =
        AttentionVariant::use_softmax && is_fp4_type_v<DTypeKV> && (HEAD_DIM_VO / 16 > 16) &&
        ((HEAD_DIM_VO / 16) % NUM_WARPS_KV == 0);
    constexpr uint32_t kKVSmemPerMmaKV =
        (kKVShared ? (HEAD_DIM_QK * 16 * NUM_WARPS_KV * sizeof(DTypeKV))
                   : ((HEAD_DIM_QK + HEAD_DIM_VO) * 16 * NUM_WARPS_KV * sizeof(DTypeKV))) +
        (kUseRepack ? ((HEAD_DIM_QK > HEAD_DIM_VO ? HEAD_DIM_QK : HEAD_DIM_VO) * 16 * NUM_WARPS_KV *
                       sizeof(DTypeQ))
                    : 0u) +
        (is_fp4_type_v<DTypeKV>
             ? ((HEAD_DIM_QK + HEAD_DIM_VO) * 16 * NUM_WARPS_KV / NVFP4_SF_VEC_SIZE)
             : 0u) +
        (kSinglePrefillVOSplitDispatch ? CTA_TILE_Q * NUM_WARPS_KV * 16 * sizeof(DTypeQ) : 0u);
    constexpr uint32_t kSharedRopeFreqSmem = (POS_ENCODING_MODE == PosEncodingMode::kRoPELlama &&
                                              HEAD_DIM_QK > 256 && HEAD_DIM_QK == HEAD_DIM_VO)
                                                 ? (4u * (NUM_MMA_D_QK / 2) * 4u * sizeof(float))
                                                 : 0u;
    constexpr uint32_t kSinglePrefillVOSplitFixedSmem =
        kSinglePrefillVOSplitDispatch ? (NUM_WARPS_KV * CTA_TILE_Q * 8u + 2048u) : 0u;
    constexpr uint32_t kFixedSmem = CTA_TILE_Q * HEAD_DIM_QK * sizeof(DTypeQ) +
                                    kSinglePrefillVOSplitFixedSmem + kSharedRopeFreqSmem;
    // Smallest NUM_MMA_KV satisfying the FP8 alignment constraint
    // (sizeof(DTypeKV)==1 requires NUM_MMA_KV*2 % NUM_WARPS_Q == 0); size the
    // occupancy budget against the minimum *valid* tile so the staging buffer
    // can't shrink NUM_MMA_KV onto an invalid value on tight-smem parts (SM120).
    constexpr uint32_t kMinValidMmaKV =
        (sizeof(DTypeKV) == 1 && NUM_WARPS_Q > 2) ? (NUM_WARPS_Q / 2) : 1;
    const int num_ctas_per_sm =
        max_smem_per_sm >= 2 * (kFixedSmem + kMinValidMmaKV * kKVSmemPerMmaKV) ? 2 : 1;
    const int max_smem_per_threadblock =
        min(max_smem_per_sm / num_ctas_per_sm, max_smem_per_block_optin);

    const uint32_t max_num_mma_kv_reg =
        (HEAD_DIM_VO >= 128 && NUM_MMA_Q == 2 && POS_ENCODING_MODE == PosEncodingMode::kRoPELlama &&
         !USE_FP16_QK_REDUCTION)
            ? 2
            : (8 / NUM_MMA_Q);
    const int max_num_mma_kv_smem = (max_smem_per_threadblock - static_cast<int>(kFixedSmem)) /
                                    static_cast<int>(kKVSmemPerMmaKV);
    if (max_num_mma_kv_smem < 1) {
      std::ostringstream err_msg;
      err_msg << "Even the smallest KV tile for head_dim_qk=" << HEAD_DIM_QK
              << ", head_dim_vo=" << HEAD_DIM_VO << ", cta_tile_q=" << CTA_TILE_Q
              << " exceeds this GPU's " << max_smem_per_block_optin
              << " bytes of shared memory per block; this configuration is not supported on "
                 "this architecture.";
      FLASHINFER_ERROR(err_msg.str());
    }

    // control NUM_MMA_KV for maximum warp occupancy
    DISPATCH_NUM_MMA_KV(
        min(static_cast<uint32_t>(max_num_mma_kv_smem), max_num_mma_kv_reg), NUM_MMA_KV, {
          using KTraits =
              KernelTraits<MASK_MODE, CTA_TILE_Q, NUM_MMA_Q, NUM_MMA_KV, NUM_MMA_D_QK, NUM_MMA_D_VO,
                           NUM_WARPS_Q, NUM_WARPS_KV, POS_ENCODING_MODE, DTypeQ, DTypeKV, DTypeO,
                           DTypeQKAccum, typename Params::IdType, AttentionVariant,
                           kPrefillLauncherRepacksFp4>;
          if constexpr (KTraits::IsInvalid()) {
            // Invalid configuration, skip
            std::ostringstream err_msg;
            err_msg
                << "FlashInfer Internal Error: Invalid configuration : NUM_MMA_Q=" << NUM_MMA_Q
                << " NUM_MMA_D_QK=" << NUM_MMA_D_QK << " NUM_MMA_D_VO=" << NUM_MMA_D_VO
                << " NUM_MMA_KV=" << NUM_MMA_KV << " NUM_WARPS_Q=" << NUM_WARPS_Q
                << " NUM_WARPS_KV=" << NUM_WARPS_KV
                << " please create an issue (https://github.com/flashinfer-ai/flashinfer/issues)"
                   " and report it to the developers.";
            FLASHINFER_ERROR(err_msg.str());
          } else {
            constexpr uint32_t num_threads = (NUM_WARPS_Q * NUM_WARPS_KV) * WARP_SIZE;
            auto kernel = SinglePrefillWithKVCacheKernel<KTraits, Params>;
            using SmemStorage = std::conditional_t<KTraits::USE_SINGLE_PREFILL_SOFTMAX_VO_SPLIT,
                                                   typename KTraits::SharedStoragePaged,
                                                   typename KTraits::SharedStorage>;
            size_t smem_size = sizeof(SmemStorage);
            if (smem_size > (size_t)max_smem_per_block_optin) {
              std::ostringstream err_msg;
              err_msg << "Required shared memory (" << smem_size
                      << " bytes) for head_dim_qk=" << HEAD_DIM_QK
                      << ", head_dim_vo=" << HEAD_DIM_VO << ", cta_tile_q=" << CTA_TILE_Q
                      << " exceeds this GPU's per-block limit (" << max_smem_per_block_optin
                      << " bytes); this configuration is not supported on this architecture.";
              FLASHINFER_ERROR(err_msg.str());
            }
            FLASHINFER_CUDA_CALL(cudaFuncSetAttribute(
                kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_size));
            int num_blocks_per_sm = 0;
            int num_sm = 0;
            FLASHINFER_CUDA_CALL(
                cudaDeviceGetAttribute(&num_sm, cudaDevAttrMultiProcessorCount, dev_id));
            FLASHINFER_CUDA_CALL(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &num_blocks_per_sm, kernel, num_threads, smem_size));
            uint32_t max_num_kv_chunks = (num_blocks_per_sm * num_sm) /
                                         (num_kv_heads * ceil_div(qo_len * group_size, CTA_TILE_Q));
            uint32_t num_chunks;
            if (max_num_kv_chunks > 0) {
              uint32_t chunk_size = max(ceil_div(kv_len, max_num_kv_chunks), 256);
              num_chunks = ceil_div(kv_len, chunk_size);
            } else {
              num_chunks = 0;
            }

            if (num_chunks <= 1 || tmp == nullptr) {
              // Enough parallelism, do not split-kv
              params.partition_kv = false;
              void* args[] = {(void*)&params};
              dim3 nblks(ceil_div(qo_len * group_size, CTA_TILE_Q), 1, num_kv_heads);
              dim3 nthrs(32, NUM_WARPS_Q, NUM_WARPS_KV);
              FLASHINFER_CUDA_CALL(
                  cudaLaunchKernel((void*)kernel, nblks, nthrs, args, smem_size, stream));
            } else {
              // Use cooperative groups to increase occupancy
              params.partition_kv = true;
              float* tmp_lse = (float*)(tmp + num_chunks * qo_len * num_qo_heads * HEAD_DIM_VO);
              auto o = params.o;
              auto lse = params.lse;
              params.o = tmp;
              params.lse = tmp_lse;
              void* args[] = {(void*)&params};
              dim3 nblks(ceil_div(qo_len * group_size, CTA_TILE_Q), num_chunks, num_kv_heads);
              dim3 nthrs(32, NUM_WARPS_Q, NUM_WARPS_KV);

              FLASHINFER_CUDA_CALL(
                  cudaLaunchKernel((void*)kernel, nblks, nthrs, args, smem_size, stream));
              if constexpr (AttentionVariant::use_softmax) {
                FLASHINFER_CUDA_CALL(MergeStates(tmp, tmp_lse, o, lse, num_chunks, qo_len,
                                                 num_qo_heads, HEAD_DIM_VO, stream));
              } else {
                FLASHINFER_CUDA_CALL(
                    AttentionSum(tmp, o, num_chunks, qo_len, num_qo_heads, HEAD_DIM_VO, stream));
              }
            }
          }
        })
  }
  // ---- END FlashInfer DISPATCH_CTA_TILE_Q body ----
  return cudaSuccess;
}

}  // namespace flashinfer
