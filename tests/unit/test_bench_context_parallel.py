"""The context-parallel benchmark suite's worker on 2 CPU processes (gloo): its checks pass on correct results and
fail on a corrupted output, its rows follow the runner's protocol, and the suite lists without a GPU."""
import json
import math
from dataclasses import replace

import gloo_group
import pytest
import torch

from fivar.bench import runner
from fivar.bench.suites import context_parallel as cp

TINY = dict(heads=(4, 2), head_dim=16, device="cpu", budget_s=0.01, warmup=1)
FIVAR = tuple(c for c in cp.STRATEGIES if c != cp.TORCH_CP)


@pytest.fixture(scope="module")
def group():
    """Two gloo ranks kept for this file's cases that run the suite's worker directly (cp.worker, which run_group's
    spawned processes call after joining their group): the spawn and torch's first compile are paid once. run_group
    itself is run by the corrupted-output test."""
    with gloo_group.Groups() as get:
        yield lambda: get(2)


def _worker(rank, world, cfg):
    return cp.worker(cfg)


def worker_rows(group, cfg) -> list[dict]:
    """Rank 0's rows of cfg run by the kept group, through JSON as run_group hands them over."""
    return json.loads(json.dumps(group().run(_worker, cfg, timeout_s=240)[0]))


def full_rows(rows: list[dict]) -> list[dict]:
    """Rows as the runner writes them (environment fields empty), ratios against the suite's baseline."""
    rows = runner.add_ratios([dict(r) for r in rows], cp.SINGLE)
    return [{**{k: None for k in runner.ROW_FIELDS}, **r} for r in rows]


def test_worker_rows_pass_on_two_gloo_ranks_with_backward(group):
    # documents of random lengths, causal, forward + backward through the reference per pair: every fivar contender
    # checked (out, lse, dq, dk, dv against the single-process run) then timed; PyTorch's CP has no Flex backward on
    # CPUs: its row says so and the others still run
    seqlen = 256
    cfg = cp.Config("document_mask", seqlen, backward=True, docs=3, dtype="bfloat16", backend="reference",
                    seed=int(torch.randint(0, 1 << 20, ()).item()), **TINY)
    rows = full_rows(worker_rows(group, cfg))
    for r in rows:
        runner.validate_row(r)
    got = {(r["contender"], r["metric"]): r for r in rows}
    torch_cp = got.pop((cp.TORCH_CP, "ms"))
    if torch_cp["check"] == "pass":  # a torch with Flex's backward on CPUs
        got.pop((cp.TORCH_CP, "scaling_efficiency"))
    else:
        assert torch_cp["check"] == "error" and "backward on CPU" in torch_cp["detail"]["error"], torch_cp
        assert "\n" not in torch_cp["detail"]["error"]
    assert set(got) == {(c, "ms") for c in (cp.SINGLE, *FIVAR)} | {(c, "scaling_efficiency") for c in FIVAR}, rows
    for r in got.values():
        assert r["check"] == "pass", r
        assert math.isfinite(r["value"]) and r["value"] > 0, r
        assert r["detail"]["world"] == 2
    for c in FIVAR:  # the efficiency is its definition over the two timed rows
        eff = got[(c, "scaling_efficiency")]
        assert eff["value"] == pytest.approx(got[(cp.SINGLE, "ms")]["value"] / (2 * got[(c, "ms")]["value"]))


def test_a_corrupted_output_fails_its_check_and_is_not_timed():
    # the Triton twin (interpreted), fp16, a causal soft-capped window: the strategies' gathered output is scaled on
    # a block of rows before its check, which must fail it; the single-process run still passes and is timed
    cfg = cp.Config("softcap_sliding_window", 64, window=24, dtype="float16", backend="triton", corrupt=True,
                    seed=int(torch.randint(0, 1 << 20, ()).item()), **TINY)
    rows = full_rows(cp.run_group(cfg, 2, timeout_s=240))
    for r in rows:
        runner.validate_row(r)
    by = {r["contender"]: r for r in rows if r["metric"] == "ms"}
    assert by[cp.SINGLE]["check"] == "pass" and by[cp.SINGLE]["value"] > 0
    for c in FIVAR:
        assert by[c]["check"] == "fail" and by[c]["value"] is None, by[c]
        assert by[c]["detail"]["error"].startswith("FAIL"), by[c]
    # PyTorch's CP block mask takes no sequence of 64 over 2 ranks (128-row blocks): one line saying so
    assert by[cp.TORCH_CP]["check"] == "error" and "multiple of 2 ranks x 128" in by[cp.TORCH_CP]["detail"]["error"]
    assert not [r for r in rows if r["metric"] == "scaling_efficiency"]


@pytest.mark.parametrize("variant,extra,corrupt", [("document_mask", dict(docs=3), False),
                                                   ("softcap_sliding_window", dict(window=40), False),
                                                   ("document_mask", dict(docs=3), True)])
def test_pytorch_context_parallel_is_checked_and_timed(group, variant, extra, corrupt):
    # PyTorch's own CP (Flex under _ContextParallel, the variant's mask as its CP block mask) on 2 gloo ranks,
    # forward: its gathered output and LSE match the single-process run (documents crossing the shards; a window
    # and soft-capped logits), or, corrupted, fail the check and go untimed
    cfg = cp.Config(variant, 256, dtype="bfloat16", backend="reference", contenders=(cp.SINGLE, cp.TORCH_CP),
                    corrupt=corrupt, seed=int(torch.randint(0, 1 << 20, ()).item()), **extra, **TINY)
    rows = full_rows(worker_rows(group, cfg))
    for r in rows:
        runner.validate_row(r)
    got = {(r["contender"], r["metric"]): r for r in rows}
    assert got[(cp.SINGLE, "ms")]["check"] == "pass"
    row = got[(cp.TORCH_CP, "ms")]
    if corrupt:
        assert row["check"] == "fail" and row["detail"]["error"].startswith("FAIL document_mask torch-cp out"), row
        assert set(got) == {(cp.SINGLE, "ms"), (cp.TORCH_CP, "ms")}
        return
    assert row["check"] == "pass" and row["value"] > 0 and row["detail"]["world"] == 2, row
    eff = got[(cp.TORCH_CP, "scaling_efficiency")]
    assert eff["value"] == pytest.approx(got[(cp.SINGLE, "ms")]["value"] / (2 * row["value"]))


def test_lse_check_catches_a_shifted_row():
    lse = torch.randn(40, 4) * 3
    assert cp._lse_check("x", lse, lse.clone()) is None
    bad = lse.clone()
    bad[7, 2] += 0.2
    assert "max error" in cp._lse_check("x", bad, lse)


def test_the_suite_lists_its_cases_and_modules_without_a_gpu(capsys):
    assert runner.main(["--suite", "context-parallel", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 8 and all("baseline=single-gpu" in x for x in listed)
    long = [x for x in listed if "S=524288" in x]  # 512k: documents and the window, forward and forward+backward
    assert len(long) == 4 and sum("fwd+bwd" in x for x in long) == 2 and sum("softcap" in x for x in long) == 2
    quick = cp.cases(quick=True)
    assert {c.shape["seqlen"] for c in quick} == {cp.QUICK_SEQ}
    # the prebuild lists the single-GPU prefill's modules and the per-pair variant's (causal is the kernels' own)
    cfg = cp.Config("softcap_sliding_window", cp.SEQ, window=cp.WINDOW)
    uris = [m.uri for m in cp.modules(cfg, "fa3")]
    assert any("softcap_sliding_window_cp_fa3" in u for u in uris), uris
    assert not any("_cp_causal" in u for u in uris), uris
    assert any("softcap_sliding_window_fa3" in u for u in uris), uris
    assert cp.modules(cfg, "reference") == []


def test_fewer_than_two_gpus_gives_one_error_row():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has the GPUs the suite needs")
    rows = cp.measure(replace(cp.Config("document_mask", 256, docs=2), device="cpu"))
    assert len(rows) == 1 and rows[0].check == "error" and ">= 2 CUDA GPUs" in rows[0].detail["error"]


def test_document_lengths_cover_the_sequence():
    for seqlen, docs in ((131072, 8), (524288, 32), (100, 3)):
        lengths = cp.doc_lengths(seqlen, docs, seed=5)
        assert len(lengths) == docs and sum(lengths) == seqlen and min(lengths) >= seqlen // (4 * docs)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_pytorch_head_tail_layout_is_the_zigzag_sharding(world):
    # torch-cp runs on the zigzag shards as they are: PyTorch's default CP load balancer must lay out the same rows
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    from fivar.distributed import Sharding
    seqlen = world * 128 * int(torch.randint(1, 5, ()).item())
    theirs = _HeadTailLoadBalancer(seqlen, world, "cpu")._generate_indices()[0].view(world, -1)
    zigzag = Sharding.zigzag(seqlen, world)
    for rank in range(world):
        ours = torch.cat([torch.arange(s, e) for s, e in zigzag.runs[rank]])
        assert torch.equal(theirs[rank].long(), ours), rank
