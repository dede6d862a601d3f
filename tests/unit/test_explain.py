"""`fivar show NAME --explain`: a short answer (at most 10 lines) for every bundled, zoo and battery variant, read off
the same decisions as the full rules `--verbose` adds."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import fivar
from fivar.cli import main
from fivar.cli._common import console

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted([*(ROOT / "variants").glob("*.py"), *(ROOT / "benchmarks" / "zoo").glob("*.py"),
                *(ROOT / "benchmarks" / "masks").glob("*.py")])
ATTENTION = [f for f in FILES if f.name != "__init__.py" and getattr(fivar.load(str(f)), "kind", None) != "fusion"]
PATHS = ("fa3 prefill", "fa2 prefill", "decode", "triton")


@pytest.fixture(autouse=True)
def _piped_width(monkeypatch):
    # lines are counted as printed: at the 200 columns a pipe gets, whatever the test's terminal
    monkeypatch.setattr(console, "width", 200)


def _explain(path, *flags, env=None):
    r = CliRunner().invoke(main, ["show", str(path), "--explain", *flags, "--arch", "9.0a"], env=env)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    return r.output.splitlines()


def test_the_battery_has_every_kind_of_variant():
    assert len(ATTENTION) >= 25 and any(f.parent.name == "masks" for f in ATTENTION)


@pytest.mark.parametrize("path", ATTENTION, ids=lambda f: f"{f.parent.name}/{f.stem}")
def test_explain_is_short_names_each_path_and_verbose_adds_the_rules(path):
    from fivar.explain import lines
    from fivar.runtime.explain import mask_skipping
    short = _explain(path)
    assert len(short) <= 10, "\n".join(short)
    assert "single_prefill fa3, batch_prefill fa3, batch_decode fa2" in short[0], short[0]
    for p in PATHS:
        assert sum(line.startswith(f"{p}: ") for line in short) == 1, (p, short)
    assert any(line.startswith("fa3 single prefill") for line in short)
    assert any(line.startswith("fa2 prefill KV tiles: fixed at compile time") for line in short)
    verbose = _explain(path, "--verbose")
    assert verbose[0] in short[0] and set(short[1:]) <= set(verbose), (short, verbose)
    flat = " ".join(" ".join(verbose).split())
    v = fivar.load(str(path))
    for rule in [*mask_skipping(v), *lines(v, "9.0a", "--arch")]:
        assert " ".join(rule.split()) in flat, rule
    assert "single_prefill: fa3 - sm90 GPU" in flat and "batch_decode: fa2 - decode runs on FA2" in flat


def _battery(name):
    return next(f for f in ATTENTION if f.parent.name == "masks" and f.stem == name)


def test_short_and_long_triton_lines_follow_codegens_choice(monkeypatch):
    """Both texts read codegen.triton's reads_mask_bits: flip it and both say the other thing."""
    from fivar.codegen import triton
    path = _battery("bigbird")
    assert triton.reads_mask_bits(fivar.load(str(path)))
    verbose = _explain(path, "--verbose")
    short_line = next(line for line in verbose if line.startswith("triton: a block map"))
    assert "cut tiles read precomputed bits" in short_line
    assert "read the bits a pass over the mask stored" in " ".join(" ".join(verbose).split())
    monkeypatch.setattr(triton, "reads_mask_bits", lambda v: False)
    verbose = _explain(path, "--verbose")
    short_line = next(line for line in verbose if line.startswith("triton: a block map"))
    assert "cut tiles evaluate the mask" in short_line
    flat = " ".join(" ".join(verbose).split())
    assert "the tiles it cuts evaluate the mask" in flat and "read the bits a pass" not in flat


def test_short_and_long_fa3_lines_follow_the_window_form(monkeypatch):
    """Both texts read codegen.fa3's runs_as_window: a band FA3 cannot run as its own window is masked per element."""
    from fivar.codegen import fa3
    path = ROOT / "variants" / "sliding_window.py"
    short = _explain(path)
    assert any(line.startswith("fa3 prefill: FlashInfer's sliding window") for line in short), short
    monkeypatch.setattr(fa3, "runs_as_window", lambda v: False)
    verbose = _explain(path, "--verbose")
    line = next(line for line in verbose if line.startswith("fa3 prefill: "))
    assert "sliding-window schedule skips the tiles left of the band; the mask per element" in line, line
    assert "the mask runs element-wise on every tile visited" in " ".join(" ".join(verbose).split())


def test_short_fa3_choices_follow_the_environment():
    path = ROOT / "variants" / "softcap.py"
    line = next(line for line in _explain(path) if line.startswith("fa3 single prefill"))
    assert "schedule grid non-causal, grid causal" in line and "last wave: key chunks" in line, line
    line = next(line for line in _explain(path, env={"FIVAR_FA3_SCHEDULE": "persistent"})
                if line.startswith("fa3 single prefill"))
    assert "schedule persistent non-causal, persistent causal" in line and "last wave unsplit" in line, line
    line = next(line for line in _explain(path, env={"FIVAR_PIN_KV_TILES": "0"})
                if line.startswith("fa2 prefill KV tiles"))
    assert "chosen at run time by FlashInfer (--arch 9.0a: FIVAR_PIN_KV_TILES=0)" in line, line


def test_verbose_without_explain_is_refused():
    r = CliRunner().invoke(main, ["show", "softcap", "--verbose"])
    assert r.exit_code != 0 and "--verbose goes with --explain" in r.output and "Traceback" not in r.output


def test_block_map_shares_depend_only_on_what_the_mask_reads():
    """A mask of a defaulted scalar alone has its block map at the defaults, whatever tensors the logits read (they
    were taken for the mask's, so every such variant said "made per call"); the shares against a count of every
    tile of the pairs the mask and causal keep. A mask reading a tensor stays per call."""
    import torch

    from fivar import AttentionVariant, Scalar, Tensor
    from fivar.runtime.explain import SAMPLE_KV_BLOCK, SAMPLE_LEN, SAMPLE_Q_BLOCK, short_paths

    def logits(s, b, h, kh, qi, ki, p):
        return s + p.bias[h] * float(ki - qi)

    def mask(b, h, kh, qi, ki, p):
        return qi - ki < p.window

    window = int(torch.randint(50, 3000, ()))
    v = AttentionVariant(name="win_bias", logits=logits, mask=mask,
                         params={"bias": Tensor("float32", ("qo_head",)), "window": Scalar(int, default=window)})
    q = torch.arange(SAMPLE_LEN).view(-1, 1)
    k = torch.arange(SAMPLE_LEN).view(1, -1)
    kept = ((k <= q) & (q - k < window)).view(SAMPLE_LEN // SAMPLE_Q_BLOCK, SAMPLE_Q_BLOCK,
                                              SAMPLE_LEN // SAMPLE_KV_BLOCK, SAMPLE_KV_BLOCK)
    per_tile = kept.sum((1, 3))
    tiles = per_tile.numel()
    empty = 100.0 * int((per_tile == 0).sum()) / tiles
    full = 100.0 * int((per_tile == SAMPLE_Q_BLOCK * SAMPLE_KV_BLOCK).sum()) / tiles
    line = short_paths(v)[0]
    assert f"{empty:.1f}% of {SAMPLE_Q_BLOCK}x{SAMPLE_KV_BLOCK} tiles empty, {full:.1f}% full" in line, (window, line)

    def flagged(b, h, kh, qi, ki, p):
        return p.keep[b, ki] > 0

    per_call = AttentionVariant(name="flags", mask=flagged, params={"keep": Tensor("int32", ("batch", "n"))})
    assert "block map made per call" in short_paths(per_call)[0]


def _random_band_term(rng) -> str:
    """One side of a band, written in one of the ways people write it (either index first, constants or a Scalar
    on either side, negated)."""
    c = rng.choice(["params.w", "-params.w", str(rng.randint(-6, 9)), "params.w - 2", "3 - params.w"])
    lhs, rhs = rng.choice([("q_idx - kv_idx", c), ("kv_idx - q_idx", c), (c, "kv_idx - q_idx"),
                           ("kv_idx + " + c.lstrip("-") if not c.startswith("-") else "kv_idx - " + c[1:], "q_idx"),
                           ("q_idx", "kv_idx + (" + c + ")")])
    return f"({lhs} {rng.choice(['<', '<=', '>', '>='])} {rhs})"


def test_the_band_explain_states_is_the_mask_itself(tmp_path):
    """For random band masks (one or two sides written any way round), the band `--explain` prints, read back as
    Python, keeps exactly the pairs the mask keeps, and reads as a person writes it (no `-(-x)`, no `+ 0`)."""
    import random
    import re
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    seen = 0
    for i in range(24):
        terms = [_random_band_term(rng) for _ in range(rng.choice([1, 2]))]
        text = " and ".join(terms)
        f = tmp_path / f"band{i}.py"
        f.write_text("from fivar import AttentionVariant, Scalar\n\n\ndef mask(batch, qo_head, kv_head, q_idx, kv_idx, "
                     f"params):\n    return {text}\n\n\nvariant = AttentionVariant(name='band{i}', mask=mask, "
                     "params={'w': Scalar(int, default=5)})\n")
        line = next(x for x in _explain(f) if x.startswith("mask: "))
        if "is exactly the band " not in line:
            continue
        band = line.split("is exactly the band ", 1)[1].split(";", 1)[0]
        # no sign written twice (`+ -3`, `- (-w)`, `-(-w)`), no `+ 0`, no abs of a constant
        assert not re.search(r"[-+]\s*\(?-|[-+] 0\b|abs\(\d", band), (seed, text, band)
        seen += 1
        w = rng.randint(-3, 12)
        params = type("P", (), {"w": w})()
        for q in range(-2, 30):
            for kv in range(-2, 30):
                env = {"q_idx": q, "kv_idx": kv, "params": params, "minimum": min, "maximum": max}
                assert eval(band, env) == eval(text, env), (seed, text, band, w, q, kv)
    assert seen >= 12, (seed, seen)
