"""Calling a fusion: validate every argument (fivar.fusion.args), then launch its JIT-built kernel.

    v = fivar.load("qwen3_qk_norm_rope")
    q, k = v(qkv=qkv, num_q_heads=32, num_kv_heads=8, positions=pos, cos_sin_cache=cs,
             q_weight=qw, k_weight=kw)                      # in place on the packed QKV buffer
    v = fivar.load("llama_add_rmsnorm")
    out = v(x=x, residual=res, weight=w, eps=1e-6)          # residual <- x + residual; out = norm(x + residual)

The arguments each fusion takes are described in fivar.fusion.args.
"""
from __future__ import annotations

from .args import split_args


def run(v, **kwargs):
    """Validate, then launch the fusion's kernel (arguments: fivar.fusion.args; results: the outputs)."""
    return bind(v, **kwargs)()


def bind(v, **kwargs):
    """Validate once; return a zero-argument callable that launches on exactly these tensors.

    For hot loops and CUDA graphs: the callable skips validation, so the tensors must stay as bound."""
    a = split_args(v, kwargs, validate=True)
    # Here, not at the top: jit.build (jinja2, sqlite3) loads at the first launch instead of at `import fivar`.
    from .build import dtype_of, fusion_module_for
    src = a["q"] if v.is_head else a["x"]
    if src.shape[0] == 0:
        res = (a["q_out"], a["k_out"]) if v.is_head else a["out"]
        return lambda: res
    fn = fusion_module_for(v, dtype_of(src.dtype)).load().fusion_run
    if not v.is_head:  # the binding sets the device (CUDADeviceGuard) and uses torch's current stream
        args = [a["out"], a["x"]] + ([a["residual"]] if v.residual else []) + [a["weight"]]
        args += [a["bias"]] if v.norm == "layernorm" else []
        args += [a["scale"]] if v.fp8 else []
        args.append(a["eps"])
        out = a["out"]

        def launch_row():
            fn(*args)
            return out
        return launch_row
    args = [a["q"], a["k"], a["q_out"], a["k_out"]]
    if v.rope and v.cos_sin == "computed":
        args += [a["positions"], a["inv_freq"], float(a["attention_factor"])]
    elif v.rope:
        args += [a["positions"], a["cos_sin_cache"]]
    args += [a["q_weight"], a["k_weight"]] if v.norm else []
    args += [a["q_bias"], a["k_bias"]] if v.norm == "layernorm" else []
    args += [a["scale"]] if v.fp8 else []
    args.append(a["eps"])
    outs = (a["q_out"], a["k_out"])

    def launch_head():
        fn(*args)
        return outs
    return launch_head
