"""A tile-list module that reads its cut tiles as bits evaluates no mask, so it is rendered from the mask-free
bits_kernel (fivar.codegen.tile_list) and shared by every variant with the same logits and sink: one URI for a seeded
random battery of masks from the spec grammar, none of a mask's params or file in its sources, a different URI as
soon as the logits or the sink differ, and the launch's arguments exactly the ones the shared struct declares."""
import random
import textwrap

import pytest

import fivar
from fivar.bench.suites import masks as battery, random_masks
from fivar.codegen.cuda import additional_args, param_ident
from fivar.codegen.tile_list import BITS_KERNEL, bits_kernel, mask_reads_head
from fivar.jit.build import gen_module, serving_modules
from fivar.errors import FivarError
from fivar.jit.integrity import variant_matches_uri


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")


def _write(tmp_path, name, mask, logits=None, params="", sink=None):
    """A variant file as a user writes one, outside the tree."""
    parts = ["import fivar", f"def mask(b, h, kh, q, k, p):\n    return {mask}"]
    if logits:
        parts.append(f"def logits(s, b, h, kh, q, k, p):\n    return {logits}")
    if sink:
        parts.append(f"def sink(h, p):\n    return {sink}")
    parts.append(textwrap.dedent(f"""\
        variant = fivar.AttentionVariant(name={name!r}, mask=mask, logits={'logits' if logits else None},
                                         sink={'sink' if sink else None}, params={{{params}}})"""))
    path = tmp_path / f"{name}.py"
    path.write_text("\n\n".join(parts) + "\n")
    return fivar.load(str(path))


def _mask_params(v):
    return [n for n in v.params if n not in bits_kernel(v).params]


def test_every_mask_of_a_random_battery_shares_one_fa3_module():
    seed = random.randrange(1 << 20)
    drawn = [random_masks.load(m) for m in random_masks.generate(seed, 6)]
    named = [battery.load(n) for n in random.sample(sorted(battery.BATTERY), 4)]
    variants = [v for v in drawn + named if v.scans_mask and v.logits is None and v.sink is None]
    assert len(variants) >= 4, seed
    mods = [gen_module(v, "batch_prefill", "fa3") for v in variants]
    assert len({m.uri for m in mods}) == 1, seed
    assert mods[0].uri.startswith(f"fivar_{BITS_KERNEL}_fa3_batch_prefill_tiles_")
    for v, m in zip(variants, mods):
        text = "".join(m.sources.values())
        assert m.variant is v and m.kernel_variant.name == BITS_KERNEL and m.kernel_variant.mask is None
        # the kernel reads the block map and bits, never the mask's params, and names no user file
        assert not any(param_ident(n) in text for n in _mask_params(v)), (v.name, seed)
        assert v.source_file is None or v.source_file.rsplit("/", 1)[-1] not in text
        # what a build or prewarm compiles for single prefill too: that module, and where the mask keeps the same
        # keys for every head, the logits' mask-free one a causal batch of segments runs (shared as well)
        man = {"variant": v.name, "target": "fa3", "op": "batch_prefill", "dtype": "bf16", "head_dim": 128}
        built = [x.uri for x in serving_modules(v, "single_prefill", "fa3")]
        if mask_reads_head(v):
            assert built == [m.uri]
        else:
            free = gen_module(v, "batch_prefill", "fa3", mask_free=True)
            assert free.uri.startswith(f"fivar_{BITS_KERNEL}_fa3_batch_prefill_free_")
            assert free.kernel_variant.mask is None and built == [m.uri, free.uri]
            assert variant_matches_uri(man, free.uri)
        # a manifest naming the variant that built it vouches for the shared URIs (fivar.jit.integrity)
        assert variant_matches_uri(man, m.uri)
        assert not variant_matches_uri({**man, "op": "single_prefill"}, m.uri)


def test_the_logits_and_the_sink_make_their_own_module(tmp_path):
    """Same logits in two files under two names: one module; other logits, a sink, or another head dim: another."""
    a = _write(tmp_path, "flags_a", "(k % p.stride == 0) or (q - k < p.w)",
               logits="30.0 * fivar.tanh(s / 30.0)", params="'stride': fivar.Scalar(int, default=4), "
               "'w': fivar.Scalar(int, default=64)")
    b = _write(tmp_path, "blocks_b", "(q // p.c) == (k // p.c)", logits="30.0 * fivar.tanh(s / 30.0)",
               params="'c': fivar.Scalar(int, default=96)")
    plain = _write(tmp_path, "plain_c", "(q // 128) % 3 == (k // 128) % 3")
    bias = _write(tmp_path, "bias_d", "k % p.stride == 0", logits="s + p.slope * (k - q)",
                  params="'stride': fivar.Scalar(int, default=3), 'slope': fivar.Scalar(float, default=0.01)")
    sink = _write(tmp_path, "sink_e", "(q // 128) % 3 == (k // 128) % 3", sink="0.5",
                  params="")
    uri = {v.name: gen_module(v, "batch_prefill", "fa3").uri for v in (a, b, plain, bias, sink)}
    assert uri["flags_a"] == uri["blocks_b"]
    assert len({uri[n] for n in ("flags_a", "plain_c", "bias_d", "sink_e")}) == 4
    assert gen_module(a, "batch_prefill", "fa3", "bf16", 64).uri != uri["flags_a"]
    # a param the logits read stays, even where the mask reads it too; the mask's alone go
    both = _write(tmp_path, "both_f", "k % p.stride == 0", logits="s - 0.01 * p.stride",
                  params="'stride': fivar.Scalar(int, default=3), 'w': fivar.Scalar(int, default=7)")
    assert list(bits_kernel(both).params) == ["stride"] and list(bits_kernel(bias).params) == ["slope"]


@pytest.mark.parametrize("name", ["causal_window_global", "bigbird", "random_keys", "document_window"])
def test_the_launch_passes_what_the_shared_struct_declares(name):
    """kernel_args of the module's kernel_variant is the module's `additional` list, name for name (tensors with
    their sizes and strides, then scalars): the runtime never passes a mask param to the shared kernel."""
    v = battery.load(name)
    m = gen_module(v, "batch_prefill", "fa3")
    args = additional_args(m.kernel_variant, with_causal_flag=False,
                           extra_tensors=["fv_blocks", "fv_tile_keys", "fv_cut_bits"])
    t_names, _, s_names, _ = m.additional
    assert [a.name for a in args] == list(t_names) + list(s_names)
    assert not any(param_ident(n) in t_names + s_names for n in _mask_params(v))


def test_a_mask_reading_the_head_shares_the_module_too():
    """Its bits are per query head (the struct offsets them by its CTA's head): the same kernel as any other mask."""
    v, other = battery.load("longnet_heads"), battery.load("dilated_window")
    m = gen_module(v, "batch_prefill", "fa3")
    assert mask_reads_head(v) and m.kernel_variant.name == BITS_KERNEL
    assert m.uri == gen_module(other, "batch_prefill", "fa3").uri


def test_fa3_segments_take_the_logits_alone_where_they_read_no_position(tmp_path):
    """FA3's mask-free segments module (a causal batch of documents or chunks in kCausal mode) is the logits'
    kernel without the mask: shared by masks of the same logits, refused where the logits read a position or the
    batch entry (its requests are segments: nothing maps them back)."""
    a = _write(tmp_path, "docs_cap", "p.doc[0, q] == p.doc[0, k]", logits="30.0 * fivar.tanh(s / 30.0)",
               params="'doc': fivar.Tensor('int32', ('batch', 'position'))")
    b = _write(tmp_path, "chunks_cap", "(q // p.c) == (k // p.c)", logits="30.0 * fivar.tanh(s / 30.0)",
               params="'c': fivar.Scalar(int, default=64)")
    fa, fb = (gen_module(v, "batch_prefill", "fa3", mask_free=True) for v in (a, b))
    assert fa.uri == fb.uri and "_free_" in fa.uri and fa.kernel_variant.mask is None
    config = "".join(fa.sources.values())
    assert not any(param_ident(n) in config for n in ("doc", "c"))
    biased = _write(tmp_path, "docs_alibi", "p.doc[0, q] == p.doc[0, k]", logits="s - 0.5 * (q - k)",
                    params="'doc': fivar.Tensor('int32', ('batch', 'position'))")
    with pytest.raises(FivarError, match="mask-free form"):
        gen_module(biased, "batch_prefill", "fa3", mask_free=True)
    assert [m.options.get("mask_free", False) for m in serving_modules(biased, "batch_prefill", "fa3")] == [False]
    heads = _write(tmp_path, "docs_heads", "p.doc[0, q] == p.doc[0, k] and q - k < p.w[h]",
                   params="'doc': fivar.Tensor('int32', ('batch', 'position')), "
                   "'w': fivar.Tensor('int32', ('qo_head',))")
    with pytest.raises(FivarError, match="same keys for every head"):  # a segment is the batch's, not a head's
        gen_module(heads, "batch_prefill", "fa3", mask_free=True)

