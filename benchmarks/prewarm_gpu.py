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


if __name__ == "__main__":
    mods = wanted()
    t0 = time.perf_counter()
    res = build_many(mods)
    kinds = [k for k, _ in res]
    print(f"prewarm: {len(mods)} modules ({kinds.count('cold')} compiled, {kinds.count('disk')} cached) "
          f"in {time.perf_counter() - t0:.0f} s")
