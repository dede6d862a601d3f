// Device (and host) implementations of the operations a fivar variant may use.
// Generated variant structs call only these, so the same emitted C++ also compiles for the host,
// which is how fivar's tests check the C++ code generator against Python without a GPU.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FIVAR_INLINE __host__ __device__ __forceinline__
#else
#define FIVAR_INLINE inline
#endif

namespace fivar {

FIVAR_INLINE float tanh(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::tanh(x);
#endif
}

FIVAR_INLINE float exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// 2^x on the FMA pipe, no MUFU op, for the softmax's x <= 0 (x = score * scale - row max): x <= -127 gives
// exactly 0, so a masked score (-inf) weighs nothing and a fully masked row still sums to 0; so does a NaN
// (fmaxf drops it; FlashInfer's MUFU exp2 would return NaN); x >= 128 is outside the domain. x = j + f with
// j = round(x) (the 1.5 * 2^23 trick leaves j in the low mantissa bits), 2^f from a cubic fitted for relative
// error on [-0.5, 0.5] (max 1.02e-4, against bf16's 3.9e-3 rounding of the probabilities), and j added to the
// exponent field.
FIVAR_INLINE float exp2_fma(float x) {
  const float kRound = 12582912.f;
  x = ::fmaxf(x, -127.f);
  const float shifted = x + kRound;
  const float f = x - (shifted - kRound);
  const float p = ::fmaf(::fmaf(::fmaf(0.05500862f, f, 0.24221021f), f, 0.69328288f), f, 1.f);
#if defined(__CUDA_ARCH__)
  return __uint_as_float(__float_as_uint(p) + (__float_as_uint(shifted) << 23));
#else
  uint32_t pb, jb;
  std::memcpy(&pb, &p, 4);
  std::memcpy(&jb, &shifted, 4);
  const uint32_t bits = pb + (jb << 23);
  float y;
  std::memcpy(&y, &bits, 4);
  return y;
#endif
}

FIVAR_INLINE float exp(float x) {
#if defined(__CUDA_ARCH__)
  return exp2(x * 1.4426950408889634f);
#else
  return std::exp(x);
#endif
}

FIVAR_INLINE float log(float x) {
#if defined(__CUDA_ARCH__)
  return __logf(x);
#else
  return std::log(x);
#endif
}

FIVAR_INLINE float sigmoid(float x) { return 1.f / (1.f + exp(-x)); }
FIVAR_INLINE float sqrt(float x) { return ::sqrtf(x); }
FIVAR_INLINE float floor(float x) { return ::floorf(x); }
FIVAR_INLINE float abs(float x) { return ::fabsf(x); }
FIVAR_INLINE int32_t abs(int32_t x) { return x < 0 ? -x : x; }
FIVAR_INLINE float minimum(float a, float b) { return ::fminf(a, b); }
FIVAR_INLINE float maximum(float a, float b) { return ::fmaxf(a, b); }
FIVAR_INLINE int32_t minimum(int32_t a, int32_t b) { return a < b ? a : b; }
FIVAR_INLINE int32_t maximum(int32_t a, int32_t b) { return a > b ? a : b; }

// Python semantics: // rounds toward -inf and % takes the sign of the divisor.
FIVAR_INLINE int32_t floordiv(int32_t a, int32_t b) {
  int32_t q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
FIVAR_INLINE int32_t mod(int32_t a, int32_t b) {
  int32_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
FIVAR_INLINE float floordiv(float a, float b) { return ::floorf(a / b); }
FIVAR_INLINE float mod(float a, float b) { return a - b * ::floorf(a / b); }

// Tensor parameters are read with clamped indices: an index expression never leaves the tensor.
FIVAR_INLINE int64_t clamp_index(int32_t i, int64_t n) {
  return i < 0 ? 0 : (i >= n ? n - 1 : static_cast<int64_t>(i));
}

}  // namespace fivar
