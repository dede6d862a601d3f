// FA3 single prefill on a persistent grid: one CTA per SM walks the (query tile, head) tiles.
//
// FlashInfer launches FA3 single prefill with SingleTileScheduler: one CTA per tile, one CTA per SM (Q, K and V
// take ~160 KiB of shared memory at hd128). Each CTA then starts cold: barrier setup, then Q and the first K from
// memory before its first wgmma; and it ends with the epilogue's stores, with nothing of the next tile in flight.
// With few KV tiles per query tile (a sliding window of 1024 keys visits ~9) that fixed cost weighs. FlashInfer's
// kernel (PrefillWithKVCacheKernel) already runs a persistent loop for batch prefill: its producer warp loads the
// next tile's first K, then its Q as soon as the consumers are done with the current Q, while they still finish
// the current tile. This header gives single prefill that loop, with a scheduler that needs no plan and no
// workspace:
//
// - tiles in heavy-first order: the query tiles of a head from the last to the first when causal (a causal row's
//   cost grows with its index), from the first otherwise (a left window's cost falls with it; without one all cost
//   the same). Without a window, head after head (so the CTAs in flight share a few heads' K and V in L2). With a
//   window, query tile after query tile across the heads: every head's light tiles (the first ~window / CTA_Q,
//   whose windows are cut by the sequence start) come last, and K and V in flight are a window per head. Head-major,
//   the light tiles alias with the grid: 4096 rows in 192-row tiles are 22 per head, and 132 CTAs = 6 x 22, so
//   CTA c got the same query tile of six heads, heavy or light (a 28% longer makespan on 132 SMs, by the model below;
//   measured on an H200, 332 TF/s head-major vs 407 query-tile-major at S=4096, window 1024);
// - rounds of G = min(tiles, SMs) CTAs, boustrophedon: round r gives CTA c tile r * G + c when r is even and
//   r * G + G - 1 - c when odd, so a CTA that took one of the heavier tiles of a round takes one of the lighter of
//   the next. Static, so no counter to reset between launches, and two launches on two streams never share state.
//   benchmarks/tools/persistent_order.py models the makespans of these orders.
//
// The launcher is FlashInfer 0.7.2's SinglePrefillWithKVCacheKernelTraitsDispatched with the scheduler and grid
// swapped (fivar/codegen/fa3.py checks that function's text is still the one mirrored here).
#pragma once
#include <flashinfer/attention/hopper/prefill_sm90.cuh>

namespace fivar {

template <bool CAUSAL>
struct Fa3PersistentSingleScheduler {
  struct Params {
    int num_tiles, num_ctas, num_qo_tiles, qo_len, kv_len;
    bool qo_tile_major;
    cutlass::FastDivmod num_qo_tiles_divmod, num_qo_heads_divmod, group_size_fastdiv;
  };

  static Params make_params(int num_qo_tiles, int num_qo_heads, int qo_len, int kv_len, int group_size,
                            int window_left, int num_sm) {
    const int num_tiles = num_qo_tiles * num_qo_heads;
    return {num_tiles,
            num_tiles < num_sm ? num_tiles : num_sm,
            num_qo_tiles,
            qo_len,
            kv_len,
            /*qo_tile_major=*/window_left >= 0,
            cutlass::FastDivmod(num_qo_tiles),
            cutlass::FastDivmod(num_qo_heads),
            cutlass::FastDivmod(group_size)};
  }

  struct WorkTileInfo {
    int q_tile_idx = 0;
    int qo_head_idx = 0;
    int kv_head_idx = 0;
    int round = 0;
    int tile = 0;  // position in the heavy-first order

    CUTLASS_DEVICE bool is_valid(Params const& params) const { return tile < params.num_tiles; }

    CUTLASS_DEVICE auto get_block_coord(Params const& params) const {
      return cute::tuple{q_tile_idx,      qo_head_idx,   kv_head_idx,   /*qo_indptr=*/0,
                         /*kv_indptr=*/0, params.qo_len, params.kv_len, /*batch_idx=*/0};
    }
  };

  CUTLASS_DEVICE static WorkTileInfo tile_at(Params const& params, int round) {
    const int cta = int(blockIdx.x);
    const int tile = round * params.num_ctas + ((round & 1) ? params.num_ctas - 1 - cta : cta);
    int head, q_rank;
    if (params.qo_tile_major) {
      params.num_qo_heads_divmod(q_rank, head, tile);
    } else {
      params.num_qo_tiles_divmod(head, q_rank, tile);
    }
    const int q_tile_idx = CAUSAL ? params.num_qo_tiles - 1 - q_rank : q_rank;
    return {q_tile_idx, head, params.group_size_fastdiv.divide(head), round, tile};
  }

  CUTLASS_DEVICE Fa3PersistentSingleScheduler() {}

  CUTLASS_DEVICE WorkTileInfo get_initial_work(Params const& params) const { return tile_at(params, 0); }

  CUTLASS_DEVICE void init_consumer() const {}
  CUTLASS_DEVICE void prefetch_next_work(Params const&, WorkTileInfo&) const {}
  CUTLASS_DEVICE void broadcast_next_work(WorkTileInfo&) const {}

  template <bool is_producer = false>
  CUTLASS_DEVICE WorkTileInfo get_next_work(Params const& params, WorkTileInfo const& current) const {
    return tile_at(params, current.round + 1);
  }
};

template <typename KernelTraits, bool LEFT_SLIDING_WINDOW, bool CAUSAL, typename Params>
cudaError_t single_prefill_persistent(Params& params, cudaStream_t stream) {
  using namespace flashinfer;
  using DTypeO = typename KernelTraits::DTypeO;
  using Mainloop = CollectiveMainloop<typename Params::AdditionalParams, KernelTraits, CAUSAL>;
  using Epilogue = CollectiveEpilogue<KernelTraits>;
  using Scheduler = Fa3PersistentSingleScheduler<CAUSAL>;
  // no query rows (or heads): nothing to launch, and make_params' FastDivmod(0) would divide by zero on the host
  if (params.qo_len == 0 || params.num_qo_heads == 0) return cudaSuccess;
  typename Mainloop::Params mainloop_params = Mainloop::to_underlying_arguments(
      {params.q_ptr,
       get_gmem_layout(params.qo_len, params.num_qo_heads, KernelTraits::HEAD_DIM_QK, params.q_stride_n,
                       params.q_stride_h),
       params.k_ptr,
       get_gmem_layout(params.kv_len, params.num_kv_heads, KernelTraits::HEAD_DIM_QK, params.k_stride_n,
                       params.k_stride_h),
       params.v_ptr,
       get_gmem_layout(params.kv_len, params.num_kv_heads, KernelTraits::HEAD_DIM_VO, params.v_stride_n,
                       params.v_stride_h),
       params.window_left, params.additional_params});
  typename Epilogue::Params epilogue_params = Epilogue::to_underlying_arguments({
      static_cast<DTypeO*>(params.o_ptr),
      get_gmem_layout(params.qo_len, params.num_qo_heads, KernelTraits::HEAD_DIM_VO, params.o_stride_n,
                      params.o_stride_h),
      static_cast<float*>(params.lse_ptr),
      get_lse_gmem_layout(params.qo_len, params.num_qo_heads),
  });

  int device, num_sm;
  FLASHINFER_CUDA_CALL(cudaGetDevice(&device));
  FLASHINFER_CUDA_CALL(cudaDeviceGetAttribute(&num_sm, cudaDevAttrMultiProcessorCount, device));
  typename Scheduler::Params scheduler_params =
      Scheduler::make_params(cutlass::ceil_div(params.qo_len, KernelTraits::CTA_Q), params.num_qo_heads,
                             params.qo_len, params.kv_len, params.num_qo_heads / params.num_kv_heads,
                             LEFT_SLIDING_WINDOW ? int(params.window_left) : -1, num_sm);

  auto kernel = (void*)PrefillWithKVCacheKernel<Mainloop, Epilogue, KernelTraits, LEFT_SLIDING_WINDOW, CAUSAL,
                                                Scheduler>;
  int smem_size = sizeof(typename KernelTraits::SharedStorage);
  FLASHINFER_CUDA_CALL(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_size));
  dim3 grid_dims(scheduler_params.num_ctas);
  dim3 block_dims(KernelTraits::NUM_WARPS * 32);
  void* args[] = {&mainloop_params, &epilogue_params, &scheduler_params};
  FLASHINFER_CUDA_CALL(cudaLaunchKernel(kernel, grid_dims, block_dims, args, smem_size, stream));
  return cudaSuccess;
}

}  // namespace fivar
