"""A module's form is one ModuleKey (fivar.jit.module_key): gen_module renders the same module from the key as from
its keywords, a manifest's options give the key back, module_for memoizes on it, and URIs name the same forms."""
import os
import random
import re

import pytest
import torch

import fivar
from fivar import config as fivar_config
from fivar.bench.suites import masks
from fivar.errors import FivarError
from fivar.jit import toolchain
from fivar.jit.build import gen_module, module_for, rendered_from
from fivar.jit.module_key import ModuleKey

#: (variant, op, target, form) -> the URI it renders with the toolchain in PINNED_WITH: forms across both targets
PINNED = {
    ("softcap", "single_prefill", "fa2", ()): "fivar_softcap_fa2_single_prefill_bf16_hd128_88d02656fe15",
    ("softcap", "single_prefill", "fa3", ()): "fivar_softcap_fa3_single_prefill_bf16_hd128_d9b4f6cd8f96",
    ("softcap", "single_prefill", "fa3", (("bounded_softmax", False),)):
        "fivar_softcap_fa3_single_prefill_bf16_hd128_d1ea6534f83f",
    ("document_window", "batch_prefill", "fa2", (("kv_segments", True), ("mask_free", True))):
        "fivar_document_window_fa2_batch_prefill_kvsegfree_bf16_hd128_fdc124011d30",
    ("document_window", "batch_prefill", "fa2", (("tile_list", True),)):
        "fivar_any_mask_fa2_batch_prefill_tiles_bf16_hd128_1e810608e87a",
    ("document_window", "batch_prefill", "fa2", (("custom_mask", True),)):
        "fivar_any_mask_fa2_batch_prefill_tiles_bf16_hd128_1e810608e87a",
    ("document_window", "batch_prefill", "fa3", (("custom_mask", True),)):
        "fivar_any_mask_fa3_batch_prefill_tiles_bf16_hd128_ed6ee3400f1f",
    ("bigbird", "batch_prefill", "fa3", ()): "fivar_any_mask_fa3_batch_prefill_tiles_bf16_hd128_ed6ee3400f1f",
    ("sliding_window", "batch_decode", "fa2", (("kv_dtype", "fp8e4m3"),)):
        "fivar_sliding_window_fa2_batch_decode_kvfp8e4m3_bf16_hd128_25058f85a18d",
    ("sliding_window", "batch_decode", "fa2", (("kv_segments", True),)):
        "fivar_sliding_window_fa2_batch_decode_kvseg_bf16_hd128_94841c3baee9",
}
PINNED_WITH = ("0.7.2.post1", "13.0.88", "90a")  # FlashInfer, nvcc, target archs: all in the content hash


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")


def _variant(name):
    return masks.load(name) if name in masks.BATTERY else fivar.load(name)


def test_representative_uris_are_stable(monkeypatch):
    """The URI of each form: its name part always, its content hash where the toolchain is the one it was taken
    with (another FlashInfer or nvcc rightly renders another hash), every tuning variable at its default."""
    for var in fivar_config.ENV.values():
        monkeypatch.delenv(var, raising=False)
    same_toolchain = ((toolchain.flashinfer_version(), toolchain.nvcc_version(), toolchain.arch_tag()) == PINNED_WITH
                      and not os.environ.get("FLASHINFER_JIT_DEBUG") and not os.environ.get("FLASHINFER_JIT_LINEINFO"))
    for (name, op, target, form), uri in PINNED.items():
        got = gen_module(_variant(name), ModuleKey(op, target, **dict(form))).uri
        assert got == uri if same_toolchain else got[:-12] == uri[:-12], (name, op, target, form)


FORMS = [("softcap", "single_prefill", "fa2", {}), ("softcap", "single_prefill", "fa3", {}),
         ("softcap", "single_prefill", "fa3", dict(bounded_softmax=False)),
         ("alibi", "batch_prefill", "fa2", dict(kv_dtype="fp8e4m3")),
         ("sliding_window", "batch_decode", "fa2", dict(kv_segments=True)),
         ("document_window", "batch_prefill", "fa2", dict(kv_segments=True)),
         ("document_window", "batch_prefill", "fa2", dict(kv_segments=True, mask_free=True)),
         ("document_window", "batch_prefill", "fa2", dict(tile_list=True)),
         ("document_window", "batch_prefill", "fa2", dict(custom_mask=True)),
         ("document_window", "batch_prefill", "fa3", dict(custom_mask=True)),
         ("bigbird", "batch_prefill", "fa3", {})]


@pytest.mark.parametrize("name,op,target,form", FORMS)
def test_key_keywords_and_manifest_options_render_one_module(name, op, target, form):
    v = _variant(name)
    dtype, head_dim = random.choice([("bf16", 128), ("fp16", 64), ("fp16", 256)])
    key = ModuleKey(op, target, dtype, head_dim, **form)
    m = gen_module(v, key)
    assert gen_module(v, op, target, dtype, head_dim, **form).uri == m.uri
    # a manifest's record (fivar.jit.integrity re-renders it): the key back, and the resolved config beside it
    again, config = ModuleKey.from_options(m.op, m.target, m.dtype, m.head_dim, m.options)
    assert gen_module(v, again, **config).uri == m.uri
    # the same form; bounded_softmax recorded as the config resolved it where the key left it to the config
    assert again.checked(v).replace(bounded_softmax=key.bounded_softmax) == key.checked(v)
    assert (again.bounded_softmax is not None) == (target == "fa3")
    kernel = rendered_from(v, key.checked(v))  # a bits-reading tile list: the kernel every mask shares
    assert re.fullmatch(rf"fivar_{kernel.name}_{key.checked(v).uri_part()}_[0-9a-f]{{12}}", m.uri)
    assert m.kernel_variant is kernel and (kernel is v) == (kernel.name == v.name)


def test_module_for_memoizes_on_the_key():
    v = fivar.load("sliding_window")
    m = module_for(v, ModuleKey("batch_decode", "fa2", torch.bfloat16, 128, kv_dtype="fp8e4m3"))
    assert module_for(v, "batch_decode", "fa2", "bf16", 128, kv_dtype="fp8e4m3") is m  # a torch dtype is its name
    assert module_for(v, ModuleKey("batch_decode", "fa2", "bf16", 128)) is not m


def test_the_key_and_its_keywords_are_not_both_taken():
    with pytest.raises(TypeError, match="not both"):
        gen_module(fivar.load("softcap"), ModuleKey("single_prefill", "fa3"), bounded_softmax=False)


@pytest.mark.parametrize("key,match", [
    (ModuleKey("batch_decode", "fa3"), "no FA3 kernel for batch_decode"),
    (ModuleKey("single_prefill", "fa2", kv_dtype="fp8e4m3"), "FP8 KV cache runs on FA2's paged kernels"),
    (ModuleKey("batch_prefill", "fa2", mask_free=True), "mask-free form is FA2's key-segments form"),
    (ModuleKey("single_prefill", "fa2", custom_mask=True), "custom-mask form is FA2 or FA3 batch prefill"),
    (ModuleKey("batch_prefill", "fa2", custom_mask=True, kv_dtype="fp8e4m3"), "custom-mask form is FA2 or FA3"),
    (ModuleKey("batch_prefill", "fa2", custom_mask=True, kv_segments=True), "custom-mask form is FA2 or FA3"),
    (ModuleKey("single_prefill", "fa2", tile_list=True), "tile_list=True asks for FA2 batch prefill"),
    (ModuleKey("single_prefill", "fa4"), "target 'fa4' is not available"),
    (ModuleKey("single_prefill", "fa2", head_dim=96), "head_dim 96 is not supported"),
])
def test_an_impossible_form_is_one_line(key, match):
    v = _variant("document_window")
    for attempt in (lambda: key.checked(v), lambda: gen_module(v, key)):
        with pytest.raises(FivarError, match=match) as e:
            attempt()
        assert "\n" not in str(e.value)
