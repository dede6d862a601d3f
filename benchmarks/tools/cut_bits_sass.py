"""What a cut tile's mask costs a thread on FA3, in SASS instructions (sm_90a, no GPU).

csrc/fivar_tile_mask.cuh masks a cut KV tile once per tile: it loads the bits' 32-bit words of the thread's two rows
and drops each score whose bit is clear. This script compiles one probe kernel per KV tile width with three bodies
around the same fragment (loaded, masked, stored): `cutbits` masks through csrc/fivar_cut_bits.cuh as the kernel does,
`runtime` picks each score's word and bit at run time (a shift and a select per word a score), `none` masks nothing.
The mask's cost is a body's count less `none`'s.

    CUDA_HOME=/usr/local/cuda python3 benchmarks/tools/cut_bits_sass.py [--widths 128,176,192]
"""
import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

from packed_mufu_sass import cuobjdump

CSRC = Path(__file__).resolve().parents[2] / "csrc"

PROBE = r"""
#include <cstdint>
#include "fivar_cut_bits.cuh"
__device__ __forceinline__ uint32_t cut_word(const int32_t* bits, int rows, int whole, int q, int word) {
  if (word < 0) return ~0u;  // a whole tile's word
  if (whole < 0) return 0u;  // a request keeping no key
  return uint32_t(__ldg(bits + word * rows + q));
}
template <int N, int BODY>  // BODY 0: runtime picks, 1: CutBits, 2: no mask
__global__ void mask_tile(const int32_t* bits, float* acc_io, int kv_last, int whole, int q_last, int rows) {
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = acc_io[threadIdx.x * (N / 2) + i];
  if (BODY < 2 && kv_last >= whole) {
    const int32_t c_first = kv_last - (N - 7) - whole, w_first = c_first >> 5;
    constexpr int RAW = fivar::CutBits<N>::RAW;
    uint32_t raw[2][RAW];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int j = 0; j < RAW; ++j) raw[r][j] = cut_word(bits, rows, whole, q_last - 8 + 8 * r, w_first + j);
    if (BODY == 0) {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const int32_t c = c_first + (i & 1) + 8 * (i >> 2), slot = (c >> 5) - w_first;
        uint32_t w = raw[(i >> 1) & 1][0];
#pragma unroll
        for (int j = 1; j < RAW; ++j) w = slot == j ? raw[(i >> 1) & 1][j] : w;
        if (!((w >> (c & 31)) & 1u)) acc[i] = -INFINITY;
      }
    } else {
      const fivar::CutBits<N> b(raw, c_first & 31);
#pragma unroll
      for (int i = 0; i < N / 2; ++i)
        if (!b.keeps(i)) acc[i] = -INFINITY;
    }
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc_io[threadIdx.x * (N / 2) + i] = 2.f * acc[i];  // kept live
}
"""
BODIES = {"runtime": 0, "cutbits": 1, "none": 2}


def counts(widths: list[int], nvcc: str, dump: str) -> dict[tuple[int, str], int]:
    """{(width, body): SASS instructions of the probe kernel}."""
    inst = "".join(f"template __global__ void mask_tile<{n}, {b}>(const int32_t*, float*, int, int, int, int);\n"
                   for n in widths for b in BODIES.values())
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "probe.cu"), os.path.join(tmp, "probe.cubin")
        open(cu, "w").write(PROBE + inst)
        subprocess.run([nvcc, "-std=c++17", "-O3", "-arch=sm_90a", "-cubin", "-I", str(CSRC), "-o", cubin, cu],
                       check=True)
        sass = subprocess.run([dump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    out, key = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : _Z9mask_tileILi(\d+)ELi(\d)E", line)
        if m:
            key = (int(m.group(1)), {v: k for k, v in BODIES.items()}[int(m.group(2))])
            out[key] = 0
        elif key and re.match(r"\s+/\*[0-9a-f]{4}\*/\s+[A-Z@]", line):
            out[key] += 1
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="96,128,176,192", help="KV tile widths (keys), comma-separated")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    c = counts(widths, nvcc, cuobjdump())
    print("CTA_KV  runtime picks  CutBits   (mask instructions a thread a cut tile; per score)")
    for n in widths:
        rt, cb = c[n, "runtime"] - c[n, "none"], c[n, "cutbits"] - c[n, "none"]
        print(f"{n:6d}  {rt:13d}  {cb:7d}   ({rt / (n // 2):.1f} and {cb / (n // 2):.1f} a score)")


if __name__ == "__main__":
    main()
