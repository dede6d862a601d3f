"""Build, in one parallel ninja, every module the GPU tests and the benchmarks use (one device call)."""
import time

import fivar
from fivar.jit.build import build_many, gen_module

BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias",
           "softcap_sliding_window"]


def wanted():
    mods = []
    for name in BUNDLED:
        v = fivar.load(name)
        mods += [gen_module(v, op=op, target="fa2") for op in ("single_prefill", "batch_prefill", "batch_decode")]
        mods += [gen_module(v, op=op, target="fa3") for op in ("single_prefill", "batch_prefill")]
    for name in ("softcap", "alibi", "document_mask"):
        v = fivar.load(name)
        for target in ("fa2", "fa3") if name == "softcap" else ("fa2",):
            for dtype, hd in (("fp16", 64), ("fp16", 128), ("bf16", 256)):
                mods.append(gen_module(v, op="single_prefill", target=target, dtype=dtype, head_dim=hd))
    return mods


def second_session():
    """What the fusion/Triton tests and the benchmarks need (the first session ran the kernel tests)."""
    from fivar.fusion.build import gen_fusion_module
    mods = []
    for name in BUNDLED:
        v = fivar.load(name)
        mods += [gen_module(v, op="single_prefill", target=t) for t in ("fa2", "fa3")]
        mods.append(gen_module(v, op="batch_prefill", target="fa2"))
    for name in ("softcap", "alibi", "document_mask", "sigmoid"):
        mods.append(gen_module(fivar.load(name), op="batch_decode", target="fa2"))
    for name in ("qwen3_qk_norm_rope", "llama_add_rmsnorm", "add_rmsnorm_fp8", "partial_rope_gptj"):
        mods.append(gen_fusion_module(fivar.load(name)))
    return mods


def third_session():
    """Session 3: FA3 for every variant (flex benchmark, window tests), FA2 single prefill (Triton
    agreement tests). The fusion benchmark builds its own modules."""
    mods = []
    for name in BUNDLED:
        v = fivar.load(name)
        mods += [gen_module(v, op="single_prefill", target=t) for t in ("fa2", "fa3")]
    mods.append(gen_module(fivar.load("sliding_window"), op="batch_prefill", target="fa3"))
    return mods


if __name__ == "__main__":
    import sys
    mods = second_session() if "--second" in sys.argv else third_session() if "--session3" in sys.argv \
        else wanted()
    t0 = time.perf_counter()
    res = build_many(mods)
    kinds = [k for k, _ in res]
    print(f"prewarm: {len(mods)} modules ({kinds.count('cold')} compiled, {kinds.count('disk')} cached) "
          f"in {time.perf_counter() - t0:.0f} s")
