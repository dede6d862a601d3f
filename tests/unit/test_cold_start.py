"""A cold default call runs the Triton twin while its FlashInfer modules build in the background
(fivar.runtime.cold_start), on the CPU with stand-ins for the modules, the build and the device: the build starts once
and says so, the twin serves every call until it is done, the modules after; a failed build hands the call back to
build (and report) itself; a backend asked by name, mode "wait", a plan and a dtype the twin lacks never take the twin.
"""
import io
import threading
import types
from contextlib import redirect_stderr

import pytest
import torch

import fivar
from fivar import config
from fivar.jit import build as jb
from fivar.runtime import attention, cold_start

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


class _Module:
    def __init__(self, built):
        self.built, self.target, self.op, self.uri = built, "fa3", "batch_prefill", f"m{id(self)}"

    def manifest_ok(self):
        return self.built[0]


@pytest.fixture
def stand_ins(monkeypatch):
    """A module set that is not built, a build that waits for `go`, q that says it is on a GPU."""
    built, go, started = [False], threading.Event(), []

    def build_many(mods):
        started.append(len(mods))
        assert go.wait(10)
        if fail[0]:
            raise fivar.FivarError("nvcc failed")
        built[0] = True
    fail = [False]
    monkeypatch.setattr(jb, "build_many", build_many)
    monkeypatch.setattr(cold_start, "call_modules",
                        lambda variant, op, target, q, bounded=None, causal=None: [_Module(built), _Module(built)])
    monkeypatch.setattr(cold_start, "_builds", {})
    monkeypatch.setattr(cold_start, "_ready", set())
    q = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, shape=(7, 4, 128))
    with config.override(cold_start="triton"):
        yield types.SimpleNamespace(go=go, started=started, q=q, fail=fail, built=built)


def _ask(v, q, backend="auto"):
    err = io.StringIO()
    with redirect_stderr(err):
        took = cold_start.runs_triton(v, "batch_prefill", "fa3", backend, q)
    return took, err.getvalue()


def test_the_twin_serves_the_calls_until_the_build_is_done(stand_ins):
    v = fivar.load("document_mask")
    took, said = _ask(v, stand_ins.q)
    assert took and "building 2 fa3 module(s) for batch_prefill in the background" in said and "Triton twin" in said
    for _ in range(3):
        took, said = _ask(v, stand_ins.q)
        assert took and said == ""
    assert stand_ins.started == [2]  # one build, however many calls
    stand_ins.go.set()
    cold_start.wait_for_builds(10)
    took, said = _ask(v, stand_ins.q)
    assert not took and "ready after" in said and "calls run on fa3 from now" in said
    assert _ask(v, stand_ins.q) == (False, "")


def test_a_failed_build_hands_the_call_back(stand_ins):
    v = fivar.load("document_mask")
    stand_ins.fail[0] = True
    assert _ask(v, stand_ins.q)[0]
    stand_ins.go.set()
    cold_start.wait_for_builds(10)
    took, said = _ask(v, stand_ins.q)
    assert not took and "ready" not in said  # the call now builds the module itself and says why it failed


def test_built_modules_named_backends_wait_mode_and_other_dtypes_never_take_the_twin(stand_ins, monkeypatch):
    v = fivar.load("document_mask")
    assert _ask(v, stand_ins.q, backend="fa3") == (False, "")
    assert _ask(v, types.SimpleNamespace(device=stand_ins.q.device, dtype=torch.float32, shape=(7, 4, 128))) \
        == (False, "")
    with config.override(cold_start="wait"):
        assert _ask(v, stand_ins.q) == (False, "")
    stand_ins.built[0] = True
    assert _ask(v, stand_ins.q) == (False, "") and stand_ins.started == []

    def no_form(*a, **kw):
        raise AssertionError("a built op picks no softmax form")
    monkeypatch.setattr(cold_start, "softmax_form", no_form)  # every module built: the next calls only look up
    assert _ask(v, stand_ins.q) == (False, "")


def test_a_bad_mode_is_one_line(monkeypatch):
    monkeypatch.setenv("FIVAR_COLD_START", "later")
    with pytest.raises(fivar.FivarError, match="FIVAR_COLD_START='later': expected triton or wait"):
        cold_start.mode()


def test_the_entry_point_runs_the_twin_and_falls_back_where_it_refuses(monkeypatch):
    """single_prefill with runs_triton true returns the twin's output; where the twin refuses the call (a
    FivarError) the call goes on to its modules."""
    v = fivar.load("softcap")
    q, k = torch.randn(5, 4, 64, dtype=torch.float16), torch.randn(9, 2, 64, dtype=torch.float16)
    monkeypatch.setattr(attention, "_check_qkv", lambda *a, **kw: None)
    monkeypatch.setattr(attention, "_check_backend", lambda *a, **kw: "fa3")
    monkeypatch.setattr(cold_start, "runs_triton", lambda *a: True)
    twin = torch.zeros_like(q)
    monkeypatch.setattr(attention, "triton_prefill", lambda *a, **kw: twin)
    assert attention.single_prefill(v, q, k, k, backend="auto") is twin

    def refuse(*a, **kw):
        raise fivar.FivarError("the twin lacks this")
    monkeypatch.setattr(attention, "triton_prefill", refuse)
    monkeypatch.setattr(attention, "_prepare", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("modules")))
    with pytest.raises(RuntimeError, match="modules"):
        attention.single_prefill(v, q, k, k, backend="auto")


def test_the_stand_in_compiles_one_config_of_its_own_import(monkeypatch):
    """While the modules build, the twin runs with autotuning off (one launch config per kernel to compile), through
    an import of its own: the twin a later call asks for by name keeps autotuning."""
    from fivar.jit import triton_module
    v = fivar.load("softcap")
    seen = []
    monkeypatch.setattr(attention, "_check_qkv", lambda *a, **kw: None)
    monkeypatch.setattr(attention, "_check_backend", lambda *a, **kw: "fa3")
    monkeypatch.setattr(cold_start, "runs_triton", lambda *a: True)
    monkeypatch.setattr(attention, "triton_prefill", lambda *a, **kw: seen.append(
        triton_module.load_triton_module(v)) or torch.zeros(1))
    q = torch.randn(5, 4, 64, dtype=torch.float16)
    attention.single_prefill(v, q, q, q, backend="auto")
    tuned = triton_module.load_triton_module(v)
    assert seen[0].AUTOTUNE is False and tuned.AUTOTUNE is True and seen[0] is not tuned
    assert seen[0].__name__ == tuned.__name__ + "_no_autotune"


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="per-thread priority: Linux")
def test_the_background_build_runs_below_the_caller(stand_ins, monkeypatch):
    """The build's thread, and so every compiler it starts, runs BUILD_NICENESS below the caller (capped at 19);
    the caller's own thread keeps its priority."""
    import os
    seen = []
    monkeypatch.setattr(jb, "build_many", lambda mods: seen.append(
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert _ask(fivar.load("document_mask"), stand_ins.q)[0]
    cold_start.wait_for_builds(10)
    assert seen == [min(19, mine + cold_start.BUILD_NICENESS)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_calls_whose_params_run_other_softmax_forms_build_each_its_own(stand_ins, monkeypatch):
    """A soft-cap's cold calls: a cap the bounded softmax takes builds that form, a wide cap the running max's, each
    once; a second call of the first cap starts nothing."""
    asked = []

    def modules(variant, op, target, q, bounded=None, causal=None):
        asked.append(bounded)
        return [_Module(stand_ins.built)]
    monkeypatch.setattr(cold_start, "call_modules", modules)
    v = fivar.load("softcap")
    with fivar.codegen.fa3.bounded_softmax():
        for cap in (20.0, 60.0, 20.0):
            err = io.StringIO()
            with redirect_stderr(err):
                assert cold_start.runs_triton(v, "single_prefill", "fa3", "auto", stand_ins.q, {"softcap": cap})
    assert [b for b in asked if b is not None] == [True, False] and stand_ins.started == [1, 1]
    stand_ins.go.set()
    cold_start.wait_for_builds(10)


def test_a_call_that_is_not_causal_leaves_the_mask_free_modules_to_later(monkeypatch):
    """The mask-free modules run only a causal batch cut into segments (fivar.runtime.plans._plan_segments): a
    non-causal cold call's build leaves them out, on FA3 and FA2; a causal call's keeps every module a build has."""
    from fivar.jit.build import serving_modules
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    q = types.SimpleNamespace(dtype=torch.bfloat16, shape=(9, 8, 128))
    for v in (fivar.load("document_mask"), fivar.load(str(ROOT / "benchmarks" / "compile" / "local_global.py"))):
        for target in ("fa3", "fa2"):
            for op in ("single_prefill", "batch_prefill"):
                built = serving_modules(v, op, target)
                assert any(m.options.get("mask_free") for m in built), (v.name, target, op)
                assert [m.uri for m in cold_start.call_modules(v, op, target, q, None, True)] == [m.uri for m in built]
                assert [m.uri for m in cold_start.call_modules(v, op, target, q, None, False)] == \
                    [m.uri for m in built if not m.options.get("mask_free")]


def test_a_cold_training_step_runs_the_twins_forward_while_fa3_builds(monkeypatch):
    """`v.attention` with backend "auto" whose FA3 forward is still building runs the Triton forward (its output and
    gradients the reference's); once the build is done, FA3's. The op of a batch of several requests is batch
    prefill's, of one single prefill's; a forward asked for by name never takes the twin."""
    from fivar.runtime import autograd
    v = fivar.load("softcap")
    asked = []
    building = [True]
    monkeypatch.setattr(autograd, "forward_target", lambda *a: ("fa3", "FA3 forward"))
    monkeypatch.setattr(cold_start, "runs_triton", lambda variant, op, target, backend, q, *rest: asked.append(
        (op, target, backend)) or (building[0] and backend == "auto"))
    q, k = torch.randn(7, 4, 16, dtype=torch.float16), torch.randn(9, 2, 16, dtype=torch.float16)
    assert autograd._call_args(v, q, k, k, True, None, "auto", None, None, {})[0] == "triton"
    indptr = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    assert autograd._call_args(v, q, k, k, False, None, "auto", *indptr, {})[0] == "triton"
    assert asked == [("single_prefill", "fa3", "auto"), ("batch_prefill", "fa3", "auto")]
    building[0] = False
    assert autograd._call_args(v, q, k, k, True, None, "auto", None, None, {})[0] == "fa3"
    asked.clear()
    monkeypatch.setattr(autograd, "forward_target", lambda *a: ("fa3", "backend='fa3' was requested"))
    building[0] = True
    assert autograd._call_args(v, q, k, k, True, None, "fa3", None, None, {})[0] == "fa3" and asked == []
    monkeypatch.setattr(autograd, "forward_target", lambda *a: ("fa3", "FA3 forward"))
    vv = torch.randn(9, 2, 16, dtype=torch.float16)
    do = torch.randn(7, 4, 16, dtype=torch.float16)
    leaves = [t.clone().requires_grad_() for t in (q, k, vv)]
    v.attention(*leaves, causal=True).backward(do)
    exact = [t.double().requires_grad_() for t in (q, k, vv)]
    ref = v.reference(*exact, causal=True)
    ref.backward(do.double())
    assert all((a.grad.double() - b.grad).abs().max() < 2e-2 * (1 + b.grad.abs().max()) for a, b in zip(leaves, exact))


def test_the_eager_entry_points_do_not_import_dynamo():
    """A first call imports the runtime (plans included) but not Dynamo, which only torch.compile needs and which
    took seconds of a cold first call, nor does an eager training step (forward and backward); a compiled call
    imports the ops as Dynamo traces it, in one graph."""
    import subprocess
    import sys
    code = ("import sys, torch, fivar\n"
            "import fivar.runtime.attention, fivar.runtime.autograd, fivar.runtime.graph, fivar.runtime.graph_verify\n"
            "fivar.load('softcap')\n"
            "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
            "t = fivar.load('softcap')\n"
            "q, k = (torch.randn(8, h, 16, dtype=torch.float16, requires_grad=True) for h in (2, 1))\n"
            "t.attention(q, k, k, causal=True, backend='triton').float().sum().backward()\n"
            "assert q.grad is not None and 'torch._dynamo' not in sys.modules, 'a training step imported dynamo'\n"
            # the first torch.compile of a call imports the ops while Dynamo traces it, and keeps it in one graph
            "v = fivar.load('softcap')\n"
            "q, k = torch.randn(8, 2, 16, dtype=torch.float16), torch.randn(8, 1, 16, dtype=torch.float16)\n"
            "f = lambda q, k: v.prefill(q, k, k, causal=True, backend='triton') * 2\n"
            "got = torch.compile(f, fullgraph=True, backend='eager')(q, k)\n"
            "assert 'fivar.runtime.ops' in sys.modules and torch.equal(got, f(q, k))\n")
    import os
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1"})  # CPU tensors, on a GPU host too
    assert p.returncode == 0, p.stderr[-2000:]


def test_a_training_step_while_its_modules_build_compiles_one_config(stand_ins, monkeypatch):
    """While a background build of the variant runs, the training module (forward and backward) is the stand-in's,
    autotuning off; after it, and for another variant, autotuning is on."""
    from fivar.runtime import autograd
    v, other = fivar.load("document_mask"), fivar.load("softcap")
    seen = []
    monkeypatch.setattr(autograd, "_module", lambda var: seen.append(config.triton_config().autotune))
    assert _ask(v, stand_ins.q)[0] and cold_start.building(v) and not cold_start.building(other)
    for var in (v, other):
        with autograd._training(var):
            autograd._module(var)
    stand_ins.go.set()
    cold_start.wait_for_builds(10)
    with autograd._training(v):
        autograd._module(v)
    assert seen == [False, True, True] and not cold_start.building(v)
