// fivar fused norm / residual / RoPE / FP8 kernels (memory bound: one pass, 16-byte vectors, fp32 math).
//
// Two kernel shapes, both specialised at compile time by the rendered module (fusion_*.cu.jinja):
//  * row_kernel:  one CTA per token row; optional residual add (written back), rmsnorm / gemma /
//                 layernorm over the row, output in the input dtype or fp8 e4m3 (clamp(y / scale)).
//                 Each thread keeps K 16-byte vectors of the row in registers; warp shuffles + smem
//                 reduce the sums; the row is read once and written once.
//  * head_kernel: a warp per (token, group of heads) of q and k; a group of lanes (a power of two <= 32)
//                 per head, each lane holding two 16-byte chunks of U heads. NeoX partners
//                 (i, i + rotary_dim/2) are placed in the same lane, GPT-J pairs sit inside a chunk, so
//                 norm then RoPE run in registers with only the norm's group shuffle. In place on strided
//                 q/k views (packed QKV) or into a separate (fp8) output.
// Both issue every global load before the first reduction or store: with the L2 cold (weights, cos/sin,
// positions) a dependent load costs a whole DRAM latency, and only loads in flight move bytes.
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

// A 16-byte vector of 8 bf16/fp16 values <-> 8 floats, through the type's 2-wide vector type.
template <typename T>
struct Half2;
template <>
struct Half2<nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Half2<half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type from_floats(float a, float b) { return __floats2half2_rn(a, b); }
};

template <typename T>
struct Pack {
  using H2 = Half2<T>;
  static __device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
    const typename H2::type* p = reinterpret_cast<const typename H2::type*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 t = H2::to_float2(p[i]);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
  static __device__ __forceinline__ uint4 pack(const float (&f)[8]) {
    uint4 v;
    typename H2::type* p = reinterpret_cast<typename H2::type*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = H2::from_floats(f[2 * i], f[2 * i + 1]);
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

// N independent group sums, their shuffle chains interleaved.
template <int WIDTH, int N>
__device__ __forceinline__ void group_sum(float (&v)[N]) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], off);
  }
}

// Sum over the CTA with one barrier: each warp reduces all the per-warp partials itself. `red` holds 32
// floats; a second reduction in the same kernel needs its own `red`.
__device__ __forceinline__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = group_sum<32>(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  return group_sum<32>(lane < nwarps ? red[lane] : 0.f);
}

// 16-byte global loads, zeros where !pred. Inline asm (volatile: kept in program order) and predicated
// rather than branched, so every load stays where it is written: up front, before the first use. (Plain
// loads under `if` get sunk next to their use by the compiler, behind the reduction, which costs one
// more memory latency per CTA.) ldg16 goes through the read-only path: weights, cos/sin.
#define FIVAR_LD16(NAME, INSN)                                                                          \
  __device__ __forceinline__ uint4 NAME(const void* ptr, bool pred) {                                   \
    uint4 r;                                                                                            \
    asm volatile(                                                                                       \
        "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n" \
        " mov.b32 %3, 0;\n @p " INSN " {%0, %1, %2, %3}, [%4];\n}\n"                                  \
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)                                                    \
        : "l"(ptr), "r"(int(pred)));                                                                    \
    return r;                                                                                           \
  }
FIVAR_LD16(ld16, "ld.global.v4.u32")
FIVAR_LD16(ldg16, "ld.global.nc.v4.u32")
#undef FIVAR_LD16

__device__ __forceinline__ float ldg_f32(const float* ptr) {  // the fp8 scale, loaded up front likewise
  float r;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(r) : "l"(ptr));
  return r;
}

// ------------------------------------------------------------------------------------------------
// Row kernel: one CTA per row of `hidden` elements (hidden % 8 == 0, hidden <= K * 8 * blockDim.x).
// The row's x and residual loads are issued before the first store and the reduction (a residual store
// between two x loads would serialise them: x may alias it), except at K = 8 (1024 threads, 64
// registers), where the raw vectors do not fit next to the fp32 row. At K = 1, the instance the launcher
// picks for few rows, where a CTA is one chain of memory latencies, the weights are loaded up front too
// (with the L2 cold, after the reduction they would cost one more DRAM latency); at larger K they would
// cost occupancy, and with many rows they are L2 hits anyway.
template <typename T, typename O, int K, int NORM, bool RESIDUAL, bool FP8>
__global__ void __launch_bounds__(K == 1 || K == 8 ? 1024 : 512) row_kernel(const T* x, int64_t stride_x,
                                                   T* __restrict__ residual, int64_t stride_r,
                                                   const T* __restrict__ weight,
                                                   const T* __restrict__ bias, O* out, int64_t stride_o,
                                                   const float* __restrict__ scale, int hidden, float eps) {
  constexpr bool kLoadsFirst = K <= 4, kEarlyWeights = K == 1;
  __shared__ float red[2][32];
  const int64_t row = blockIdx.x;
  const int nvec = hidden >> 3;
  const T* xr = x + row * stride_x;
  T* rr = RESIDUAL ? residual + row * stride_r : nullptr;
  uint4 xv[K], rv[K], wv[K], bv[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int idx = k * blockDim.x + threadIdx.x;
    if constexpr (kLoadsFirst) {
      xv[k] = ld16(xr + idx * 8, idx < nvec);
      if constexpr (RESIDUAL) rv[k] = ld16(rr + idx * 8, idx < nvec);
    }
    if constexpr (kEarlyWeights) {
      wv[k] = ldg16(weight + idx * 8, idx < nvec);
      if constexpr (NORM == kLayerNorm) bv[k] = ldg16(bias + idx * 8, idx < nvec);
    }
  }
  float inv_scale = 1.f;
  if constexpr (FP8) inv_scale = 1.f / ldg_f32(scale);
  float v[K][8];
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int idx = k * blockDim.x + threadIdx.x;
    if (idx < nvec) {
      if constexpr (!kLoadsFirst) {
        xv[k] = ld16(xr + idx * 8, true);
        if constexpr (RESIDUAL) rv[k] = ld16(rr + idx * 8, true);
      }
      Pack<T>::unpack(xv[k], v[k]);
      if constexpr (RESIDUAL) {
        float r[8];
        Pack<T>::unpack(rv[k], r);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[k][j] += r[j];
        *reinterpret_cast<uint4*>(rr + idx * 8) = Pack<T>::pack(v[k]);
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
    mean = block_sum(sum, red[0]) * inv_n;
    float var = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (k * (int)blockDim.x + (int)threadIdx.x < nvec) {
#pragma unroll
        for (int j = 0; j < 8; ++j) var += (v[k][j] - mean) * (v[k][j] - mean);
      }
    }
    rstd = rsqrtf(block_sum(var, red[1]) * inv_n + eps);
  } else {
    rstd = rsqrtf(block_sum(sum, red[0]) * inv_n + eps);
  }
  O* orow = out + row * stride_o;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int idx = k * blockDim.x + threadIdx.x;
    if (idx < nvec) {
      if constexpr (!kEarlyWeights) {
        wv[k] = ldg16(weight + idx * 8, true);
        if constexpr (NORM == kLayerNorm) bv[k] = ldg16(bias + idx * 8, true);
      }
      float w[8], y[8];
      Pack<T>::unpack(wv[k], w);
      if constexpr (NORM == kLayerNorm) {
        float b[8];
        Pack<T>::unpack(bv[k], b);
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
  const float* cos_sin;   // cos_sin="cache": [max_pos, ROT_DIM] rows
  int64_t cs_s0;
  int max_pos;
  const float* inv_freq;  // cos_sin="computed": [ROT_DIM / 2]
  float attention_factor;
  const T* q_weight;
  const T* k_weight;
  const T* q_bias;
  const T* k_bias;
  const float* scale;
  int num_tokens, hq, hk;
  int groups;  // warps per token: ceil((hq + hk) / kHeadsPerWarp)
  float eps;
};

constexpr int next_pow2(int n) { return n <= 1 ? 1 : 2 * next_pow2((n + 1) / 2); }

// A warp works on kHeadsPerWarp consecutive heads (q heads, then k heads) of one token. Each head is
// held by a group of kGroup lanes, two 16-byte chunks per lane; a lane holds U heads, kHeadsPerPass
// apart, so each warp-wide load covers kHeadsPerPass whole heads (contiguous in memory) and the
// position, cos/sin and weights a lane needs are loaded once for its U heads.
template <int HEAD_DIM, int U>
struct HeadLayout {
  static constexpr int kChunks = HEAD_DIM / 8;                // 16-byte chunks per head
  static constexpr int kLanes = kChunks / 2;                  // lanes doing work (2 chunks each)
  static constexpr int kGroup = next_pow2(kLanes);            // lanes per head (power of two)
  static constexpr int kHeadsPerPass = 32 / kGroup;
  static constexpr int kHeadsPerWarp = kHeadsPerPass * U;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = 32 * kWarps;
  static_assert(HEAD_DIM % 16 == 0 && kLanes <= 32, "head_dim must be a multiple of 16, <= 512");
};

// A lane's chunks ca, cb of a norm weight (and bias), raw.
struct NormChunks {
  uint4 wa, wb, ba, bb;
  template <bool BIAS, typename T>
  __device__ __forceinline__ void load(const T* w, const T* b, int ca, int cb, bool pred) {
    wa = ldg16(w + ca * 8, pred);
    wb = ldg16(w + cb * 8, pred);
    if constexpr (BIAS) {
      ba = ldg16(b + ca * 8, pred);
      bb = ldg16(b + cb * 8, pred);
    }
  }
  // Per-word selects: choosing between two register arrays by index would put them in local memory.
  static __device__ __forceinline__ uint4 sel(bool c, const uint4& x, const uint4& y) {
    return make_uint4(c ? x.x : y.x, c ? x.y : y.y, c ? x.z : y.z, c ? x.w : y.w);
  }
  static __device__ __forceinline__ NormChunks select(bool c, const NormChunks& x, const NormChunks& y) {
    return {sel(c, x.wa, y.wa), sel(c, x.wb, y.wb), sel(c, x.ba, y.ba), sel(c, x.bb, y.bb)};
  }
};

// 4 floats of cos/sin (read-only path, zeros where !pred).
__device__ __forceinline__ void ldg_f4(const float* p, float* d, bool pred) {
  const uint4 t = ldg16(p, pred);
  d[0] = __uint_as_float(t.x);
  d[1] = __uint_as_float(t.y);
  d[2] = __uint_as_float(t.z);
  d[3] = __uint_as_float(t.w);
}

// cos/sin of rotary frequencies f .. f+3 at this token: read from its cache row, or computed from
// inv_freq (sincosf: full-precision range reduction, angles reach ~1e5 rad at long positions).
template <bool COMPUTED, int ROT_DIM>
__device__ __forceinline__ void cos_sin4(const float* row, const float* inv_freq, float pos, float factor, int f,
                                         float* c, float* s, bool pred) {
  if constexpr (COMPUTED) {
    float fr[4];
    ldg_f4(inv_freq + f, fr, pred);
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      sincosf(pos * fr[m], &s[m], &c[m]);
      c[m] *= factor;
      s[m] *= factor;
    }
  } else {
    ldg_f4(row + f, c, pred);
    ldg_f4(row + ROT_DIM / 2 + f, s, pred);
  }
}

// GPT-J: pairs (2m, 2m+1) of a chunk rotate by frequency chunk * 4 + m; c/s hold those 4 cos/sin.
__device__ __forceinline__ void gptj_rotate(float (&x)[8], const float* c, const float* s) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float x1 = x[2 * m], x2 = x[2 * m + 1];
    x[2 * m] = x1 * c[m] - x2 * s[m];
    x[2 * m + 1] = x2 * c[m] + x1 * s[m];
  }
}

template <typename T, typename O, typename IdT, int HEAD_DIM, int ROT_DIM, int NORM, int ROPE, bool FP8, int U,
          bool COMPUTED>
__global__ void __launch_bounds__(HeadLayout<HEAD_DIM, U>::kThreads) head_kernel(const HeadParams<T, O, IdT> p) {
  using L = HeadLayout<HEAD_DIM, U>;
  constexpr int NP = ROT_DIM / 16;  // NeoX: chunk pairs (c, c + NP) rotated together
  const int lane = threadIdx.x & 31;
  const int sub = lane % L::kGroup;
  const unsigned task = blockIdx.x * unsigned(L::kWarps) + threadIdx.x / 32;  // runtime checked < 2^31
  const int tok = int(task / unsigned(p.groups));
  const int h0 = int(task - unsigned(tok) * unsigned(p.groups)) * L::kHeadsPerWarp + lane / L::kGroup;
  const int nh = p.hq + p.hk;
  const bool lane_ok = sub < L::kLanes && tok < p.num_tokens;
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
  // Every load first, the position leading: a warp then waits for x, weights and position together,
  // then for the cos/sin row (which needs the position), instead of for each in turn.
  const float* cs = nullptr;
  float posf = 0.f;
  if constexpr (ROPE != kRopeNone) {
    if (tok < p.num_tokens) {
      int64_t pos = int64_t(p.positions[tok]);
      if constexpr (COMPUTED) {
        posf = float(pos);
      } else {
        pos = pos < 0 ? 0 : (pos >= p.max_pos ? p.max_pos - 1 : pos);  // clamped: never reads outside the cache
        cs = p.cos_sin + pos * p.cs_s0;
      }
    }
  }
  uint4 xa[U], xb[U];
  O* dst[U];
  bool ok[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int h = h0 + u * L::kHeadsPerPass;
    ok[u] = lane_ok && h < nh;
    const bool is_q = h < p.hq;
    const T* src = is_q ? p.q + tok * p.q_s0 + h * p.q_s1 : p.k + tok * p.k_s0 + (h - p.hq) * p.k_s1;
    dst[u] = is_q ? p.q_out + tok * p.qo_s0 + h * p.qo_s1 : p.k_out + tok * p.ko_s0 + (h - p.hq) * p.ko_s1;
    xa[u] = ld16(src + ca * 8, ok[u]);
    xb[u] = ld16(src + cb * 8, ok[u]);
  }
  // Norm weights (and biases) of chunks ca and cb. Without RoPE, loaded here for q and for k (as the
  // lane's heads need), so a CTA waits for one memory latency. With RoPE the cos/sin row already costs
  // two (position, then row): the weights are loaded per head after the reduction, mostly from L1, and
  // their registers go to cos/sin (hd128 qk-norm+rope at U = 2: 64 registers, not 73).
  constexpr bool kEarlyWeights = ROPE == kRopeNone;
  NormChunks nq, nk;
  if constexpr (NORM != kNormNone && kEarlyWeights) {
    nq.load<NORM == kLayerNorm>(p.q_weight, p.q_bias, ca, cb, lane_ok && h0 < p.hq);
    nk.load<NORM == kLayerNorm>(p.k_weight, p.k_bias, ca, cb, lane_ok && h0 + (U - 1) * L::kHeadsPerPass >= p.hq);
  }
  // cos/sin for this lane's chunks, the same for all its heads. NeoX: frequencies ca*8 .. ca*8+7;
  // GPT-J: ca*4 .. ca*4+3 in [0, 4), cb*4 .. cb*4+3 in [4, 8).
  float c[8], s[8];
  const float af = p.attention_factor;
  if constexpr (ROPE == kRopeNeox) {
    const bool rot = lane_ok && sub < NP;
    cos_sin4<COMPUTED, ROT_DIM>(cs, p.inv_freq, posf, af, ca * 8, c, s, rot);
    cos_sin4<COMPUTED, ROT_DIM>(cs, p.inv_freq, posf, af, ca * 8 + 4, c + 4, s + 4, rot);
  } else if constexpr (ROPE == kRopeGptj) {
    cos_sin4<COMPUTED, ROT_DIM>(cs, p.inv_freq, posf, af, ca * 4, c, s, lane_ok && ca * 8 < ROT_DIM);
    cos_sin4<COMPUTED, ROT_DIM>(cs, p.inv_freq, posf, af, cb * 4, c + 4, s + 4, lane_ok && cb * 8 < ROT_DIM);
  }
  float inv_scale = 1.f;
  if constexpr (FP8) inv_scale = 1.f / ldg_f32(p.scale);

  // Per-head statistics: every lane of the warp takes part in the shuffles (idle lanes hold zeros).
  constexpr float inv_n = 1.f / float(HEAD_DIM);
  float mean[U], rstd[U];
  if constexpr (NORM != kNormNone) {
    float sum[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float a[8], b[8];
      Pack<T>::unpack(xa[u], a);
      Pack<T>::unpack(xb[u], b);
      sum[u] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum[u] += NORM == kLayerNorm ? a[j] + b[j] : a[j] * a[j] + b[j] * b[j];
    }
    group_sum<L::kGroup>(sum);
    if constexpr (NORM == kLayerNorm) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        mean[u] = sum[u] * inv_n;
        float a[8], b[8];
        Pack<T>::unpack(xa[u], a);
        Pack<T>::unpack(xb[u], b);
        sum[u] = 0.f;
        if (ok[u]) {
#pragma unroll
          for (int j = 0; j < 8; ++j)
            sum[u] += (a[j] - mean[u]) * (a[j] - mean[u]) + (b[j] - mean[u]) * (b[j] - mean[u]);
        }
      }
      group_sum<L::kGroup>(sum);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) rstd[u] = rsqrtf(sum[u] * inv_n + p.eps);
  }

#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!ok[u]) continue;
    float a[8], b[8];
    Pack<T>::unpack(xa[u], a);
    Pack<T>::unpack(xb[u], b);
    if constexpr (NORM != kNormNone) {
      const bool q_head = h0 + u * L::kHeadsPerPass < p.hq;
      NormChunks n;
      if constexpr (kEarlyWeights) {
        n = NormChunks::select(q_head, nq, nk);
      } else {
        n.load<NORM == kLayerNorm>(q_head ? p.q_weight : p.k_weight, q_head ? p.q_bias : p.k_bias, ca, cb, true);
      }
      float fa[8], fb[8];
      Pack<T>::unpack(n.wa, fa);
      Pack<T>::unpack(n.wb, fb);
      if constexpr (NORM == kLayerNorm) {
        float ga[8], gb[8];
        Pack<T>::unpack(n.ba, ga);
        Pack<T>::unpack(n.bb, gb);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          a[j] = (a[j] - mean[u]) * rstd[u] * fa[j] + ga[j];
          b[j] = (b[j] - mean[u]) * rstd[u] * fb[j] + gb[j];
        }
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          a[j] = a[j] * rstd[u] * (NORM == kGemmaRMSNorm ? 1.f + fa[j] : fa[j]);
          b[j] = b[j] * rstd[u] * (NORM == kGemmaRMSNorm ? 1.f + fb[j] : fb[j]);
        }
      }
    }
    if constexpr (ROPE == kRopeNeox) {
      if (sub < NP) {  // a: x[i], b: x[i + rot/2] for i in chunk ca
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float x1 = a[j], x2 = b[j];
          a[j] = x1 * c[j] - x2 * s[j];
          b[j] = x2 * c[j] + x1 * s[j];
        }
      }
    } else if constexpr (ROPE == kRopeGptj) {  // chunks past rotary_dim pass through
      if (ca * 8 < ROT_DIM) gptj_rotate(a, c, s);
      if (cb * 8 < ROT_DIM) gptj_rotate(b, c + 4, s + 4);
    }
    store8<FP8, T>(dst[u] + ca * 8, a, inv_scale);
    store8<FP8, T>(dst[u] + cb * 8, b, inv_scale);
  }
}

}  // namespace fivar_fusion
