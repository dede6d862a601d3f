"""fivar's norm/RoPE fusions against stock FlashInfer (bf16), as time and % of a device copy:

- qwen3_qk_norm_rope (one kernel, in place on packed QKV) vs the unfused stock sequence rmsnorm(q heads) +
  rmsnorm(k heads) + apply_rope_with_cos_sin_cache_inplace; 32 q / 8 kv heads of 128;
- llama_add_rmsnorm vs flashinfer.fused_add_rmsnorm, both in place, tokens x hidden;
- RoPE alone (partial_rope_gptj, 64 of 128 rotated; a NeoX full-rotary fusion) vs apply_rope_with_cos_sin_cache.

`fivar` is the validated call, `fivar-bound` the pre-validated launch (`v.bind(...)`) a serving loop or CUDA
graph uses. Every contender has its own buffers, checked against the torch reference before it is timed.
"""
from __future__ import annotations

from ..membound import close
from ..runner import Case, Prepared
from ..contenders import Contender


def _checked(contenders_, refs):
    return Prepared(contenders_, lambda c: close(c.name, c.fn(), refs[c.name]))


def qwen3(tokens: int) -> Prepared:
    import flashinfer
    import torch

    import fivar
    from ...fusion import reference as R
    v = fivar.load("qwen3_qk_norm_rope")
    hq, hk, d, eps = 32, 8, 128, 1e-6
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    cs = R.cos_sin_cache(8192, d, 1000000.0, device="cuda")
    qw = torch.randn(d, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    kw = torch.randn(d, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    args = dict(num_q_heads=hq, num_kv_heads=hk, positions=pos, cos_sin_cache=cs, q_weight=qw, k_weight=kw, eps=eps)
    ref = v.reference(qkv=qkv, **args)
    a, b, c = qkv.clone(), qkv.clone(), qkv.clone()

    def views(buf):
        return buf[:, :hq * d].unflatten(1, (hq, d)), buf[:, hq * d:(hq + hk) * d].unflatten(1, (hk, d))

    def stock():
        q, k = views(c)
        flashinfer.rmsnorm(q, qw, eps, out=q)
        flashinfer.rmsnorm(k, kw, eps, out=k)
        flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, c[:, :hq * d], c[:, hq * d:(hq + hk) * d], d, cs,
                                                         is_neox=True)
        return q, k
    bound = v.bind(qkv=b, **args)
    cs_ = [Contender("fivar", lambda: v(qkv=a, **args)), Contender("fivar-bound", lambda: (bound(), views(b))[1]),
           Contender("stock", stock, "rmsnorm + rmsnorm + apply_rope_with_cos_sin_cache_inplace")]
    p = _checked(cs_, {x.name: ref for x in cs_})
    p.nbytes = tokens * (hq + hk) * d * 2 * 2 + tokens * d * 4 + tokens * 8  # q,k read+write; cos/sin; positions
    return p


def add_rmsnorm(tokens: int, hidden: int) -> Prepared:
    import flashinfer
    import torch

    import fivar
    v = fivar.load("llama_add_rmsnorm")
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    ref = v.reference(x=x, residual=r, weight=w, eps=1e-5)
    (x1, r1), (x2, r2), (x3, r3) = [(x.clone(), r.clone()) for _ in range(3)]
    bound = v.bind(x=x2, residual=r2, weight=w, eps=1e-5, out=x2)
    cs_ = [Contender("fivar", lambda: (v(x=x1, residual=r1, weight=w, eps=1e-5, out=x1), (x1, r1))[1]),
           Contender("fivar-bound", lambda: (bound(), (x2, r2))[1]),
           Contender("stock", lambda: (flashinfer.fused_add_rmsnorm(x3, r3, w, 1e-5), (x3, r3))[1],
                     "flashinfer.fused_add_rmsnorm")]
    p = _checked(cs_, {c.name: ref for c in cs_})
    p.nbytes = tokens * hidden * 2 * 4 + hidden * 2  # read x, residual; write residual, out; weight
    return p


def rope(which: str, tokens: int) -> Prepared:
    import flashinfer
    import torch

    import fivar
    from ...fusion import reference as R
    v = fivar.load("partial_rope_gptj") if which == "gptj" else \
        fivar.FusionVariant(name="rope_neox_hd128", norm=None, rope="neox", head_dim=128)
    hq, hk, d = 32, 8, v.head_dim
    q = torch.randn(tokens, hq * d, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tokens, hk * d, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    cs = R.cos_sin_cache(8192, v.rotary_dim, device="cuda")
    ref = v.reference(q=q, k=k, positions=pos, cos_sin_cache=cs)
    (q1, k1), (q2, k2), (q3, k3) = [(q.clone(), k.clone()) for _ in range(3)]
    bound = v.bind(q=q2, k=k2, positions=pos, cos_sin_cache=cs)
    neox = v.rope == "neox"
    cs_ = [Contender("fivar", lambda: (v(q=q1, k=k1, positions=pos, cos_sin_cache=cs), (q1, k1))[1]),
           Contender("fivar-bound", lambda: (bound(), (q2, k2))[1]),
           Contender("stock", lambda: (flashinfer.apply_rope_with_cos_sin_cache_inplace(
               pos, q3, k3, d, cs, is_neox=neox), (q3, k3))[1], "apply_rope_with_cos_sin_cache_inplace")]
    p = _checked(cs_, {c.name: ref for c in cs_})
    p.nbytes = tokens * (hq + hk) * d * 2 * 2 + tokens * v.rotary_dim * 4 + tokens * 8
    return p


def cases(quick: bool = False) -> list:
    out = []
    for t in (4096,) if quick else (4096, 65536):
        out.append(Case("fusions", f"qwen3_qk_norm_rope tokens={t}", "qk_norm_rope",
                        {"tokens": t, "heads": "32/8", "head_dim": 128, "dtype": "bf16"}, lambda t=t: qwen3(t),
                        baseline="stock"))
    for h in (4096,) if quick else (4096, 8192):
        for t in (1, 256, 16384) if quick else (1, 16, 256, 4096, 16384, 65536):
            out.append(Case("fusions", f"llama_add_rmsnorm tokens={t} hidden={h}", "add_rmsnorm",
                            {"tokens": t, "hidden": h, "dtype": "bf16"}, lambda t=t, h=h: add_rmsnorm(t, h),
                            baseline="stock"))
    t = 4096 if quick else 16384
    for which, rot in (("gptj", 64), ("neox", 128)):
        out.append(Case("fusions", f"rope_{which} rotary={rot} tokens={t}", "rope",
                        {"tokens": t, "heads": "32/8", "head_dim": 128, "rotary_dim": rot, "dtype": "bf16"},
                        lambda w=which, t=t: rope(w, t), baseline="stock"))
    return out
