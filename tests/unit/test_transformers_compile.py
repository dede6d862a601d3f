"""A tiny random-weight Gemma 2 through fivar (the Triton twin, interpreter, float16 on the CPU) under torch.compile:
greedy tokens equal to transformers' eager attention, fivar's attention inside the compiled graphs as its custom op,
and no graph break whose stack passes through fivar."""
import os

import pytest
import torch

import fivar

transformers = pytest.importorskip("transformers")
import fivar.integrations.transformers as fivar_hf  # noqa: E402
from test_transformers_integration import _gemma2, _generate  # noqa: E402

FIVAR_DIR = os.path.dirname(fivar.__file__)


@pytest.fixture(autouse=True, scope="module")
def interpret():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


def test_gemma2_under_torch_compile_matches_eager_with_no_break_in_fivar():
    name = fivar_hf.register("fivar_triton", backend="triton")
    ids = torch.randint(1, 256, (1, 9))
    model = _gemma2(name)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids)
    in_fivar = [r.reason.splitlines()[0] for r in explained.break_reasons
                if any(f.filename.startswith(FIVAR_DIR) for f in r.user_stack)]
    assert not in_fivar, in_fivar

    fivar_ops = []

    def counting(gm, example_inputs):
        fivar_ops.extend(str(n.target) for n in gm.graph.nodes
                         if n.op == "call_function" and str(n.target).startswith("fivar_"))
        return gm.forward

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=counting)
    tokens, logits = _generate(model, ids, new=3)
    want_tokens, want_logits = _generate(_gemma2("eager"), ids, new=3)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max() < 2e-2 * max(1.0, want_logits.abs().max().item())
    # both layers' variants (global soft-cap, local soft-cap + window) ran as fivar's ragged op inside the graphs
    assert {op.split("_")[1] + "_" + op.split(".")[-1] for op in fivar_ops} == {"softcap_ragged"}, fivar_ops
    assert any(op.startswith("fivar_softcap_sliding_window_") for op in fivar_ops), fivar_ops
    torch._dynamo.reset()
