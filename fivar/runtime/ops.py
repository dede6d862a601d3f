"""A variant's entry points as `torch.library` custom ops, so `torch.compile(fullgraph=True)` keeps them in one graph.

The entry points check their inputs on the host (indptr contents, page numbers, params) before launching, which
Dynamo cannot trace. Under `torch.compile` they call these ops instead: opaque to the compiler, with a fake
(meta) implementation that gives the output's and the LSE's shapes and dtypes, and a real one that runs the
ordinary entry point, checks included, when the compiled graph executes.

Each variant gets its own op family, registered the first time it is called: the namespace
`fivar_<name>_<hash>` carries the hash of the variant's generated code (its Triton twin's content hash), so two
variants never share an op, and the same variant loaded twice reuses it. The ops:

    prefill(q, k, v, causal, sm_scale, backend, return_lse, *params)                       -> (out, lse)
    ragged(q, k, v, qo_indptr, kv_indptr, causal, sm_scale, backend, return_lse, *params)  -> (out, lse)
    paged(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask, packed_custom_mask,
          mask_indptr, causal, sm_scale, backend, return_lse, *params)                    -> (out, lse)
    decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, backend, return_lse,
           *params)                                                                        -> (out, lse)
    plan_run(plan, q, k, v, return_lse)                                                    -> (out, lse)

Scalar params are `float?`/`int?` arguments and tensor params `Tensor?` ones (None: the declaration's default),
named `p_<param>`. Without return_lse the op's lse is an empty float32 tensor, dropped by the caller. A plan
(`plan_paged`, `plan_ragged`) is an int handle into a table of live plans: planning stays outside the graph, as
in FlashInfer, and `.run` is the op.
"""
from __future__ import annotations

import weakref

import torch

from ..spec.live import variant_by_key
from ..spec.params import Scalar
from .plan_handles import plan_handle, plan_of

#: Arguments before the params, per op (schema text).
_HEADS = {
    "prefill": "Tensor q, Tensor k, Tensor v, bool causal, float? sm_scale, str backend, bool return_lse",
    "ragged": "Tensor q, Tensor k, Tensor v, Tensor qo_indptr, Tensor kv_indptr, bool causal, float? sm_scale, "
              "str backend, bool return_lse",
    "paged": "Tensor q, Tensor k_cache, Tensor v_cache, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, "
             "Tensor kv_last_page_len, Tensor? custom_mask, Tensor? packed_custom_mask, Tensor? mask_indptr, "
             "bool causal, float? sm_scale, str backend, bool return_lse",
    "decode": "Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, Tensor kv_indices, "
              "Tensor kv_last_page_len, float? sm_scale, str backend, bool return_lse",
}


class OpFamily:
    """The custom ops of one variant (this module's docstring); `namespace` names them under torch.ops."""

    def __init__(self, variant, namespace: str):
        self.variant, self.namespace = variant, namespace
        self.param_names = list(variant.params)
        self.lib = torch.library.Library(namespace, "DEF")
        params = ", ".join(f"{'Tensor' if not isinstance(p, Scalar) else 'float' if p.dtype is float else 'int'}? "
                           f"p_{name}" for name, p in variant.params.items())
        for op, head in _HEADS.items():
            self._define(op, head + (", " + params if params else ""), getattr(self, f"_{op}"))
        self._define("plan_run", "Tensor q, int plan, Tensor k, Tensor v, bool return_lse", self._plan_run)

    def _define(self, op: str, args: str, impl):
        self.lib.define(f"{op}({args}) -> (Tensor, Tensor)")
        self.lib.impl(op, impl, "CompositeExplicitAutograd")
        flag_at = args.split(", ").index("bool return_lse") - 1  # among the arguments after q
        torch.library.register_fake(f"{self.namespace}::{op}", _fake_for(flag_at), lib=self.lib)

    def _params(self, values) -> dict:
        return {n: v for n, v in zip(self.param_names, values) if v is not None}

    # --- the real implementations: the ordinary entry points (checks included) --------------------
    # reached through the variant's own methods, which import the runtime when called: this module is what those
    # entry points call under torch.compile, so importing them here would close a circle
    def _prefill(self, q, k, v, causal, sm_scale, backend, return_lse, *params):
        return _pair(self.variant.prefill(q, k, v, causal=causal, sm_scale=sm_scale, backend=backend,
                                          return_lse=return_lse, **self._params(params)), q, return_lse)

    def _ragged(self, q, k, v, qo_indptr, kv_indptr, causal, sm_scale, backend, return_lse, *params):
        return _pair(self.variant.batch_prefill_ragged(q, k, v, qo_indptr, kv_indptr, causal=causal,
                                                       sm_scale=sm_scale, backend=backend, return_lse=return_lse,
                                                       **self._params(params)), q, return_lse)

    def _paged(self, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, custom_mask,
               packed_custom_mask, mask_indptr, causal, sm_scale, backend, return_lse, *params):
        return _pair(self.variant.batch_prefill_paged(q, (k_cache, v_cache), qo_indptr, kv_indptr, kv_indices,
                                                      kv_last_page_len, causal=causal, sm_scale=sm_scale,
                                                      backend=backend, return_lse=return_lse,
                                                      custom_mask=custom_mask, packed_custom_mask=packed_custom_mask,
                                                      mask_indptr=mask_indptr, **self._params(params)), q, return_lse)

    def _decode(self, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, backend, return_lse,
                *params):
        return _pair(self.variant.decode(q, (k_cache, v_cache), kv_indptr, kv_indices, kv_last_page_len,
                                         sm_scale=sm_scale, backend=backend, return_lse=return_lse,
                                         **self._params(params)), q, return_lse)

    def _plan_run(self, q, plan, k, v, return_lse):
        p = plan_of(plan)
        result = p.run(q, k, v, return_lse=return_lse) if p.kv_form == "ragged" else \
            p.run(q, (k, v), return_lse=return_lse)
        return _pair(result, q, return_lse)


def _pair(result, q, return_lse):
    """(out, lse) of an entry point's result; without return_lse an empty lse (an op returns a fixed arity)."""
    return result if return_lse else (result, q.new_empty((0,), dtype=torch.float32))


def _fake_for(position: int):
    """The fake of an op whose return_lse flag is argument `position` after q: output like q, lse [tokens, Hq]."""
    def fake(q, *args):
        return_lse = args[position]
        return q.new_empty(q.shape), q.new_empty(q.shape[:2] if return_lse else (0,), dtype=torch.float32)
    return fake


_families: dict[str, OpFamily] = {}
_by_variant: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def namespace_of(variant) -> str:
    """`fivar_<name>_<hash of the generated code>`."""
    from ..codegen.triton import render_attention
    from ..jit.triton_module import module_name
    return module_name(variant, render_attention(variant)).replace("_triton_", "_", 1)


def ops_namespace(variant) -> str:
    """The variant's op namespace, its ops registered (once per process)."""
    return _namespace(variant.key)


# Runs eagerly under torch.compile, which keeps the result as a constant: its argument is the variant's key (a
# string, a constant to Dynamo), not the variant object, which Dynamo cannot pass to such a function.
@torch._dynamo.assume_constant_result
def _namespace(key: str) -> str:
    variant = variant_by_key(key)
    fam = _by_variant.get(variant)
    if fam is None:
        ns = namespace_of(variant)
        fam = _families.get(ns)
        if fam is None:
            fam = _families[ns] = OpFamily(variant, ns)
        _by_variant[variant] = fam
    return fam.namespace


def ops_of(variant):
    """torch.ops.<namespace>: the variant's ops."""
    return getattr(torch.ops, ops_namespace(variant))


def _param_args(variant, params: dict, return_lse: bool) -> list:
    """The op's param arguments; what the fake cannot know (an LSE without softmax, a misspelt param) is refused
    here, while tracing, rather than when the graph first runs."""
    from ..spec.inputs import check_known_params, check_lse
    check_lse(variant, return_lse)
    check_known_params(variant, params)  # the entry point would name it too, but only when the graph runs
    return [params.get(name) for name in variant.params]


def _result(pair, return_lse):
    return pair if return_lse else pair[0]


# --- what the entry points call under torch.compile ---------------------------------------------------
def prefill(variant, q, k, v, *, causal, sm_scale, backend, params, return_lse):
    return _result(ops_of(variant).prefill(q, k, v, bool(causal), sm_scale, backend, bool(return_lse),
                                           *_param_args(variant, params, return_lse)), return_lse)


def ragged(variant, q, k, v, qo_indptr, kv_indptr, *, causal, sm_scale, backend, params, return_lse):
    return _result(ops_of(variant).ragged(q, k, v, qo_indptr, kv_indptr, bool(causal), sm_scale, backend,
                                          bool(return_lse), *_param_args(variant, params, return_lse)), return_lse)


def paged(variant, q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, *, causal, sm_scale,
          backend, params, return_lse, masks=(None, None, None)):
    """masks: (custom_mask, packed_custom_mask, mask_indptr), checked when the graph runs, as every index tensor."""
    return _result(ops_of(variant).paged(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                         *masks, bool(causal), sm_scale, backend, bool(return_lse),
                                         *_param_args(variant, params, return_lse)), return_lse)


def decode(variant, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, *, sm_scale, backend, params,
           return_lse):
    return _result(ops_of(variant).decode(q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale,
                                          backend, bool(return_lse), *_param_args(variant, params, return_lse)), return_lse)


def plan_run(plan, q, k, v, return_lse):
    """A plan's run as an op: k, v are the key/value tensors of a ragged plan or the caches of a paged one."""
    return _result(ops_of(plan.variant).plan_run(q, plan_handle(plan), k, v, bool(return_lse)), return_lse)
