// Stands in for <cooperative_groups.h> in fivar's FA2 units.
//
// FlashInfer's FA2 prefill (include/flashinfer/attention/prefill.cuh) includes <cooperative_groups.h> for two names:
// cg::this_thread_block() and that group's sync(). The header brings the whole of cooperative groups and libcu++'s
// <cuda/atomic> with it, about an eighth of what nvcc parses for an FA2 prefill kernel unit.
//
// This file defines the header's include guard and those two names, as the CUDA header defines them
// (thread_block::sync() is details::cta::sync(), which is __barrier_sync(0)). fivar/jit/unused_headers.py includes
// it only after checking that the FlashInfer files a module reaches use nothing else of cooperative groups and that
// the toolkit's header has this guard; the kernels' SASS is the same as with the header (tests/unit/test_build.py).
#pragma once
#define _COOPERATIVE_GROUPS_H_

namespace cooperative_groups {

class thread_block {
 public:
  static __device__ __forceinline__ void sync() { __barrier_sync(0); }
};

__device__ __forceinline__ thread_block this_thread_block() { return thread_block(); }

}  // namespace cooperative_groups
