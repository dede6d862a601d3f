"""Training on the GPU (bf16, hd128, 32/8 heads), the default forward (FA3 on sm90) and the Triton twin's, each with
the generated backward: dq, dk, dv and learnable tensor params against float64 autograd of the torch reference,
within bf16 tolerance; and a compiled training step (marked `gpu`)."""
import pytest
import torch

import fivar
from fivar import AttentionVariant, Scalar
from fivar.bench.suites.train import BATTERY
from fivar.bench.train import learnable_copy
from fivar.testing import check_gradients, example_params

BUNDLED = ["softcap", "alibi", "sigmoid", "sliding_window", "document_mask", "relative_bias",
           "softcap_sliding_window", "gpt_oss"]
HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
pytestmark = pytest.mark.gpu


def _qkv(lq, lk):
    return (torch.randn(lq, HQ, D, dtype=DTYPE, device="cuda"), torch.randn(lk, HKV, D, dtype=DTYPE, device="cuda"),
            torch.randn(lk, HKV, D, dtype=DTYPE, device="cuda"))


def _params(v, batch, max_len):
    params = example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=batch, max_len=max_len, device="cuda")
    if "softcap" in params:
        params["softcap"] = 5.0  # the tanh bends at these scores (30 would leave it almost linear)
    return params


@pytest.mark.parametrize("lq,lk,causal", [(37, 129, False), (300, 300, True), (1000, 1000, False),
                                          (1000, 1000, True)])
@pytest.mark.parametrize("name", BUNDLED)
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_single(backend, name, lq, lk, causal):
    v = learnable_copy(fivar.load(name))
    q, k, vv = _qkv(lq, lk)
    r = check_gradients(v, q, k, vv, qo_lens=[lq], kv_lens=[lk], causal=causal, params=_params(v, 1, lk),
                        dtype=DTYPE, backend=backend)
    assert r.passed, r


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", BUNDLED)
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_ragged(backend, name, causal):
    v = learnable_copy(fivar.load(name))
    qo_lens, kv_lens = [17, 300, 1, 257], [40, 300, 129, 257]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens))
    r = check_gradients(v, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=causal,
                        params=_params(v, len(qo_lens), max(kv_lens)), dtype=DTYPE, backend=backend)
    assert r.passed, r


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (128, torch.float16)])
@pytest.mark.parametrize("name", ["alibi", "document_mask", "sigmoid"])
def test_hopper_dkdv_kernel_other_shapes(name, head_dim, dtype):
    """The Gluon dK/dV kernel's other head dim and dtype (ragged, GQA 4/2, causal), against float64 autograd; on
    sm90 it is the kernel that runs (gluon_dkdv), so this is not the Triton kernel passing in its place."""
    from fivar.jit.triton_module import load_triton_module
    v = learnable_copy(fivar.load(name))
    qo_lens, kv_lens = [100, 700, 64], [100, 700, 99]
    q = torch.randn(sum(qo_lens), 4, head_dim, dtype=dtype, device="cuda")
    k, vv = (torch.randn(sum(kv_lens), 2, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    if torch.cuda.get_device_capability()[0] == 9:
        assert load_triton_module(v, training=True).gluon_dkdv(q, k, vv, q)
    params = example_params(v, num_qo_heads=4, num_kv_heads=2, batch_size=3, max_len=max(kv_lens), device="cuda")
    r = check_gradients(v, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=True, params=params, dtype=dtype,
                        backend="triton")
    assert r.passed, r


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_learned_sinks_and_a_loss_that_reads_the_lse(backend):
    """gpt-oss's learned sinks (one logit per query head in each row's denominator) get their gradient, and so does a
    loss that reads the lse (as a merge of attention states does): ragged, causal."""
    v = learnable_copy(fivar.load("gpt_oss"))
    qo_lens, kv_lens = [17, 300, 1, 257], [40, 300, 129, 257]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens))
    r = check_gradients(v, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=True,
                        params=_params(v, len(qo_lens), max(kv_lens)), dtype=DTYPE, backend=backend, loss="o+lse")
    assert r.passed, r


def test_compiled_training_step_with_a_learned_bias():
    """torch.compile (inductor) of a loss through the attention: the same gradients as eager."""
    v = learnable_copy(fivar.load("relative_bias"))
    q, k, vv = _qkv(512, 512)
    bias = torch.randn(HQ, 129, device="cuda") * 0.1

    def step(q, k, vv, bias):
        return (v.attention(q, k, vv, causal=True, bias=bias, max_distance=64).float() ** 2).mean()

    runs = []
    for fn in (step, torch.compile(step)):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, vv, bias)]
        fn(*leaves).backward()
        runs.append([x.grad for x in leaves])
    for a, b in zip(*runs):
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)


def _sink_window(batch, qo_head, kv_head, q_idx, kv_idx, params):
    return kv_idx < params.sinks or q_idx - kv_idx < params.window


SINK_WINDOW = AttentionVariant(name="sink_window_grad", mask=_sink_window,
                               params={"sinks": Scalar(int, default=4), "window": Scalar(int, default=200)})


@pytest.mark.parametrize("qo_lens", [[1000], [300, 1000, 17]])
def test_sink_and_window_skips_the_gap(qo_lens):
    """Attention sinks + a causal window (two runs of keys a row): the backward skips the tiles in every row's gap
    (dQ's edge loop, dK/dV's rows); gradients against float64 autograd, through the Triton forward."""
    q, k, vv = _qkv(sum(qo_lens), sum(qo_lens))
    r = check_gradients(SINK_WINDOW, q, k, vv, qo_lens=qo_lens, kv_lens=qo_lens, causal=True,
                        params={"sinks": 4, "window": 200}, dtype=DTYPE, backend="triton")
    assert r.passed, r


@pytest.mark.parametrize("name", BATTERY)
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_training_battery(backend, name):
    """The train suite's battery (benchmarks/train/*.py, loaded as a user's files: learnable per-head functions of
    distance, a learnable table, learned sinks, a document window, a strided mask): a ragged causal batch with a
    request of one query and one longer than its keys' tiles, every gradient against float64 autograd."""
    from fivar.bench.suites.train import load
    v = load(name)
    qo_lens, kv_lens = [17, 300, 1, 700], [40, 300, 129, 700]
    q, k, vv = _qkv(sum(qo_lens), sum(kv_lens))
    r = check_gradients(v, q, k, vv, qo_lens=qo_lens, kv_lens=kv_lens, causal=True,
                        params=example_params(v, num_qo_heads=HQ, num_kv_heads=HKV, batch_size=len(qo_lens),
                                              max_len=max(kv_lens), device="cuda"), dtype=DTYPE, backend=backend)
    assert r.passed, r
