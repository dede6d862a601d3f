"""The training battery (benchmarks/train/*.py, the train suite's cases after the bundled four): every file loads and
parses, `--list` names every case without a GPU, and for a few of them the Triton twin's forward + backward (the
interpreter, tiny float16 shapes) gives the gradients of q, k, v and of every learnable param that float64 autograd
of the torch reference gives, with fresh random inputs."""
import io
from contextlib import redirect_stdout

import pytest
import torch

from fivar import AttentionVariant, Tensor
from fivar.bench.suites import train as suite
from fivar.testing import check_gradients, example_params

DTYPE = torch.float16  # the interpreter has no bfloat16 arithmetic


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_the_battery_is_the_folder():
    """Every file of benchmarks/train is a case, and every case a file (a new file is not left out of the suite)."""
    assert sorted(p.stem for p in suite.battery_dir().glob("*.py")) == sorted(suite.BATTERY)


@pytest.mark.parametrize("name", suite.BATTERY)
def test_battery_file_loads_and_parses(name):
    v = suite.load(name)
    assert v.name == name and v.ir is not None and v.doc
    learnable = [n for n, p in v.tensor_params.items() if p.learnable]
    # the mask-only and document cases learn nothing; every other one learns its float tables
    assert bool(learnable) == (name not in ("doc_causal_window", "strided_causal")), learnable
    assert all(p.learnable for p in v.tensor_params.values() if p.ir_type == "f32")


def test_list_names_every_battery_case():
    """`python -m fivar.bench --suite train --list`, in-process: the bundled four first, as they were, then the
    battery, each selectable by --case."""
    from fivar.bench.runner import main
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--suite", "train", "--list"]) == 0
    names = [line.split("\t")[1] for line in out.getvalue().splitlines()]
    want = [f"{n} train S=8192 causal" for n in suite.VARIANTS + suite.BATTERY]
    assert names == want
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--suite", "train", "--list", "--case", "kerple_log"]) == 0
    assert [line.split("\t")[1] for line in out.getvalue().splitlines()] == ["kerple_log train S=8192 causal"]


def _check(name, qo_len, kv_len, causal=True, hq=4, hkv=2, d=16):
    v = suite.load(name)
    q = torch.randn(qo_len, hq, d, dtype=DTYPE)
    k, vv = (torch.randn(kv_len, hkv, d, dtype=DTYPE) for _ in range(2))
    params = example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=1, max_len=kv_len, device="cpu")
    r = check_gradients(v, q, k, vv, qo_lens=[qo_len], kv_lens=[kv_len], causal=causal, params=params, dtype=DTYPE)
    names = {x.case for x in r.results}
    assert {"dq", "dk", "dv"} | {f"d{n}" for n, p in v.tensor_params.items() if p.learnable} <= names
    assert r.passed, r


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power", "learned_alibi", "learned_softcap",
                                  "t5_buckets_learned", "learned_sinks"])
def test_battery_gradients_match_float64_autograd(interpret, name):
    """GQA 4/2, 21 queries over 37 keys (bottom-right aligned, lengths off the 16-wide tiles), causal as the suite
    runs them: dq, dk, dv and each learnable param's gradient."""
    _check(name, 21, 37)


def test_document_window_gradients(interpret):
    """The mask-only document case: dq, dk, dv through the pre-scanned mask, a window shorter than the documents."""
    v = suite.load("doc_causal_window")
    q, k, vv = (torch.randn(45, h, 16, dtype=DTYPE) for h in (4, 2, 2))
    ids = torch.zeros(1, 45, dtype=torch.int32)
    ids[0, int(torch.randint(8, 20, (1,))):] += 1
    ids[0, int(torch.randint(25, 40, (1,))):] += 1
    params = {"doc_ids": ids, "window": int(torch.randint(3, 12, (1,)))}
    r = check_gradients(v, q, k, vv, qo_lens=[45], kv_lens=[45], causal=True, params=params, dtype=DTYPE)
    assert r.passed, r


def test_strided_mask_gradients(interpret):
    """The mask-only strided case at a stride that leaves gaps at these lengths: dq, dk, dv."""
    v = suite.load("strided_causal")
    q, k, vv = (torch.randn(41, h, 16, dtype=DTYPE) for h in (4, 2, 2))
    params = {"stride": int(torch.randint(3, 9, (1,)))}
    r = check_gradients(v, q, k, vv, qo_lens=[41], kv_lens=[41], causal=True, params=params, dtype=DTYPE)
    assert r.passed, r


def test_battery_cases_prebuild_their_fa3_forward(monkeypatch):
    """On sm90 each battery case lists the FA3 module its default forward runs, for the runner's parallel prebuild
    (generated here, not compiled): every battery variant has an FA3 forward."""
    from fivar.bench.suites import _attention, cases_of
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(_attention, "_sm90", lambda: True)
    for case in cases_of("train")[len(suite.VARIANTS):]:
        mods = case.modules()
        assert mods and all("_fa3_" in m.uri for m in mods), case.name


def test_flex_with_a_sink_computes_the_variant():
    """The train suite's Flex contender for a variant with a sink: Flex of the rest, the sink joined from its
    log-sum-exp, gives the reference's output (eager Flex on the CPU; its backward needs a GPU)."""
    from fivar.bench.train import flex_with_sink_fn
    from fivar.codegen.torch_ref import reference_attention
    v = suite.load("learned_sinks")
    q, k, vv = torch.randn(23, 4, 16), torch.randn(23, 2, 16), torch.randn(23, 2, 16)
    params = {"sinks": torch.randn(4) * 3}
    got = flex_with_sink_fn(v, params, q, k, vv, causal=True, compile=False)()
    torch.testing.assert_close(got, reference_attention(v, q, k, vv, causal=True, params=params).float(),
                               atol=1e-5, rtol=1e-5)


def _power_logits(score, batch, qo_head, kv_head, q_idx, kv_idx, params):
    return score - params.r1[qo_head] * float(abs(kv_idx - q_idx)) ** params.r2[qo_head]


POWER = AttentionVariant(name="kerple_power_pow", logits=_power_logits, params={
    "r1": Tensor("float32", ("qo_head",), learnable=True), "r2": Tensor("float32", ("qo_head",), learnable=True)})


def _power_params(hq):
    """r2 at the exponent's edges as well: 0 (x ** 0 is 1, 0 ** 0 too), integers, fractions below and above 1."""
    r2 = torch.tensor([0.0, 1.0, 2.0, 0.5, 1.7, 0.25, 3.0, 0.8])[torch.cat([torch.zeros(1, dtype=torch.long),
                                                                           torch.randperm(7)[:hq - 1] + 1])]
    return {"r1": torch.rand(hq) + 0.1, "r2": r2 + 0.01 * torch.rand(hq) * (r2 != r2.round())}


def test_kerple_power_as_the_paper_writes_it_matches_torch_pow():
    """`d ** r2` (the paper's form, d = |kv - q| >= 0 with d = 0 on the diagonal) in float64: the reference of the
    parsed function against attention written with torch.pow, outputs and the gradients of q, k, v, r1 and r2
    (torch's pow gives 0 for the exponent's gradient at a zero base; a lowering through log(0) would give NaN)."""
    from fivar.codegen.torch_ref import reference_attention
    hq, hkv, d, n = 4, 2, 8, 19
    q, k, vv = (torch.randn(n, h, d, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
    prm = {name: t.requires_grad_(True) for name, t in _power_params(hq).items()}  # float32, as declared
    got = reference_attention(POWER, q, k, vv, causal=True, params=prm, float_dtype=torch.float64)
    dist = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).abs().double()
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(hq // hkv, 1)) / d ** 0.5
    r1, r2 = (prm[name].double()[:, None, None] for name in ("r1", "r2"))
    logits = logits - r1 * torch.pow(dist[None], r2)
    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), vv.repeat_interleave(hq // hkv, 1))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    up = torch.randn_like(want)
    leaves = [q, k, vv, prm["r1"], prm["r2"]]
    for a, b in zip(torch.autograd.grad(got, leaves, up), torch.autograd.grad(want, leaves, up)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_kerple_power_as_the_paper_writes_it_trains(interpret):
    """The kernels of `d ** r2` (the Triton twin's forward and the generated backward): every gradient against
    float64 autograd, the exponents at their edges."""
    q = torch.randn(21, 4, 16, dtype=DTYPE)
    k, vv = (torch.randn(37, 2, 16, dtype=DTYPE) for _ in range(2))
    r = check_gradients(POWER, q, k, vv, qo_lens=[21], kv_lens=[37], causal=True, params=_power_params(4),
                        dtype=DTYPE)
    assert {"dr1", "dr2"} <= {x.case for x in r.results}
    assert r.passed, r
