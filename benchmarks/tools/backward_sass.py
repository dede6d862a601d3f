"""The generated backward's kernels compiled for sm_90a with no GPU: registers, spills and, per loop holding wgmma,
its instruction mix (HGMMA, barriers, local-memory spill traffic, shared loads, MUFU), from Triton's own ptxas.

    CUDA_HOME=/usr/local/cuda python3 benchmarks/tools/backward_sass.py variants/alibi.py
        [--kernel dkdv|dq|gl_dkdv|gl_dq] [--config 64,128,8,2] [--no-tma] [--group 4] [--causal] [--frozen]

`gl_dkdv` and `gl_dq` are the Hopper Gluon kernels at the tiles and warps their launcher uses (64 x 64, four warps;
--config is the Triton kernels'); they need the Triton the kernels are written for (3.6: put its wheel's
contents first on PYTHONPATH where the installed one is newer). `--frozen`: the variant with its learnable tensors
held (fivar.bench.train.learnable_copy), what the learnable gradients cost against.

A static view, for comparing two versions of a kernel before spending GPU time on them (times come from
benchmarks/tools/profile_backward.py on the GPU). The signature marks every pointer and stride 16-divisible and the
LSE's head stride 1, as a launch on contiguous tensors specializes them: without that, Triton cannot prove 16-byte
alignment and turns no pointer load into an asynchronous copy, which misreads the pipelining. Needs a Triton whose
bundled ptxas knows the PTX it emits (`ptxas-blackwell` where present).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fivar.codegen.triton_bwd import render_training
from fivar.registry import load_file

INT_ARGS = ("fv_heads", "fv_max_len", "fv_tokens", "LEN_BUCKET")
INDEX_ARGS = ("qo_indptr", "kv_indptr", "Ranges", "KeyRows", "Order")


POINTER = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int32": "*i32", "int64": "*i64",
           "bool": "*i1"}


def _variant_types(variant) -> dict:
    """The variant's kernel arguments (fivar.codegen.triton's KernelArg) -> Triton types."""
    from fivar.codegen.triton import TritonEmitter
    from fivar.spec.params import Tensor
    types = {}
    for arg in TritonEmitter(variant).args:
        param = variant.compiled_params.get(arg.param)
        if arg.source == "tensor":
            types[arg.name] = POINTER[param.dtype]
        elif arg.source == "scalar":
            types[arg.name] = "fp32" if param.dtype is float else "i32"
        elif arg.source in ("size", "stride"):
            types[arg.name] = "i32"
        assert arg.source == "sm_scale" or isinstance(param, Tensor) or arg.source == "scalar"
    return types


def _signature(jit, constexprs: dict, variant_types: dict) -> tuple[dict, dict, dict]:
    """Types for the kernel's arguments as fivar launches it on bf16 tensors: (signature, constexprs, attrs)."""
    sig, attrs, const = {}, {}, dict(constexprs)
    for i, (name, param) in enumerate(zip(jit.arg_names, jit.params)):
        if name in const or param.is_constexpr:
            const.setdefault(name, 0)
            sig[name] = "constexpr"
        elif name == "stride_l_head":  # LSE [tokens, heads]: a head is one float on
            sig[name], const[name] = "constexpr", 1
        elif name in ("Q", "K", "V", "DO", "DK", "DV", "DQ", "O"):
            sig[name] = "*bf16"
        elif name in INDEX_ARGS:
            sig[name] = "*i32"
        elif name.startswith(("stride", "fvsize", "fvstride")) or name in INT_ARGS:
            sig[name] = "i32"
        elif name == "sm_scale":
            sig[name] = "fp32"
        elif name in variant_types:
            sig[name] = variant_types[name]
        else:  # Lse, Delta and the learnable parameters' float32 gradient buffers
            sig[name] = "*fp32"
        if sig[name].startswith("*") or (sig[name] == "i32" and name.startswith("stride")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def _ptxas() -> str:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    return "ptxas"


def loop_mix(sass: str) -> list[dict]:
    """Per innermost loop holding HGMMA (a backward branch to a label before it, with no such loop inside it):
    instruction counts."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    spans = sorted({(labels[m.group(1)], i) for i, line in enumerate(lines)
                    if (m := re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)) and labels.get(m.group(1), i) < i})
    loops = []
    for a, b in spans:
        body = lines[a:b]
        if "HGMMA" not in "".join(body) or any(a < a2 and b2 < b for a2, b2 in spans):
            continue
        count = {k: sum(k in x for x in body) for k in ("HGMMA", "BAR.SYNC", "LDL", "STL", "LDS", "MUFU", "I2F", "FFMA",
                                                         "FMUL", "FADD", "IADD3")}
        loops.append({"instructions": len(body), **count})
    return loops


def compile_kernel(variant_file: str, kernel: str, config: tuple, tma: bool, group: int, causal: bool,
                   frozen: bool = False) -> dict:
    block_short, block_long, warps, stages = config
    variant = load_file(Path(variant_file))
    if frozen:
        from fivar.bench.train import learnable_copy
        variant = learnable_copy(variant, learnable=False)
    module_src = render_training(variant)
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "module.py")  # Triton reads a kernel's source through its file
        Path(source).write_text(module_src)
        namespace: dict = {"__name__": "fivar_backward_sass", "__file__": source}
        exec(compile(module_src, source, "exec"), namespace)  # noqa: S102 - fivar's own rendering
        if kernel.startswith("gl_"):  # the launcher's tiles and warps (templates/triton/bwd/launch.jinja)
            from triton.experimental.gluon._runtime import GluonASTSource
            jit, warps = namespace[f"gl_bwd_{kernel[3:]}_kernel"], 4
            sig, const, attrs = _signature(jit, {"GROUP": group, "HEAD_DIM": 128, "CAUSAL": causal, "BLOCK_M": 64,
                                                 "BLOCK_N": 64, "num_warps": warps}, _variant_types(variant))
            source = GluonASTSource(jit, sig, constexprs={(jit.arg_names.index(n),): v for n, v in const.items()},
                                    attrs=attrs)
            options = {"num_warps": warps}
        else:
            jit = namespace["bwd_dkdv_kernel" if kernel == "dkdv" else "bwd_dq_kernel"].fn
            blocks = {"BLOCK_M": block_long, "BLOCK_N": block_short} if kernel == "dq" else \
                {"BLOCK_M": block_short, "BLOCK_N": block_long}
            sig, const, attrs = _signature(jit, {"GROUP": group, "HEAD_DIM": 128, "CAUSAL": causal, "USE_TMA": tma,
                                                 **blocks}, _variant_types(variant))
            source = ASTSource(fn=jit, signature=sig, constexprs=const, attrs=attrs)
            options = {"num_warps": warps, "num_stages": stages}
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx).write_text(compiled.asm["ptx"])
        info = subprocess.run([_ptxas(), "-v", "--gpu-name", "sm_90a", ptx, "-o", cubin], capture_output=True,
                              text=True).stderr
        nvdisasm = str(Path(_ptxas()).parent / "nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"kernel": kernel, "config": (64, 64, 4) if kernel.startswith("gl_") else config, "tma": tma,
            "shared_bytes": compiled.metadata.shared, "registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "spill_load_bytes": int(spill.group(2)) if spill else None, "loops": loop_mix(sass)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variant_file")
    ap.add_argument("--kernel", choices=("dkdv", "dq", "gl_dkdv", "gl_dq"), action="append")
    ap.add_argument("--config", default="64,128,8,2", help="short side, long side, warps, stages")
    ap.add_argument("--no-tma", action="store_true")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--frozen", action="store_true", help="the learnable tensors held")
    args = ap.parse_args(argv)
    config = tuple(int(x) for x in args.config.split(","))
    for kernel in args.kernel or ("dkdv", "dq"):
        print(compile_kernel(args.variant_file, kernel, config, not args.no_tma, args.group, args.causal,
                             args.frozen))


if __name__ == "__main__":
    main()
