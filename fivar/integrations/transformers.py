"""fivar as a Hugging Face transformers attention implementation.

    import fivar.integrations.transformers as fivar_hf
    name = fivar_hf.register()                                   # "fivar", backend "auto"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name, dtype=torch.bfloat16)
    model.generate(...)

`register` adds a function to transformers' `AttentionInterface` (and FlashAttention's mask convention to
`AttentionMaskInterface`: no mask when a batch has no padding, else the 2-D padding mask). Per call, the attention
module's arguments choose the variant: `softcap` (Gemma 2's attn_logit_softcapping) -> `softcap`, `sliding_window`
-> `sliding_window`, both -> `softcap_sliding_window`, neither -> plain softmax attention, with `scaling` as
sm_scale and the module's `is_causal`. Attention sinks (gpt-oss's `s_aux`, one logit per head joining the softmax
denominator) are the variant's own `sink`, added inside the kernel: `gpt_oss` (sinks and a window) for gpt-oss's
local layers, `attention_sink` below for its full ones. A soft-cap with sinks (no model has both) takes them from
the kernel's log-sum-exp instead: softmax over [logits, s] is out * sigmoid(lse_e - s), lse_e the natural-log LSE.

A padded batch is unpadded into a ragged batch (each row's kept keys must be one run, as left or right padding
gives); padded query rows come back as zeros. The window and the causal mask count positions from the end of each
row's keys (fivar's bottom-right alignment), which is what a KV cache, sliding or not, holds.
"""
from __future__ import annotations

import torch

from ..errors import FivarError
from ..spec import AttentionVariant
from ..spec.params import Tensor


def _score(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score


def _head_sink(qo_head, params):
    return params.sinks[qo_head]


#: Softmax attention with no transform: the model's layers without soft-cap or window.
PLAIN = AttentionVariant(name="plain", logits=_score, doc="Plain softmax attention.")
#: Softmax attention with a sink per query head: gpt-oss's full-attention layers (its local ones are `gpt_oss`).
SINK = AttentionVariant(name="attention_sink", sink=_head_sink, params={"sinks": Tensor("float32", ("qo_head",))},
                        doc="Softmax attention with a learned sink logit per query head.")


#: The bundled variants the calls choose from, loaded by register(): a lookup here is traceable, where loading
#: (the registry reads the working directory) would break a torch.compile graph at every attention call.
_BUNDLED = ("softcap_sliding_window", "softcap", "sliding_window", "gpt_oss")
_loaded: dict[str, AttentionVariant] = {}


def _variant(name: str) -> AttentionVariant:
    v = _loaded.get(name)
    if v is None:
        import fivar
        v = _loaded[name] = fivar.load(name)
    return v


def variant_for(softcap: float | None, sliding_window: int | None, sinks: bool = False) -> tuple[AttentionVariant,
                                                                                                 dict]:
    """The fivar variant and params for a transformers attention call's soft-cap, window and (with `sinks`) sinks;
    the caller adds the sink logits as params["sinks"] when the variant declares them."""
    params = {}
    if softcap:
        params["softcap"] = float(softcap)
    if sliding_window:
        params["window"] = int(sliding_window)
    if sinks and not softcap:
        return (_variant("gpt_oss") if sliding_window else SINK), params
    name = {(True, True): "softcap_sliding_window", (True, False): "softcap", (False, True): "sliding_window"}.get(
        (bool(softcap), bool(sliding_window)))
    return (_variant(name) if name else PLAIN), params


def _runs(mask: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, length) of each row's kept positions of a 2-D padding mask; refuses a row that is not one run."""
    mask = mask.bool()
    lengths = mask.sum(1)
    first = torch.where(lengths > 0, mask.int().argmax(1), 0)
    pos = torch.arange(mask.shape[1], device=mask.device)
    run = (pos >= first[:, None]) & (pos < (first + lengths)[:, None])
    if not bool((run == mask).all()):
        raise FivarError(f"fivar attention (transformers): the {what} of each row must be one run of positions "
                         "(left or right padding); got a mask with holes")
    return first, lengths


def fivar_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                    sliding_window: int | None = None, softcap: float | None = None, s_aux=None, *,
                    backend: str = "auto", **kwargs):
    """transformers' attention signature: query [B, Hq, S, D], key/value [B, Hkv, S_kv, D]; returns
    ([B, S, Hq, D], None)."""
    if dropout and getattr(module, "training", False):
        raise FivarError("fivar attention (transformers): attention dropout is not supported (inference kernels); "
                         "put the model in eval() or set attention_dropout=0")
    variant, params = variant_for(softcap, sliding_window, sinks=s_aux is not None)
    in_kernel = "sinks" in variant.params
    if in_kernel:  # one logit per query head, in the dtype the variant declares
        params["sinks"] = s_aux.reshape(-1).float()
    batch, hq, s, d = query.shape
    kv_len = key.shape[2]
    causal = bool(getattr(module, "is_causal", True))
    q = query.transpose(1, 2)  # [B, S, Hq, D]
    k, v = key.transpose(1, 2), value.transpose(1, 2)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise FivarError("fivar attention (transformers): expected no mask or a 2-D padding mask (register() sets "
                         f"transformers' flash-attention mask convention), got a {attention_mask.dim()}-D mask")
    if attention_mask is None:
        qo_lens = torch.full((batch,), s, dtype=torch.int32)
        kv_lens = torch.full((batch,), kv_len, dtype=torch.int32)
        q_flat, k_flat, v_flat = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    else:
        kv_mask = attention_mask[:, -kv_len:].bool()
        _runs(kv_mask, "padding mask")
        q_mask = kv_mask[:, -s:]
        _runs(q_mask, "query rows")
        qo_lens, kv_lens = q_mask.sum(1).int().cpu(), kv_mask.sum(1).int().cpu()
        q_flat, k_flat, v_flat = q[q_mask], k[kv_mask], v[kv_mask]
    indptr = lambda lens: torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]).to(query.device)  # noqa: E731
    from_lse = s_aux is not None and not in_kernel
    out = variant.batch_prefill_ragged(q_flat.contiguous(), k_flat.contiguous(), v_flat.contiguous(),
                                       indptr(qo_lens), indptr(kv_lens), causal=causal, sm_scale=scaling,
                                       backend=backend, return_lse=from_lse, **params)
    if from_lse:  # sinks beside a soft-cap: the extra softmax term exp(s) scales the output by sigmoid(lse_e - s)
        out, lse = out
        sink = s_aux.reshape(-1).float()  # one logit per query head
        out = (out.float() * torch.sigmoid(lse * 0.6931471805599453 - sink)[..., None]).to(out.dtype)
    if attention_mask is None:
        return out.view(batch, s, hq, d), None
    full = out.new_zeros(batch, s, hq, d)
    full[q_mask] = out
    return full, None


def register(name: str = "fivar", *, backend: str = "auto") -> str:
    """Registers fivar under `name` with transformers' AttentionInterface (and the mask convention it needs);
    pass the name as `attn_implementation`. `backend`: "auto", "fa2", "fa3", or "triton"."""
    import functools

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    from ..runtime.attention import ALL_BACKENDS
    if backend not in ALL_BACKENDS:
        raise FivarError(f"fivar attention (transformers): backend {backend!r} is not available (choose from "
                         f"{', '.join(ALL_BACKENDS)})")
    for bundled in _BUNDLED:
        _variant(bundled)
    fn = functools.partial(fivar_attention, backend=backend)
    functools.update_wrapper(fn, fivar_attention)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
