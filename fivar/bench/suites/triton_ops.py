"""fivar.triton_ops (Triton norm/RoPE kernels) against stock FlashInfer (bf16), 65536 tokens x 4096 hidden (q: 32
heads of 128, k: 8, as strided views of a packed QKV buffer): rmsnorm, fused_add_rmsnorm, RoPE NeoX (full) and
GPT-J (64 of 128 rotated), and Qwen3's per-head q/k RMSNorm + RoPE in one kernel vs the unfused stock sequence.
Bytes counted: every element an op must read or write once (partial rotary: only the rotated features)."""
from __future__ import annotations

from ..contenders import Contender
from ..membound import close
from ..runner import Case, Prepared

HEAD_DIM, MAX_POS = 128, 8192


def _prepared(triton_fn, stock_fn, ref, nbytes, label):
    cs = [Contender("triton", triton_fn), Contender("stock", stock_fn, label)]
    return Prepared(cs, lambda c: close(c.name, c.fn(), ref), nbytes=nbytes)


def rmsnorm(tokens, hidden, eps=1e-6):
    import flashinfer
    import torch

    import fivar.triton_ops as T
    from ...fusion import reference as R
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    ot, of = torch.empty_like(x), torch.empty_like(x)
    return _prepared(lambda: (T.rmsnorm(x, w, eps, out=ot), ot)[1],
                     lambda: (flashinfer.rmsnorm(x, w, eps, out=of), of)[1], R.rms_norm(x, w, eps),
                     tokens * hidden * 2 * 2 + hidden * 2, "flashinfer.rmsnorm")


def fused_add_rmsnorm(tokens, hidden, eps=1e-6):
    import flashinfer
    import torch

    import fivar.triton_ops as T
    from ...fusion import reference as R
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(hidden, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    s = x.float() + r.float()
    ref = (R.rms_norm(s, w, eps), s)
    (x1, r1), (x2, r2) = (x.clone(), r.clone()), (x.clone(), r.clone())
    return _prepared(lambda: (T.fused_add_rmsnorm(x1, r1, w, eps), (x1, r1))[1],
                     lambda: (flashinfer.fused_add_rmsnorm(x2, r2, w, eps), (x2, r2))[1], ref,
                     tokens * hidden * 2 * 4 + hidden * 2, "flashinfer.fused_add_rmsnorm")


def _views(buf, hq, hk, d):
    q2, k2 = buf[:, :hq * d], buf[:, hq * d:(hq + hk) * d]  # [T, H*D] strided (FlashInfer's layout)
    return q2, k2, q2.view(buf.shape[0], hq, d), k2.view(buf.shape[0], hk, d)


def rope(tokens, hidden, style, rotary_dim):
    import flashinfer
    import torch

    import fivar.triton_ops as T
    from ...fusion import reference as R
    d, hq = HEAD_DIM, hidden // HEAD_DIM
    hk = max(1, hq // 4)
    buf = torch.randn(tokens, (hq + 2 * hk) * d, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, MAX_POS, (tokens,), device="cuda")
    cs = R.cos_sin_cache(MAX_POS, rotary_dim, device="cuda")
    _, _, q, k = _views(buf, hq, hk, d)
    ref = (R.apply_rope(q, pos, cs, rotary_dim, style), R.apply_rope(k, pos, cs, rotary_dim, style))
    a, b = buf.clone(), buf.clone()
    _, _, qa, ka = _views(a, hq, hk, d)
    qb2, kb2, qb, kb = _views(b, hq, hk, d)
    neox = style == "neox"
    return _prepared(lambda: (T.apply_rope(qa, ka, pos, cs, rotary_dim, style), (qa, ka))[1],
                     lambda: (flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, qb2, kb2, d, cs, is_neox=neox),
                              (qb, kb))[1], ref,
                     tokens * (hq + hk) * rotary_dim * 2 * 2 + tokens * rotary_dim * 4 + tokens * 8,
                     "apply_rope_with_cos_sin_cache_inplace")


def qk_norm_rope(tokens, hidden, eps=1e-6):
    import flashinfer
    import torch

    import fivar.triton_ops as T
    from ...fusion import reference as R
    d, hq = HEAD_DIM, hidden // HEAD_DIM
    hk = max(1, hq // 4)
    buf = torch.randn(tokens, (hq + 2 * hk) * d, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, MAX_POS, (tokens,), device="cuda")
    cs = R.cos_sin_cache(MAX_POS, d, base=1000000.0, device="cuda")
    qw = torch.randn(d, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    kw = torch.randn(d, dtype=torch.bfloat16, device="cuda") * 0.3 + 1
    _, _, q, k = _views(buf, hq, hk, d)
    ref = (R.apply_rope(R.rms_norm(q, qw, eps), pos, cs, d, "neox"), R.apply_rope(R.rms_norm(k, kw, eps), pos, cs, d,
                                                                                    "neox"))
    a, b = buf.clone(), buf.clone()
    _, _, qa, ka = _views(a, hq, hk, d)
    qb2, kb2, qb, kb = _views(b, hq, hk, d)

    def stock():
        flashinfer.rmsnorm(qb, qw, eps, out=qb)
        flashinfer.rmsnorm(kb, kw, eps, out=kb)
        flashinfer.apply_rope_with_cos_sin_cache_inplace(pos, qb2, kb2, d, cs, is_neox=True)
        return qb, kb
    return _prepared(lambda: (T.qk_norm_rope(qa, ka, qw, kw, pos, cs, d, eps=eps), (qa, ka))[1], stock, ref,
                     tokens * (hq + hk) * d * 2 * 2 + tokens * d * 4 + tokens * 8,
                     "rmsnorm + rmsnorm + apply_rope_with_cos_sin_cache_inplace")


def cases(quick: bool = False) -> list:
    t, h = (4096 if quick else 65536), 4096
    shape = {"tokens": t, "hidden": h, "dtype": "bf16"}
    made = [("rmsnorm", "rmsnorm", lambda: rmsnorm(t, h), {}),
            ("fused_add_rmsnorm", "add_rmsnorm", lambda: fused_add_rmsnorm(t, h), {}),
            ("rope_neox", "rope", lambda: rope(t, h, "neox", HEAD_DIM), {"rotary_dim": HEAD_DIM}),
            ("rope_gptj", "rope", lambda: rope(t, h, "gptj", HEAD_DIM // 2), {"rotary_dim": HEAD_DIM // 2}),
            ("qk_norm_rope", "qk_norm_rope", lambda: qk_norm_rope(t, h), {})]
    return [Case("triton-ops", f"{name} tokens={t} hidden={h}", op, {**shape, **extra}, fn, baseline="stock")
            for name, op, fn, extra in made]
