"""The mask battery (benchmarks/masks/*.py) and the seeded random masks (fivar.bench.suites.random_masks) on the CPU:
every mask parses and its example builds, fivar's torch evaluator keeps exactly the pairs an independent evaluation
keeps (written out below for the battery, the generator's own for random masks) at odd shapes, the generator is
deterministic, the `masks` suite lists its cases without a GPU, its tile yardstick is built and checked right, and a
few masks' Triton twins match the reference under Triton's interpreter."""
import random
from pathlib import Path

import pytest
import torch

from fivar.bench import runner
from fivar.bench.suites import _attention, cases_of
from fivar.bench.suites import masks as M
from fivar.bench.suites import random_masks as RM
from fivar.bench.work import kept_fraction
from fivar.spec.inputs import bind_params
from fivar.spec.params import Scalar
from fivar.spec.sparsity import EMPTY, brute_force, keep_matrix
from fivar.testing import compare, example_params

FILES = sorted(p.stem for p in M.masks_dir().glob("*.py") if not p.name.startswith("_"))
SHAPES = [(96, 96), (37, 101), (1, 57)]  # square, fewer queries than keys (bottom-right aligned), one query


def fdiv(a, b):
    return torch.div(a, b, rounding_mode="floor")


#: each battery mask written again with torch ops on int64 positions: q [R, 1], kv [1, K], h [H, 1, 1], batch 0
INDEPENDENT = {
    "causal_window_global": lambda q, kv, h, P: (q - kv < P["window"]) | (P["is_global"][0, kv] == 1),
    "dilated_window": lambda q, kv, h, P: (q - kv < P["window"]) & (torch.remainder(q - kv, P["dilation"]) == 0),
    "longformer_global": lambda q, kv, h, P: ((q - kv).abs() < P["window"]) | (q < P["num_global"])
    | (kv < P["num_global"]),
    "frame_causal": lambda q, kv, h, P: fdiv(kv, P["frame"]) <= fdiv(q, P["frame"]),
    "document_window": lambda q, kv, h, P: (P["doc_ids"][0, q] == P["doc_ids"][0, kv]) & (q - kv < P["window"]),
    "bigbird": lambda q, kv, h, P: ((fdiv(q, 64) - fdiv(kv, 64)).abs() <= 1) | (q < P["num_global"])
    | (kv < P["num_global"]) | (P["random_blocks"][fdiv(q, 64), fdiv(kv, 64)] == 1),
    "strided_sparse": lambda q, kv, h, P: (q - kv < P["stride"]) | (torch.remainder(q - kv, P["stride"]) == 0),
    # the table is read only where both are draft tokens; elsewhere any in-range index stands in
    "speculative_tree": lambda q, kv, h, P: (kv < P["prefix_len"]) | (
        (q >= P["prefix_len"]) & (P["ancestors"][(q - P["prefix_len"]).clamp(min=0),
                                                 (kv - P["prefix_len"]).clamp(min=0)] == 1)),
    "random_keys": lambda q, kv, h, P: (q - kv < P["window"]) | (P["picked"][kv] != 0),
    "longnet_heads": lambda q, kv, h, P: (fdiv(q, P["segment"]) == fdiv(kv, P["segment"]))
    & ((torch.remainder(kv - h, P["dilation"]) == 0) | (q == kv)),
}


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def test_the_battery_is_complete():
    assert len(FILES) >= 9 and sorted(M.BATTERY) == FILES == sorted(INDEPENDENT)


def _small_params(v, hq, hkv, max_len):
    """The example's params at `max_len`, each int scalar the example does not set drawn small enough to cut
    inside the sequence (a window of a few keys, a dilation of 2 to 5)."""
    p = dict(example_params(v, num_qo_heads=hq, num_kv_heads=hkv, batch_size=1, max_len=max_len, device="cpu"))
    for name, decl in v.params.items():
        if isinstance(decl, Scalar) and name not in p:
            hi = 6 if name in ("dilation",) else max(3, max_len // 3)
            p[name] = int(torch.randint(2, hi, ()))
    return p


def _fivar_keep(v, params, qo_len, kv_len, hq, hkv, causal):
    b = bind_params(v, params, num_qo_heads=hq, num_kv_heads=hkv, batch_size=1, device="cpu")
    return keep_matrix(v.ir.mask, qo_len=qo_len, kv_len=kv_len, scalars=b.scalars, tensors=b.tensors,
                       num_qo_heads=hq, num_kv_heads=hkv, causal=causal), b


@pytest.mark.parametrize("qo_len,kv_len", SHAPES)
@pytest.mark.parametrize("name", FILES)
def test_battery_mask_keeps_what_an_independent_evaluation_keeps(name, qo_len, kv_len):
    v = M.load(name)
    assert v.name == name and v.ir.mask is not None
    hq, hkv = 4, 2
    causal = M.BATTERY[name].causal
    for _ in range(3):  # fresh tables and widths each time
        params = _small_params(v, hq, hkv, kv_len)
        got, b = _fivar_keep(v, params, qo_len, kv_len, hq, hkv, causal)
        P = {**b.scalars, **{k: t.long() for k, t in b.tensors.items()}}
        q = torch.arange(qo_len).view(-1, 1) + (kv_len - qo_len)
        kv = torch.arange(kv_len).view(1, -1)
        want = INDEPENDENT[name](q, kv, torch.arange(hq).view(-1, 1, 1), P).expand(hq, qo_len, kv_len)
        if causal:
            want = want & (kv <= q)
        assert torch.equal(got, want), f"{name} {params}: {int((got != want).sum())} pairs differ"


@pytest.mark.parametrize("name", FILES)
def test_battery_example_builds_at_the_benchmark_size_and_keeps_a_key_per_row(name):
    v = M.load(name)
    p = example_params(v, num_qo_heads=32, num_kv_heads=8, batch_size=2, max_len=M.PREFILL_S, device="cpu")
    b = bind_params(v, p, num_qo_heads=32, num_kv_heads=8, batch_size=2, device="cpu")
    causal = M.BATTERY[name].causal
    km = keep_matrix(v.ir.mask, qo_len=64, kv_len=M.PREFILL_S, scalars=b.scalars, tensors=b.tensors,
                     num_qo_heads=32, num_kv_heads=8, causal=causal)  # the last 64 rows
    assert km.any(2).all()
    share = kept_fraction(v, p, qo_len=M.PREFILL_S, kv_len=M.PREFILL_S, num_qo_heads=32, num_kv_heads=8,
                          causal=causal, sample_rows=64, batch_size=2)  # of the visible pairs, sampled rows
    assert 0.0 < share < 1.0, share  # (the speculative tree's prefix is plain causal: 99.9% of its pairs)


# ------------------------------------------------------------------------------------------- random masks

def _check_random(m: RM.RandomMask, directory: Path, shapes=SHAPES):
    v = RM.load(m, directory)
    assert v.name == m.name and (directory / f"{m.name}.py").read_text() == m.source
    for qo_len, kv_len in shapes:
        params = example_params(v, num_qo_heads=2, num_kv_heads=1, batch_size=1, max_len=kv_len, device="cpu")
        got, _ = _fivar_keep(v, params, qo_len, kv_len, 2, 1, m.causal)
        want = m.keep_matrix(params, qo_len, kv_len)
        assert torch.equal(got[0], want), f"{m.name}:\n{m.source}\n{int((got[0] != want).sum())} pairs differ"
        if qo_len == kv_len:
            assert got.any(2).all(), f"{m.name}: a row keeps no key"


def test_seed_0_masks_parse_and_keep_what_the_generator_says(tmp_path):
    drawn = RM.generate(0, M.RANDOM[1])
    assert len(drawn) >= 30 and len({m.name for m in drawn}) == len(drawn)
    assert {m.causal for m in drawn} == {False, True}
    for m in drawn:
        assert RM.MIN_KEPT <= m.kept <= RM.MAX_KEPT
        _check_random(m, tmp_path)


def test_masks_drawn_for_a_small_size_from_a_fresh_seed(tmp_path):
    seed = random.randrange(1, 1 << 20)
    for m in RM.generate(seed, 12, size=96):
        _check_random(m, tmp_path, shapes=[(96, 96), (41, 96)])


def test_the_kept_share_agrees_with_fivars_count_at_the_benchmark_size(tmp_path):
    """The generator's own share (its evaluator, sampled rows) is what fivar's work count finds on the same rows."""
    for m in RM.generate(0, 30)[:10]:
        v = RM.load(m, tmp_path)
        params = example_params(v, num_qo_heads=1, num_kv_heads=1, batch_size=1, max_len=m.size, device="cpu")
        got = kept_fraction(v, params, qo_len=m.size, kv_len=m.size, num_qo_heads=1, num_kv_heads=1, causal=m.causal,
                            sample_rows=RM.SAMPLE_ROWS)
        assert got == pytest.approx(m.kept, abs=1e-9), m.name


def test_generation_is_deterministic_per_seed_and_rewrites_only_what_changed(tmp_path):
    first = [m.source for m in RM.generate(3, 8)]
    RM._generate.cache_clear()
    again = RM.generate(3, 8)
    assert [m.source for m in again] == first
    assert [m.source for m in RM.generate(4, 8)] != first
    path = RM.write(again[0], tmp_path)
    stamp = path.stat().st_mtime_ns
    assert RM.write(again[0], tmp_path) == path and path.stat().st_mtime_ns == stamp  # same text: left alone
    path.write_text("stale")
    RM.write(again[0], tmp_path)
    assert path.read_text() == again[0].source and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("args", [dict(seed=1.5), dict(n=-1), dict(size=8), dict(size="8192")])
def test_bad_generator_arguments_are_one_line_errors(args):
    from fivar.errors import FivarError
    with pytest.raises(FivarError, match="random masks: seed must be an int") as e:
        RM.generate(**args)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------- the suite

def test_the_masks_suite_lists_every_mask_without_a_gpu():
    cases = cases_of("masks")
    names = [c.name for c in cases]
    decode = [n for n in M.BATTERY if M.BATTERY[n].decode]
    assert len(names) == len(set(names)) == len(M.BATTERY) + len(decode) + M.RANDOM[1]
    assert all(f"{n} prefill S=8192" in names for n in M.BATTERY) and all(f"{n} decode 32x32768" in names
                                                                         for n in decode)
    assert sum(n.startswith("rmask0_") for n in names) == 30
    assert [c.name for c in runner.select(cases, ["bigbird*"])] == ["bigbird prefill S=8192"]
    assert len(cases_of("masks", quick=True)) == len(M.BATTERY) + len(decode) + M.QUICK_RANDOM


def test_every_mask_renders_for_each_target_and_lists_its_sm90_modules(monkeypatch, tmp_path):
    """The generated FA2, FA3 and Triton sources of every battery and seed-0 random mask render (the analyses
    behind them, bands, KV ranges, head reads, accept each mask), and a few cases list the modules an sm90 prebuild
    compiles: FA3's KV-range forms and FA2."""
    from fivar.codegen import fa2, fa3
    from fivar.codegen.triton import render_attention
    variants = [M.load(n) for n in M.BATTERY] + [RM.load(m, tmp_path) for m in RM.generate(*M.RANDOM)]
    for v in variants:
        assert fa2.variant_decl(v).source and fa3.variant_decl(v, exp2_emulated_of_8=0).source and render_attention(v)
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setattr(_attention, "_sm90", lambda: True)
    for c in runner.select(cases_of("masks"), ["bigbird prefill*", "longnet_heads prefill*", "rmask0_02 *"]):
        targets = {m.target for m in c.modules()}
        assert targets == {"fa2", "fa3"}, c.name


@pytest.mark.parametrize("name,causal", [("longnet_heads", True), ("bigbird", False), ("speculative_tree", True)])
def test_mask_tiles_are_the_brute_force_blocks_of_the_keep_matrix(name, causal):
    v = M.load(name)
    S, hq, hkv = 200, 4, 2  # 200: a last tile cut short
    p = _small_params(v, hq, hkv, S)
    tiles, kept = M.mask_tiles(v, p, seqlen=S, num_qo_heads=hq, num_kv_heads=hkv, causal=causal, device="cpu",
                               tile=32, rows=40)
    km, _ = _fivar_keep(v, p, S, S, hq, hkv, causal)
    assert torch.equal(tiles, brute_force(km, 32, 32) != EMPTY)
    assert kept == pytest.approx(km.double().mean().item(), abs=1e-12)


class _FakeBlockSparse:
    """FlashInfer's block-sparse wrapper on the CPU: plain attention over the BSR blocks it was planned with."""
    def __init__(self, workspace):
        pass

    def plan(self, indptr, indices, M_, N, R, C, hq, hkv, d, **kw):
        blocks = torch.zeros(len(indptr) - 1, N // C, dtype=torch.bool)
        for i in range(len(indptr) - 1):
            blocks[i, indices[indptr[i]:indptr[i + 1]].long()] = True
        self.dense = blocks.repeat_interleave(R, 0)[:M_].repeat_interleave(C, 1)

    def run(self, q, k, v):
        return _sdpa(q, k, v, self.dense)


def _sdpa(q, k, v, keep):
    g = q.shape[1] // k.shape[1]
    qt, kt, vt = (x.float().transpose(0, 1) for x in (q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)))
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep)
    return out.transpose(0, 1).to(q.dtype)


def test_a_mask_case_runs_its_yardsticks_checked_and_records_the_masks_shares(monkeypatch, tmp_path):
    """A prefill case of the suite, shrunk to the CPU: the plain and plain-tiles yardsticks are built and checked
    (the tiles one against attention restricted to the mask's tiles), a wrong tile table fails its check, and every
    row carries the kept and tile shares."""
    import flashinfer
    from fivar.bench.timing import Timing
    S = 384
    real = _attention.make_problem
    monkeypatch.setattr(_attention, "make_problem", lambda *a, **kw: real(*a[:8], "cpu", **kw))
    monkeypatch.setattr(_attention, "contenders", lambda v, p, wanted, stock, fivar=True: [])
    monkeypatch.setattr(M, "PREFILL_S", S)
    monkeypatch.setattr(flashinfer, "BlockSparseAttentionWrapper", _FakeBlockSparse)
    monkeypatch.setattr(flashinfer, "single_prefill_with_kv_cache",
                        lambda q, k, v, causal: _sdpa(q, k, v, torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
                                                      .tril() if causal else None), raising=False)
    case = M._prefill("dilated_window", lambda: M.load("dilated_window"), True)
    timer = lambda fns: {n: Timing([1.0, 1.0]) for n in fns}  # noqa: E731
    rows = runner.run([case], runner.Options(rounds=1, device="cpu"), tmp_path, build=False, log=lambda s: None,
                      timer=timer, env={k: "x" for k in runner.ROW_FIELDS[:9]})
    ms = {r["contender"]: r for r in rows if r["metric"] == "ms"}
    assert set(ms) == {"plain", "plain-tiles"} and all(r["check"] == "pass" for r in ms.values()), ms
    d = ms["plain-tiles"]["detail"]
    # window 2048 > S: every 4th key behind each query, every lower tile non-empty
    assert d["tile_fraction"] == pytest.approx(6 / 9) and 0.1 < d["kept_fraction"] < 0.2

    # the check holds the yardstick to its tiles: one tile dropped from the plan is a failure
    real_yard = M._yardsticks

    def dropped(v, p):
        cs, detail = real_yard(v, p)
        tiles = cs[1].reference[1]["tiles"].clone()
        tiles[-1, 0] = 0
        cs[1].reference = (cs[1].reference[0], {"tiles": tiles}, False)
        return cs, detail
    monkeypatch.setattr(M, "_yardsticks", dropped)
    case = M._prefill("dilated_window", lambda: M.load("dilated_window"), True)
    rows = runner.run([case], runner.Options(rounds=1, device="cpu"), tmp_path, build=False, log=lambda s: None,
                      timer=timer, env={k: "x" for k in runner.ROW_FIELDS[:9]})
    assert {r["contender"]: r["check"] for r in rows if r["metric"] == "ms"} == {"plain": "pass", "plain-tiles": "fail"}


# ------------------------------------------------------------------------------------------- Triton twins

L, HQ, HKV, D = 40, 4, 2, 16


@pytest.mark.parametrize("name", ["causal_window_global", "dilated_window", "speculative_tree"])
def test_battery_triton_twin(name):
    v = M.load(name)
    params = _small_params(v, HQ, HKV, L)
    q, k, vv = (torch.randn(L, h, D, dtype=torch.float16) for h in (HQ, HKV, HKV))
    causal = M.BATTERY[name].causal
    ref = v.reference(q, k, vv, causal=causal, **params)
    out = v.prefill(q, k, vv, causal=causal, backend="triton", **params)
    r = compare(name, f"triton L={L}", out, ref, torch.float16)
    assert r.passed, r


def test_random_mask_triton_twins(tmp_path):
    drawn = RM.generate(random.randrange(1 << 20), 3, size=L)
    for m in drawn:
        v = RM.load(m, tmp_path)
        params = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=1, max_len=L, device="cpu")
        q, k, vv = (torch.randn(L, h, D, dtype=torch.float16) for h in (HQ, HKV, HKV))
        ref = v.reference(q, k, vv, causal=m.causal, **params)
        out = v.prefill(q, k, vv, causal=m.causal, backend="triton", **params)
        r = compare(m.name, f"triton L={L}", out, ref, torch.float16)
        assert r.passed, (r, m.source)


def test_random_mask_twin_decode(tmp_path):
    """Decode of masks drawn from a fresh seed on the Triton twin (a mask that trims decode's pages reads its
    kept-page list), paged at a drawn page size, against the reference."""
    from fivar.testing import check_decode
    for m in RM.generate(random.randrange(1 << 20), 3, size=L):
        v = RM.load(m, tmp_path)
        page = random.choice([1, 4, 16])
        r = check_decode(v, kv_lens=[1, 33, 2 * L], page_size=page, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                         dtype=torch.float16, device="cpu", backend="triton")
        assert r.passed, (page, r, m.source)
