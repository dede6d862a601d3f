// FA2 prefill with its KV tile chosen at compile time.
//
// FlashInfer's FA2 prefill launchers (single prefill, batch prefill paged and ragged) pick NUM_MMA_KV, the KV tile
// width, at run time from the device's shared memory, through DISPATCH_NUM_MMA_KV (include/flashinfer/utils.cuh).
// So every CTA tile instantiates a kernel for each NUM_MMA_KV in {1, 2, 4, 8}, and nvcc compiles all of them,
// though a GPU only ever runs one per CTA tile: an FA2 single-prefill unit holds 11 prefill kernels of which an
// H100 or H200 runs 3.
//
// When every arch of a build has the same shared memory (fivar/jit/pinned_kv_tiles.py sets
// FIVAR_PINNED_SMEM_PER_SM and FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN in the unit, before this header), the macro below
// replaces DISPATCH_NUM_MMA_KV: it makes FlashInfer's choice at compile time, from the same locals of the launcher
// it expands in (kFixedSmem, kKVSmemPerMmaKV, kMinValidMmaKV, max_num_mma_kv_reg; 0.7.4 adds its token-head-scale
// terms) and the same steps (fivar/flashinfer_compat/fa2_launchers.py checks that every launcher computes them
// this way, in 0.7.2's or 0.7.4's form), and instantiates that one
// kernel. At run time FlashInfer's own choice, from the device, must agree, or the launch fails with a message:
// another GPU never silently runs a kernel picked for different hardware.
#pragma once
#include <flashinfer/utils.cuh>

#include <sstream>

#if !defined(FIVAR_PINNED_SMEM_PER_SM) || !defined(FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN)
#error "fivar_pinned_kv_tiles.cuh needs FIVAR_PINNED_SMEM_PER_SM and FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN"
#endif

namespace fivar {

// DISPATCH_NUM_MMA_KV's cases: the largest of 8, 4, 2, 1 not above max_mma_kv; 0 when none fits.
constexpr uint32_t num_mma_kv_case(uint32_t max_mma_kv) {
  return max_mma_kv >= 8 ? 8 : max_mma_kv >= 4 ? 4 : max_mma_kv >= 2 ? 2 : max_mma_kv >= 1 ? 1 : 0;
}

// FlashInfer's launcher steps with the build's shared memory in place of the device's. The last three arguments are
// 0.7.4's FP8 token-head-scale steps (USE_TOKEN_HEAD_SF): without them, 0.7.2's launcher.
constexpr uint32_t pinned_num_mma_kv(uint32_t fixed_smem, uint32_t kv_smem_per_mma_kv, uint32_t min_valid_mma_kv,
                                     uint32_t max_num_mma_kv_reg, bool token_head_sf = false,
                                     uint32_t kv_smem_no_repack = 0, uint32_t scale_smem_per_mma_kv = 0) {
  // the repack staging buffer goes where the minimum tile with the scales does not fit one block
  const bool fits_with_scale = (fixed_smem + min_valid_mma_kv * (kv_smem_per_mma_kv + scale_smem_per_mma_kv)) <=
                               static_cast<uint32_t>(FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN);
  const uint32_t kv_effective = token_head_sf && !fits_with_scale ? kv_smem_no_repack : kv_smem_per_mma_kv;
  // num_ctas_per_sm: int against uint32_t compares as unsigned, as in FlashInfer
  const int ctas_per_sm =
      FIVAR_PINNED_SMEM_PER_SM >= 2 * (fixed_smem + min_valid_mma_kv * kv_smem_per_mma_kv) ? 2 : 1;
  const int per_sm_share = FIVAR_PINNED_SMEM_PER_SM / ctas_per_sm;
  const int smem_per_threadblock =
      per_sm_share < FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN ? per_sm_share : FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN;
  int max_num_mma_kv_smem =
      (smem_per_threadblock - static_cast<int>(fixed_smem)) / static_cast<int>(kv_effective);
  if (token_head_sf) {  // and the scales within one block's opt-in limit
    const int with_scale = (FIVAR_PINNED_SMEM_PER_BLOCK_OPTIN - static_cast<int>(fixed_smem)) /
                           static_cast<int>(kv_effective + scale_smem_per_mma_kv);
    max_num_mma_kv_smem = with_scale < max_num_mma_kv_smem ? with_scale : max_num_mma_kv_smem;
  }
  if (max_num_mma_kv_smem < 1) return 0;
  const uint32_t fit = static_cast<uint32_t>(max_num_mma_kv_smem);
  return num_mma_kv_case(fit < max_num_mma_kv_reg ? fit : max_num_mma_kv_reg);
}

inline std::string pinned_mismatch(uint32_t cta_tile_q, uint32_t pinned, uint32_t device_max) {
  std::ostringstream msg;
  msg << "fivar: this FA2 module was compiled for GPUs with " << FIVAR_PINNED_SMEM_PER_SM
      << " bytes of shared memory per SM, whose KV tile for CTA_TILE_Q=" << cta_tile_q << " is NUM_MMA_KV="
      << pinned << ", but on this GPU FlashInfer picks NUM_MMA_KV=" << num_mma_kv_case(device_max)
      << ": build it for this GPU's arch (--arch / FLASHINFER_CUDA_ARCH_LIST), or with FIVAR_PIN_KV_TILES=0";
  return msg.str();
}

}  // namespace fivar

// the launcher's locals the steps read (FIVAR_PINNED_TOKEN_HEAD_SF: the installed launchers take 0.7.4's steps)
#ifdef FIVAR_PINNED_TOKEN_HEAD_SF
#define FIVAR_PINNED_STEP_LOCALS                                                                          \
  kFixedSmem, kKVSmemPerMmaKV, kMinValidMmaKV, max_num_mma_kv_reg, USE_TOKEN_HEAD_SF, kKVSmemPerMmaKVNoRepack, \
      kScaleSmemPerMmaKV
#else
#define FIVAR_PINNED_STEP_LOCALS kFixedSmem, kKVSmemPerMmaKV, kMinValidMmaKV, max_num_mma_kv_reg
#endif

#undef DISPATCH_NUM_MMA_KV
#define DISPATCH_NUM_MMA_KV(max_mma_kv, NUM_MMA_KV, ...)                                                  \
  {                                                                                                       \
    constexpr size_t NUM_MMA_KV = fivar::pinned_num_mma_kv(FIVAR_PINNED_STEP_LOCALS);                     \
    if (fivar::num_mma_kv_case(max_mma_kv) != NUM_MMA_KV) {                                               \
      FLASHINFER_ERROR(fivar::pinned_mismatch(CTA_TILE_Q, NUM_MMA_KV, max_mma_kv));                       \
    } else if constexpr (NUM_MMA_KV != 0) {                                                               \
      __VA_ARGS__                                                                                         \
    }                                                                                                     \
  }
