"""Do Hopper's packed half-precision MUFU instructions halve soft-cap's second MUFU op? (No: a SASS count.)

FA3 soft-cap spends two MUFU ops per score, the cap's tanh and the softmax's exp2 (README, "What bounds FA3
soft-cap"). PTX has packed forms, `tanh.approx.f16x2` / `.bf16x2` and `ex2.approx.f16x2`, that would take one
instruction per pair of scores. Whether they save MUFU issue slots is decided by ptxas, so this script compiles one
probe kernel per form for sm_90a (no GPU needed) and counts the SASS opcodes per scalar score: if the packed tanh
lowers to one `MUFU.TANH.F16x2` per pair the count per score is 0.5, if ptxas splits it into two scalar ops it is 1.

    CUDA_HOME=/usr/local/cuda python3 benchmarks/tools/packed_mufu_sass.py [--json out.json]
"""
import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import tempfile

SCORES_PER_THREAD = 8

PROBE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cstdint>
__device__ __forceinline__ void packed_unary(float a, float b, float& ya, float& yb) {
  uint32_t in, out;
  asm("cvt.rn.%HALF%x2.f32 %0, %1, %2;" : "=r"(in) : "f"(b), "f"(a));
  asm("%OP%.approx%FTZ%.%HALF%x2 %0, %1;" : "=r"(out) : "r"(in));
  ya = __uint_as_float(out << 16);  // exact for bf16; for f16 the unpack below replaces it
  yb = __uint_as_float(out & 0xffff0000u);
  %F16_UNPACK%
}
__device__ __forceinline__ float scalar_unary(float x) {
  float y;
  asm("%OP%.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
extern "C" __global__ void probe(float* out, float scale) {
  float v[%N%];
#pragma unroll
  for (int i = 0; i < %N%; ++i) v[i] = out[threadIdx.x * %N% + i] * scale;
#pragma unroll
  for (int i = 0; i < %N%; i += 2) {
#if %PACKED%
    packed_unary(v[i], v[i + 1], v[i], v[i + 1]);
#else
    v[i] = scalar_unary(v[i]);
    v[i + 1] = scalar_unary(v[i + 1]);
#endif
  }
#pragma unroll
  for (int i = 0; i < %N%; ++i) out[threadIdx.x * %N% + i] = v[i];
}
"""

F16_UNPACK = ("__half2 h = *reinterpret_cast<__half2*>(&out); ya = __low2float(h); yb = __high2float(h);")

FORMS = {  # name: (PTX op, half type or None for the scalar f32 form); ex2's bf16 form exists only with .ftz
    "tanh.approx.f32": ("tanh", None),
    "tanh.approx.f16x2": ("tanh", "f16"),
    "tanh.approx.bf16x2": ("tanh", "bf16"),
    "ex2.approx.f32": ("ex2", None),
    "ex2.approx.f16x2": ("ex2", "f16"),
    "ex2.approx.ftz.bf16x2": ("ex2", "bf16"),
}


def cuobjdump():
    found = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"),
             shutil.which("cuobjdump") or ""]
    try:
        import triton  # its wheel carries a cuobjdump where a minimal CUDA toolkit has none
        found.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    for path in found:
        if path and os.access(path, os.X_OK):
            return path
    raise SystemExit("packed_mufu_sass: no cuobjdump (CUDA toolkit or triton) to read the SASS with")


def count_ops(form, workdir, nvcc, dump):
    op, half = FORMS[form]
    src = (PROBE.replace("%OP%", op).replace("%HALF%", half or "f16").replace("%N%", str(SCORES_PER_THREAD))
           .replace("%FTZ%", ".ftz" if (op, half) == ("ex2", "bf16") else "")
           .replace("%PACKED%", "1" if half else "0").replace("%F16_UNPACK%", F16_UNPACK if half == "f16" else ""))
    cu = os.path.join(workdir, form.replace(".", "_") + ".cu")
    with open(cu, "w") as f:
        f.write(src)
    cubin = cu[:-3] + ".cubin"
    subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-O3", "-o", cubin, cu], check=True)
    sass = subprocess.run([dump, "-sass", cubin], check=True, capture_output=True, text=True).stdout
    ops = collections.Counter(re.findall(r"\b(MUFU\.[A-Z0-9_.]+|F2FP\.[A-Z0-9_.]+|HADD2\.F32)\b", sass))
    return {name: n / SCORES_PER_THREAD for name, n in sorted(ops.items())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    dump = cuobjdump()
    with tempfile.TemporaryDirectory() as workdir:
        counts = {form: count_ops(form, workdir, nvcc, dump) for form in FORMS}
    print("SASS instructions per score (sm_90a):")
    for form, ops in counts.items():
        print(f"  {form:22s} " + ", ".join(f"{name} {n:g}" for name, n in ops.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": "sm_90a", "per_score": counts}, f, indent=1)


if __name__ == "__main__":
    main()
