"""fivar's kernel targets (fivar.jit.targets): one object per target answers what the rest of fivar asks, so no
module outside it compares a value with a target's name."""
import ast
from pathlib import Path

import pytest

import fivar
from fivar.errors import FivarError
from fivar.jit import targets
from fivar.jit.targets import FA2, FA3, TARGETS, TRITON, named, runs_twin, target_of

PACKAGE = Path(fivar.__file__).parent
NAMES = frozenset(TARGETS)

#: Comparisons with "triton" where it names something other than the kernel target: the Python package, and
#: the benchmark's contenders (its Triton-twin contender is named after it).
NOT_THE_TARGET = {("testing.py", "'triton' in sys.modules"), ("bench/contenders.py", "'triton' in wanted"),
                  ("cli/bench.py", "x in ('triton', 'flex', 'sdpa')")}


def _names_in(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(set(), *(_names_in(e) for e in node.elts))
    return set()


def name_tests(source: str) -> list[str]:
    """Every comparison in `source` (==, !=, in, not in, is...) with a target's name, or a tuple/list/set of them."""
    return [ast.unparse(n) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Compare)
            and any(_names_in(x) for x in (n.left, *n.comparators))]


def test_the_scan_sees_name_tests():
    found = name_tests('if target == "fa3" or backend in ("fa2", "x") or {"triton"} != set(b) or t is "fa2":\n'
                       '    pass\nok = target_of(t).decodes and name == "auto" and "fa4" != t\n'
                       'for t in ("fa2", "fa3"):\n    pass\n')
    assert found == ["target == 'fa3'", "backend in ('fa2', 'x')", "{'triton'} != set(b)", "t is 'fa2'"]


def test_no_target_name_tests_outside_the_targets_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "jit/targets.py":
            continue
        found += [f"{rel}: {t}" for t in name_tests(path.read_text()) if (rel, t) not in NOT_THE_TARGET]
    assert not found, "tests of target names outside fivar.jit.targets (ask the Target instead):\n" + "\n".join(found)


@pytest.mark.parametrize("bad", ["fa4", "FA2", "auto", "", None, 3])
def test_target_of_a_bad_name_is_one_line_naming_it(bad):
    with pytest.raises(FivarError) as e:
        target_of(bad)
    text = str(e.value)
    assert "\n" not in text and repr(bad) in text and "fa2, fa3, triton" in text
    assert named(bad) is None and not runs_twin(bad)


def test_every_target_by_its_name():
    for name, t in TARGETS.items():
        assert target_of(name) is t is named(name) and t.name == name and t.label.lower() == name
    assert targets.FLASHINFER_TARGETS == ("fa2", "fa3")
    assert [runs_twin(n) for n in ("auto", "fa2", "fa3", "triton")] == [False, False, False, True]


def test_flashinfer_targets_build_a_config_the_twin_does_not():
    for t in TARGETS.values():
        assert (t.config_class is not None) == t.is_flashinfer
    options = {"cta_tile": "128x128", "skip_unused_headers": ["a.h"], "exp2_emulated_of_8": 2}
    fa3 = FA3.config_of(options)
    fa2 = FA2.config_of(options)
    assert type(fa3) is FA3.config_class and fa3.cta_tile == "128x128" and fa3.exp2_emulated_of_8 == 2
    assert type(fa2) is FA2.config_class and fa2.skip_unused_headers == ("a.h",)  # a manifest's list, as a tuple
    assert not hasattr(fa2, "cta_tile")


def test_decode_and_sm90a_go_together():
    """FA3 alone needs sm_90a and has no decode kernel: backend auto then takes FA2's, which runs on any GPU."""
    assert [t.name for t in TARGETS.values() if t.needs_sm90a] == ["fa3"] == \
        [t.name for t in TARGETS.values() if not t.decodes]
    assert FA2.reads_fp8_kv and not FA3.reads_fp8_kv and not TRITON.reads_fp8_kv
    assert TRITON.emitter is fivar.codegen.triton and FA3.emitter is fivar.codegen.fa3


def _window(b, h, kh, q, kv, p):
    return q - kv < p.w


def _window_and_doc(b, h, kh, q, kv, p):
    return q - kv < p.w and p.doc[q] == p.doc[kv]


def test_window_floor():
    """FA2 holds window_left unsigned; FA3 takes a window-exact mask's negative edge as its own window and none in
    its tile-list form (a mask beyond the band); the twin takes none."""
    from fivar import AttentionVariant, Scalar, Tensor
    params = {"w": Scalar(int, default=4), "doc": Tensor("int32", ("position",))}
    exact = AttentionVariant(name="w", mask=_window, params=params)
    scans = AttentionVariant(name="wd", mask=_window_and_doc, params=params)
    assert not exact.scans_mask and scans.scans_mask
    assert FA2.window_floor(exact) == FA2.window_floor(scans) == 0
    assert FA3.window_floor(exact) == -(1 << 30) and FA3.window_floor(scans) is None
    assert TRITON.window_floor(exact) is None and TRITON.window_floor(scans) is None
