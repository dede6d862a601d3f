// fivar fused norm / residual / RoPE / FP8 kernels (memory bound: one pass, 16-byte vectors, fp32 math).
//
// Two kernel shapes, both specialised at compile time by the rendered module (fusion_*.cu.jinja):
//  * row_kernel:  one CTA per token row; optional residual add (written back), rmsnorm / gemma /
//                 layernorm over the row, output in the input dtype or fp8 e4m3 (clamp(y / scale)).
//                 Each thread keeps K 16-byte vectors of the row in registers; warp shuffles + smem
//                 reduce the sums; the row is read once and written once.
//  * head_kernel: a group of lanes (a power of two <= 32) per (token, head) of q and k; each lane holds
//                 two 16-byte chunks of the head. NeoX partners (i, i + rotary_dim/2) are placed in the
//                 same lane, GPT-J pairs sit inside a chunk, so norm then RoPE run in registers with
//                 only the norm's group shuffle. In place on strided q/k views (packed QKV) or into a
//                 separate (fp8) output.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fivar_fusion {

enum NormKind { kNormNone = 0, kRMSNorm = 1, kGemmaRMSNorm = 2, kLayerNorm = 3 };
enum RopeKind { kRopeNone = 0, kRopeNeox = 1, kRopeGptj = 2 };

constexpr float kFp8Max = 448.f;  // e4m3fn

template <typename T>
struct Pack;

template <>
struct Pack<nv_bfloat16> {
  static __device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __bfloat1622float2(p[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
    uint4 v;
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};

template <>
struct Pack<half> {
  static __device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
    const __half2* p = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __half22float2(p[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
    uint4 v;
    __half2* p = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
  }
};

__device__ __forceinline__ uint2 pack_fp8(const float (&f)[8], float inv_scale) {
  float c[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) c[i] = fminf(fmaxf(f[i] * inv_scale, -kFp8Max), kFp8Max);
  __nv_fp8x4_e4m3 a(make_float4(c[0], c[1], c[2], c[3]));
  __nv_fp8x4_e4m3 b(make_float4(c[4], c[5], c[6], c[7]));
  uint2 r;
  r.x = a.__x;
  r.y = b.__x;
  return r;
}

template <typename T>
__device__ __forceinline__ void load8(const T* ptr, float (&f)[8]) {
  Pack<T>::unpack(*reinterpret_cast<const uint4*>(ptr), f);
}

template <typename T>
__device__ __forceinline__ void load8_ro(const T* ptr, float (&f)[8]) {  // read-only data (weights)
  Pack<T>::unpack(__ldg(reinterpret_cast<const uint4*>(ptr)), f);
}

// Store 8 values: in the input dtype (16 bytes) or as fp8 (8 bytes).
template <bool FP8, typename T, typename O>
__device__ __forceinline__ void store8(O* ptr, const float (&f)[8], float inv_scale) {
  if constexpr (FP8) {
    *reinterpret_cast<uint2*>(ptr) = pack_fp8(f, inv_scale);
  } else {
    *reinterpret_cast<uint4*>(ptr) = Pack<T>::pack(f);
  }
}

template <int WIDTH>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Sum over the CTA; every thread gets the result. `red` holds >= 33 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = group_sum<32>(v);
  __syncthreads();  // `red` may still be read from a previous reduction
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? red[lane] : 0.f;
    t = group_sum<32>(t);
    if (lane == 0) red[32] = t;
  }
  __syncthreads();
  return red[32];
}

// ------------------------------------------------------------------------------------------------
// Row kernel: one CTA per row of `hidden` elements (hidden % 8 == 0, hidden <= K * 8 * blockDim.x).
template <typename T, typename O, int K, int NORM, bool RESIDUAL, bool FP8>
__global__ void __launch_bounds__(K == 8 ? 1024 : 512) row_kernel(const T* x, int64_t stride_x,
                                                   T* __restrict__ residual, int64_t stride_r,
                                                   const T* __restrict__ weight,
                                                   const T* __restrict__ bias, O* out, int64_t stride_o,
                                                   const float* __restrict__ scale, int hidden, float eps) {
  __shared__ float red[33];
  const int64_t row = blockIdx.x;
  const int nvec = hidden >> 3;
  const T* xr = x + row * stride_x;
  float v[K][8];
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int idx = k * blockDim.x + threadIdx.x;
    if (idx < nvec) {
      load8(xr + idx * 8, v[k]);
      if constexpr (RESIDUAL) {
        T* rr = residual + row * stride_r + idx * 8;
        float r[8];
        load8(rr, r);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[k][j] += r[j];
        *reinterpret_cast<uint4*>(rr) = Pack<T>::pack(v[k]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[k][j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += NORM == kLayerNorm ? v[k][j] : v[k][j] * v[k][j];
  }
  const float inv_n = 1.f / float(hidden);
  float mean = 0.f, rstd;
  if constexpr (NORM == kLayerNorm) {
    mean = block_sum(sum, red) * inv_n;
    float var = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (k * (int)blockDim.x + (int)threadIdx.x < nvec) {
#pragma unroll
        for (int j = 0; j < 8; ++j) var += (v[k][j] - mean) * (v[k][j] - mean);
      }
    }
    rstd = rsqrtf(block_sum(var, red) * inv_n + eps);
  } else {
    rstd = rsqrtf(block_sum(sum, red) * inv_n + eps);
  }
  float inv_scale = 1.f;
  if constexpr (FP8) inv_scale = 1.f / __ldg(scale);
  O* orow = out + row * stride_o;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int idx = k * blockDim.x + threadIdx.x;
    if (idx < nvec) {
      float w[8], y[8];
      load8_ro(weight + idx * 8, w);
      if constexpr (NORM == kLayerNorm) {
        float b[8];
        load8_ro(bias + idx * 8, b);
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = (v[k][j] - mean) * rstd * w[j] + b[j];
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          y[j] = v[k][j] * rstd * (NORM == kGemmaRMSNorm ? 1.f + w[j] : w[j]);
      }
      store8<FP8, T>(orow + idx * 8, y, inv_scale);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Head kernel: q [T, Hq, D] and k [T, Hk, D] views (last stride 1), outputs likewise.
template <typename T, typename O, typename IdT>
struct HeadParams {
  T* q;
  T* k;
  O* q_out;
  O* k_out;
  int64_t q_s0, q_s1, k_s0, k_s1, qo_s0, qo_s1, ko_s0, ko_s1;
  const IdT* positions;
  const float* cos_sin;
  int64_t cs_s0;
  int max_pos;
  const T* q_weight;
  const T* k_weight;
  const T* q_bias;
  const T* k_bias;
  const float* scale;
  int num_tokens, hq, hk;
  float eps;
};

constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }

template <int HEAD_DIM>
struct HeadLayout {
  static constexpr int kChunks = HEAD_DIM / 8;                // 16-byte chunks per head
  static constexpr int kLanes = kChunks / 2;                  // lanes doing work (2 chunks each)
  static constexpr int kGroup = next_pow2(kLanes);            // lanes per head (power of two)
  static constexpr int kHeadsPerWarp = 32 / kGroup;
  static constexpr int kThreads = 256;
  static constexpr int kHeadsPerBlock = kThreads / 32 * kHeadsPerWarp;
  static_assert(HEAD_DIM % 16 == 0 && kLanes <= 32, "head_dim must be a multiple of 16, <= 512");
};

template <int ROT_DIM>
__device__ __forceinline__ void gptj_rotate(float (&x)[8], int chunk, const float* cs) {
  if (chunk * 8 >= ROT_DIM) return;  // pass-through part of a partial rotary head
  const float4 c = __ldg(reinterpret_cast<const float4*>(cs + chunk * 4));
  const float4 sn = __ldg(reinterpret_cast<const float4*>(cs + ROT_DIM / 2 + chunk * 4));
  const float cc[4] = {c.x, c.y, c.z, c.w}, ss[4] = {sn.x, sn.y, sn.z, sn.w};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float x1 = x[2 * m], x2 = x[2 * m + 1];
    x[2 * m] = x1 * cc[m] - x2 * ss[m];
    x[2 * m + 1] = x2 * cc[m] + x1 * ss[m];
  }
}

template <typename T, typename O, typename IdT, int HEAD_DIM, int ROT_DIM, int NORM, int ROPE, bool FP8>
__global__ void __launch_bounds__(256) head_kernel(const HeadParams<T, O, IdT> p) {
  using L = HeadLayout<HEAD_DIM>;
  constexpr int NP = ROT_DIM / 16;  // NeoX: chunk pairs (c, c + NP) rotated together
  const int lane = threadIdx.x & 31;
  const int sub = lane % L::kGroup;
  const int64_t task = int64_t(blockIdx.x) * L::kHeadsPerBlock + (threadIdx.x >> 5) * L::kHeadsPerWarp +
                       lane / L::kGroup;
  const int nh = p.hq + p.hk;
  const bool active = sub < L::kLanes && task < int64_t(p.num_tokens) * nh;
  // Chunks this lane holds. NeoX: lane < NP holds a rotary pair; the rest hold the pass-through part.
  int ca, cb;
  if (ROPE == kRopeNeox && sub < NP) {
    ca = sub;
    cb = sub + NP;
  } else if (ROPE == kRopeNeox) {
    ca = 2 * NP + (sub - NP);
    cb = ca + (L::kLanes - NP);
  } else {
    ca = sub;
    cb = sub + L::kLanes;
  }
  int64_t tok = 0;
  int h = 0;
  if (active) {
    tok = task / nh;
    h = int(task - tok * nh);
  }
  const bool is_q = h < p.hq;
  T* src = is_q ? p.q + tok * p.q_s0 + int64_t(h) * p.q_s1 : p.k + tok * p.k_s0 + int64_t(h - p.hq) * p.k_s1;
  O* dst = is_q ? p.q_out + tok * p.qo_s0 + int64_t(h) * p.qo_s1
                : p.k_out + tok * p.ko_s0 + int64_t(h - p.hq) * p.ko_s1;
  float a[8], b[8];
  if (active) {
    load8(src + ca * 8, a);
    load8(src + cb * 8, b);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = b[j] = 0.f;
  }
  if constexpr (NORM != kNormNone) {
    const T* w = is_q ? p.q_weight : p.k_weight;
    constexpr float inv_n = 1.f / float(HEAD_DIM);
    float s = 0.f;
    float mean = 0.f;
    if constexpr (NORM == kLayerNorm) {
#pragma unroll
      for (int j = 0; j < 8; ++j) s += a[j] + b[j];
      mean = group_sum<L::kGroup>(s) * inv_n;
      s = 0.f;
      if (active) {
#pragma unroll
        for (int j = 0; j < 8; ++j) s += (a[j] - mean) * (a[j] - mean) + (b[j] - mean) * (b[j] - mean);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) s += a[j] * a[j] + b[j] * b[j];
    }
    const float rstd = rsqrtf(group_sum<L::kGroup>(s) * inv_n + p.eps);
    if (active) {
      float wa[8], wb[8];
      load8_ro(w + ca * 8, wa);
      load8_ro(w + cb * 8, wb);
      if constexpr (NORM == kLayerNorm) {
        const T* bs = is_q ? p.q_bias : p.k_bias;
        float ba[8], bb[8];
        load8_ro(bs + ca * 8, ba);
        load8_ro(bs + cb * 8, bb);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          a[j] = (a[j] - mean) * rstd * wa[j] + ba[j];
          b[j] = (b[j] - mean) * rstd * wb[j] + bb[j];
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          a[j] = a[j] * rstd * (NORM == kGemmaRMSNorm ? 1.f + wa[j] : wa[j]);
          b[j] = b[j] * rstd * (NORM == kGemmaRMSNorm ? 1.f + wb[j] : wb[j]);
        }
      }
    }
  }
  if (!active) return;  // no shuffles below
  if constexpr (ROPE != kRopeNone) {
    int64_t pos = int64_t(p.positions[tok]);
    pos = pos < 0 ? 0 : (pos >= p.max_pos ? p.max_pos - 1 : pos);  // clamped: never reads outside the cache
    const float* cs = p.cos_sin + pos * p.cs_s0;
    if constexpr (ROPE == kRopeNeox) {
      if (sub < NP) {  // a: x[i], b: x[i + rot/2] for i in chunk ca
        const float4* cp = reinterpret_cast<const float4*>(cs + ca * 8);
        const float4* sp = reinterpret_cast<const float4*>(cs + ROT_DIM / 2 + ca * 8);
        float4 c0 = __ldg(cp), c1 = __ldg(cp + 1), s0 = __ldg(sp), s1 = __ldg(sp + 1);
        const float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        const float sn[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float x1 = a[j], x2 = b[j];
          a[j] = x1 * c[j] - x2 * sn[j];
          b[j] = x2 * c[j] + x1 * sn[j];
        }
      }
    } else {  // GPT-J: pairs (2m, 2m+1) inside each chunk; frequency index = chunk * 4 + m
      gptj_rotate<ROT_DIM>(a, ca, cs);
      gptj_rotate<ROT_DIM>(b, cb, cs);
    }
  }
  float inv_scale = 1.f;
  if constexpr (FP8) inv_scale = 1.f / __ldg(p.scale);
  store8<FP8, T>(dst + ca * 8, a, inv_scale);
  store8<FP8, T>(dst + cb * 8, b, inv_scale);
}

}  // namespace fivar_fusion
