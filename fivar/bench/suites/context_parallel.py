"""Context parallelism (fivar.distributed) on the GPUs of one host: one sequence sharded over W = min(GPUs, 8)
processes of an NCCL group (`Sharding.balanced`: zigzag, or zigzag over pieces of equal work where the mask leaves
zigzag uneven), bf16, head dim 128, GQA 32/8, causal. Variants: packed documents
(`document_mask`, seeded random document lengths) and Gemma 2's soft-capped sliding window
(`softcap_sliding_window`, window 4096) at S = 128k, documents also at 512k; `--quick`: S = 16k.

Contenders: `fivar-ring` and `fivar-all-gather` (each rank's shard, strategies of fivar.distributed) and
`single-gpu`, fivar's own prefill of the whole sequence on one GPU (same variant, same backend: FA3 on sm90);
`torch-cp`, PyTorch's own context parallelism on the same shards: FlexAttention with the variant as score_mod and
BlockMask under `_ContextParallel` (`torch_cp_attention`; PyTorch's SDPA CP takes no mask but is_causal);
`scaling_efficiency` = T_single / (W * T_cp) (1: perfect scaling). The `fwd+bwd` cases time forward and backward
(gradients of q, k and v) instead.

Checks before timing: the single-GPU result against the float32 torch reference on blocks of query rows at global
positions; each strategy's output and LSE (and gradients), gathered to rank 0, against the single-GPU result (or,
where that did not run, against the same reference blocks). A contender whose check fails is not timed.
Timing: CUDA events, a barrier before each call, warm-up first; each sample is the slowest rank's; median over
rounds. Each case runs in processes of its own (`run_group`), which also run on CPUs with gloo (the unit test).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..runner import Case, Measurement, Prepared
from .torch_cp import TORCH_CP, torch_cp_attention

#: every process of a group gets these (NVLink multicast off: mandatory on the hosts this suite runs on)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MAX_WORLD = 8
#: a strategy scaling below this efficiency gets one call profiled into the log
PROFILE_BELOW = 0.9
HEADS, HEAD_DIM = (32, 8), 128
SEQ, LONG_SEQ, QUICK_SEQ = 131072, 524288, 16384
WINDOW = 4096  # Gemma 2's local layers
DOCS = {SEQ: 8, LONG_SEQ: 32, QUICK_SEQ: 4}  # documents in the packed sequence: sparse enough at 512k to be cheap
CHECK_BLOCKS, CHECK_ROWS = 3, 32  # reference blocks of query rows (the full reference would not fit)
LSE_ATOL = 5e-2  # log2 units: dropping or doubling a shard's keys moves a row's LSE by ~1
CASE_TIMEOUT_S = 420.0  # fivar takes under a minute, torch-cp minutes more to compile: past this a rank failed
STRATEGIES = {"fivar-ring": "ring", "fivar-all-gather": "all_gather", TORCH_CP: "torch"}
SINGLE = "single-gpu"


@dataclass(frozen=True)
class Config:
    """One case as the worker processes run it (picklable: spawned processes receive it)."""
    variant: str  # a bundled variant (fivar.load)
    seqlen: int
    backward: bool = False  # time forward + backward (gradients of q, k, v)
    docs: int = 0  # document_mask: this many documents of seeded random lengths
    window: int = 0  # softcap_sliding_window: the window
    heads: tuple = HEADS
    head_dim: int = HEAD_DIM
    dtype: str = "bfloat16"
    backend: str = "fa3"  # per pair and for the single-GPU prefill: fa3, fa2, triton or reference
    device: str = "cuda"  # cuda: NCCL, one GPU a rank; cpu: gloo
    contenders: tuple = (SINGLE, *STRATEGIES)
    seed: int = 0
    budget_s: float = 1.0  # timed seconds per contender, at least MIN_ROUNDS rounds
    warmup: int = 2
    corrupt: bool = False  # perturb the gathered output before its check (the check's own test)


MIN_ROUNDS, MAX_ROUNDS = 3, 20


# ---------------------------------------------------------------------------------------------- the inputs

def doc_lengths(seqlen: int, docs: int, seed: int) -> list[int]:
    """`docs` lengths summing to seqlen, each at least seqlen / (4 docs), seeded."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    floor = seqlen // (4 * docs)
    share = torch.rand(docs, generator=gen, dtype=torch.float64)
    extra = (share / share.sum() * (seqlen - floor * docs)).floor().long()
    extra[-1] += seqlen - floor * docs - int(extra.sum())
    return [floor + int(x) for x in extra]


def params_of(cfg: Config, device) -> dict:
    import fivar.testing
    if cfg.docs:
        ids = fivar.testing.document_ids(doc_lengths(cfg.seqlen, cfg.docs, cfg.seed))
        return {"doc_ids": ids.view(1, -1).to(device)}
    return {"window": cfg.window} if cfg.window else {}


# ------------------------------------------------------------------------------------------ the processes

@contextlib.contextmanager
def _environ(values: dict):
    """os.environ with `values` while spawning (children inherit it), as it was after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_group(cfg: Config, world: int, timeout_s: float = CASE_TIMEOUT_S) -> list[dict]:
    """Runs `worker` in `world` spawned processes of one group; rank 0's rows (dicts of Measurement fields). A
    process that fails or a group that outlives timeout_s gives one error row."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="fivar-cp-") as tmp:
        out = Path(tmp) / "rows.json"
        store = f"file://{Path(tmp) / 'store'}"  # the group meets at a file of its own: no port to race for
        with _environ(NCCL_ENV):
            ctx = mp.start_processes(_entry, args=(world, cfg, str(out), store), nprocs=world, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    return [_error_row(f"the group of {world} processes did not finish within {timeout_s:.0f} s")]
        except Exception as e:  # a rank raised (its traceback is in the message) or died
            return [_error_row(_last_line(str(e)))]
        finally:
            for p in ctx.processes:  # this group's own processes, by id: none outlives its case
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if not out.exists():
            return [_error_row("rank 0 wrote no rows")]
        return json.loads(out.read_text())


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return (lines[-1] if lines else "failed")[:400]


def _error_row(msg: str, contender: str = "*") -> dict:
    return asdict(Measurement(contender, "ms", None, "error", detail={"error": msg}))


def _entry(rank: int, world: int, cfg: Config, out: str, store: str):
    os.environ.update(NCCL_ENV)
    import torch
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=CASE_TIMEOUT_S)
    if cfg.device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timeout)
    rows = worker(cfg)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    # only after a clean run: a rank that raised exits at once (tearing down a group whose peers wait in a
    # collective could hang), and the parent ends the others
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------- one rank's run

class Group:
    """This rank's view of the group: device, barrier, timer, collectives on host values."""

    def __init__(self, cfg: Config):
        import torch
        import torch.distributed as dist
        self.dist, self.torch = dist, torch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.cuda = cfg.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")

    def sync(self):
        """Every rank here, with its queued work done."""
        if self.cuda:
            self.torch.cuda.synchronize()
        self.dist.barrier()
        if self.cuda:
            self.torch.cuda.synchronize()

    def max(self, x: float) -> float:
        t = self.torch.tensor([x], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def objects(self, x) -> list:
        got = [None] * self.world
        self.dist.all_gather_object(got, x)
        return got

    def broadcast(self, x):
        box = [x]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def time_ms(self, fn) -> float:
        """One call's milliseconds on this rank, started after a barrier."""
        self.sync()
        if self.cuda:
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    def gather(self, x, sharding):
        """The full-sequence tensor of every rank's rows, on rank 0 (None elsewhere)."""
        torch = self.torch
        rows = sharding.max_length
        buf = x.new_zeros((rows, *x.shape[1:]))
        buf[:x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in range(self.world)] if self.rank == 0 else None
        self.dist.gather(buf, parts, dst=0)
        if self.rank:
            return None
        return sharding.unshard([p[:sharding.length(r)] for r, p in enumerate(parts)])


def _call(fn):
    """(result, None) or (None, one-line error)."""
    try:
        return fn(), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:400]


def _checked(check) -> str | None:
    """A check's verdict (None: passed), a check that raises being its contender's error: rank 0 alone runs the
    checks, and a rank that dies leaves the others waiting for the case's timeout with every row lost."""
    verdict, crash = _call(check)
    return crash or verdict


def worker(cfg: Config) -> list[dict]:
    """One rank's part of a case (every rank of an initialised torch.distributed group calls it): rows (dicts of
    Measurement fields) on rank 0, [] elsewhere. Collective: every rank reaches the same calls in the same order."""
    import torch

    import fivar
    from ...codegen.torch_ref import reference_attention
    from ...distributed import Sharding, all_gather_attention, ring_attention
    from ...distributed.positions import global_variant, shifts
    from ...runtime import attention as runtime
    g = Group(cfg)
    t0 = time.perf_counter()

    def log(what: str):  # progress on rank 0: a slow or stuck step shows where it is
        if g.rank == 0:
            print(f"  [context-parallel W={g.world} {cfg.variant} S={cfg.seqlen}] {time.perf_counter() - t0:.0f} s: "
                  f"{what[:200]}", flush=True)
    dtype = getattr(torch, cfg.dtype)
    variant = fivar.load(cfg.variant)
    params = params_of(cfg, g.device)
    S, (hq, hkv), d = cfg.seqlen, cfg.heads, cfg.head_dim
    sharding = Sharding.balanced(variant, S, g.world, causal=True, num_qo_heads=hq, num_kv_heads=hkv, **params)
    log(f"sharding {sharding.runs}")
    # every (query run, key run) pair is a one-shot plan of its own: keep them all between calls
    runtime._one_shot.capacity = max(runtime._one_shot.capacity, 4 * g.world * g.world + 4)

    # the same inputs on every rank: rank 0's, broadcast
    gen = torch.Generator(device=g.device).manual_seed(cfg.seed)
    full = [torch.randn(S, h, d, generator=gen, device=g.device, dtype=dtype) for h in (hq, hkv, hkv)]
    full.append(torch.randn(S, hq, d, generator=gen, device=g.device, dtype=dtype))  # dout, for the backward
    for t in full:
        g.dist.broadcast(t, src=0)
    q, k, v, dout = full
    # each strategy's rows of them: fivar's on its balanced sharding, PyTorch's on its head-tail layout (zigzag)
    layouts = {"ring": sharding, "all_gather": sharding, "torch": Sharding.zigzag(S, g.world)}
    mine = {sh: [sh.shard(t, g.rank).contiguous() for t in full] for sh in set(layouts.values())}
    if g.rank:  # only rank 0 runs the whole sequence
        q = k = v = dout = full = None

    def single(q_, k_, v_):
        if cfg.backend == "reference":
            o, lse = reference_attention(variant, q_, k_, v_, causal=True, params=params, return_lse=True)
            return o.to(dtype), lse
        if cfg.backward:
            return variant.attention(q_, k_, v_, causal=True, backend=cfg.backend, return_lse=True, **params)
        return variant.prefill(q_, k_, v_, causal=True, backend=cfg.backend, return_lse=True, **params)

    def cp(strategy, q_, k_, v_):
        if strategy == "torch":
            return torch_cp(q_, k_, v_)
        fn = ring_attention if strategy == "ring" else all_gather_attention
        return fn(variant, q_, k_, v_, sharding, causal=True, backend=cfg.backend, return_lse=True, **params)

    def with_grads(fn, inputs, do):
        """fn's (out, lse), then the gradients of (out * do).sum() in the inputs."""
        leaves = [x.detach().requires_grad_() for x in inputs]
        out, lse = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, do)
        return (out.detach(), lse.detach(), *grads)

    def run_single():
        if not cfg.backward:
            return single(q, k, v)
        return with_grads(single, (q, k, v), dout)

    def run_cp(strategy):
        rows = mine[layouts[strategy]]
        if not cfg.backward:
            return cp(strategy, *rows[:3])
        return with_grads(lambda *x: cp(strategy, *x), rows[:3], rows[3])

    names = ("out", "lse", "dq", "dk", "dv")
    status, times = {}, {}  # status[contender]: None (checked, passed) or why not
    want = refs = None
    if g.rank == 0:
        # the single-GPU result (the strategies' check: run even where its row is not wanted), checked against
        # the reference on blocks of query rows at global positions
        refs, ref_err = _call(lambda: _reference_blocks(variant, q, k, v, params, reference_attention,
                                                        global_variant, shifts))
        got, err = _call(run_single)
        if err is None:
            err = _checked(lambda: _check_blocks_against(variant.name, SINGLE, got, refs, dtype)) if refs else \
                f"no reference to check against ({ref_err})"
        want = got if err is None else None
        status[SINGLE] = err
    status[SINGLE] = g.broadcast(status.get(SINGLE))
    log(f"{SINGLE} checked: {status[SINGLE] or 'pass'}")

    torch_cp = None
    if TORCH_CP in cfg.contenders:  # built before any contender's collective call: a failure skips it on every rank
        torch_cp, err = _call(lambda: torch_cp_attention(variant, params, layouts["torch"], cfg.heads, d,
                                                                g.device))
        status[TORCH_CP] = next((e for e in g.objects(err) if e), None)
        log(f"{TORCH_CP} built: {status[TORCH_CP] or 'ok'}")

    for name, strategy in STRATEGIES.items():
        if name not in cfg.contenders or status.get(name):
            continue
        got, err = _call(lambda: run_cp(strategy))
        errs = [e for e in g.objects(err) if e]
        if errs:  # every rank skips it alike
            status[name] = errs[0]
            log(f"{name}: {errs[0]}")
            continue
        gathered = [g.gather(x, layouts[strategy]) for x in got]
        err = None
        if g.rank == 0:
            if cfg.corrupt:  # a wrong output the check must catch: a block of rows scaled
                gathered[0] = gathered[0].clone()
                gathered[0][S // 3: S // 3 + max(1, S // 16)] *= 1.5
            if want is not None:
                err = _checked(lambda: _check_full(variant.name, name, gathered, want, dtype, names))
            elif refs:
                err = _checked(lambda: _check_blocks_against(variant.name, name, gathered, refs, dtype))
            else:
                err = "no single-GPU result and no reference to check against"
        status[name] = g.broadcast(err)
        log(f"{name} checked: {status[name] or 'pass'}")
        del got, gathered

    # timing: only what passed; the single-GPU run on rank 0 while the others wait at the barriers
    order = [c for c in (SINGLE, *STRATEGIES) if c in cfg.contenders and status.get(c) is None]
    for name in order:
        fn = run_single if name == SINGLE else (lambda s=STRATEGIES[name]: run_cp(s))
        on = (lambda: fn()) if name != SINGLE or g.rank == 0 else (lambda: None)
        for _ in range(cfg.warmup):
            on()
        first = g.max(g.time_ms(on))
        rounds = max(MIN_ROUNDS, min(MAX_ROUNDS, int(cfg.budget_s * 1e3 / max(first, 1e-3))))
        own = [g.time_ms(on) for _ in range(rounds)]  # this rank's; a sample is the slowest rank's
        samples = [g.max(t) for t in own]
        times[name] = samples
        ranks = " ".join(f"{t:.3f}" for t in g.objects(_median(sorted(own))))  # where a rank waits for another
        log(f"{name} timed: median {_median(sorted(samples)):.3f} ms over {rounds} rounds (each rank's: {ranks})")
        if name != SINGLE and SINGLE in times and \
                _median(sorted(times[SINGLE])) < PROFILE_BELOW * g.world * _median(sorted(samples)):
            _profile_one_call(g, on, log)  # scaling below PROFILE_BELOW: say where the time goes

    if g.rank:
        return []
    rows = []
    label = f"{'forward+backward' if cfg.backward else 'forward'}, {cfg.backend}, balanced, W={g.world}"
    for name in (SINGLE, *STRATEGIES):
        if name not in cfg.contenders:
            continue
        if status.get(name) is not None:
            check = "fail" if status[name].startswith("FAIL") else "error"
            rows.append(asdict(Measurement(name, "ms", None, check, label, {"error": status[name]})))
            continue
        s = sorted(times[name])
        rows.append(asdict(Measurement(name, "ms", _median(s), "pass", label,
                                       {"spread_ms": [s[0], s[-1]], "samples": len(s), "world": g.world})))
    if SINGLE in times:
        for name in STRATEGIES:
            if name in times:
                t_single, t_cp = _median(sorted(times[SINGLE])), _median(sorted(times[name]))
                rows.append(asdict(Measurement(name, "scaling_efficiency", t_single / (g.world * t_cp), "pass", label,
                                               {"single_ms": t_single, "cp_ms": t_cp, "world": g.world})))
    return rows


def _profile_one_call(g, fn, log, rows: int = 12) -> None:
    """One more call of `fn` on every rank (it is collective), under torch.profiler on rank 0: the ops taking the
    most host and device time go to the log (not the rows), so a run shows why a strategy does not scale. A profiler
    that fails costs only the profile: rank 0 still makes the call the other ranks wait in."""
    import torch
    g.sync()
    prof = None
    if g.rank == 0:
        try:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            prof = profile(activities=acts)
            prof.__enter__()
        except Exception as e:  # noqa: BLE001 (a diagnostic: never the case's rows)
            log(f"no profile ({type(e).__name__}: {e})")
            prof = None
    fn()
    g.sync()
    if prof is None:
        return
    try:
        prof.__exit__(None, None, None)
        avg = prof.key_averages()
        log(f"scaling efficiency below {PROFILE_BELOW}: a profile of one call follows")
        for key in ("self_cpu_time_total", "self_device_time_total" if torch.cuda.is_available() else None):
            if key is not None:
                print(f"by {key}:\n{avg.table(sort_by=key, row_limit=rows, max_name_column_width=60)}", flush=True)
    except Exception as e:  # noqa: BLE001
        log(f"no profile ({type(e).__name__}: {e})")


def _reference_blocks(variant, q, k, v, params, reference_attention, global_variant, shifts):
    """(starts, [(out, lse)]): the float32 reference of CHECK_ROWS query rows at each start, at global positions
    (the per-pair variant fivar.distributed derives, causal included), against every key."""
    S = q.shape[0]
    derived = global_variant(variant, True)
    starts = _check_blocks(S)
    refs = [reference_attention(derived, q[s:s + CHECK_ROWS], k, v, params={**params, **shifts(s, CHECK_ROWS, 0, S)},
                                return_lse=True) for s in starts]
    return starts, refs


def _median(s: list) -> float:
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _check_blocks(S: int) -> list[int]:
    """Starts of the reference's query row blocks: the first rows, the middle, the last."""
    starts = sorted({0, max(0, S // 2 - CHECK_ROWS // 2), S - CHECK_ROWS})
    return [s for s in starts if s >= 0][:CHECK_BLOCKS]


def _lse_check(name: str, lse, ref_lse) -> str | None:
    import torch
    if not torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse.to(lse.device))):
        return f"FAIL {name} lse: rows without keys differ"
    fin = torch.isfinite(ref_lse)
    err = float((lse.double() - ref_lse.double().to(lse.device)).abs()[fin].max()) if fin.any() else 0.0
    return None if err <= LSE_ATOL else f"FAIL {name} lse: max error {err:.3g} > {LSE_ATOL}"


def _check_blocks_against(variant: str, name: str, got, want_ref, dtype) -> str | None:
    """got (out, lse, ...) of the whole sequence against the reference's row blocks: None, or why not."""
    from ...testing import compare
    blocks, refs = want_ref
    for s, (ref, ref_lse) in zip(blocks, refs):
        rows = slice(s, s + CHECK_ROWS)
        r = compare(variant, f"{name} rows {s}..{s + CHECK_ROWS}", got[0][rows], ref, dtype)
        if not r.passed:
            return str(r)
        bad = _lse_check(f"{name} rows {s}..", got[1][rows], ref_lse)
        if bad:
            return bad
    return None


def _check_full(variant: str, name: str, got, want, dtype, names) -> str | None:
    """Every output (out, lse, gradients) of the whole sequence against the single-GPU run's: None or why not."""
    from ...testing import compare
    for what, x, w in zip(names, got, want):
        if what == "lse":
            bad = _lse_check(f"{name} vs {SINGLE}", x, w)
            if bad:
                return bad
            continue
        r = compare(variant, f"{name} {what} vs {SINGLE}", x, w, dtype)
        if not r.passed:
            return str(r)
    return None


# ------------------------------------------------------------------------------------------- the suite

def _target(cfg: Config) -> str:
    """The target fivar's default call (`auto`) picks for the variant's prefill here: FA3 on sm90, else FA2."""
    import fivar
    from ...runtime.forms import choose_target
    return choose_target(fivar.load(cfg.variant), "auto", "single_prefill")[0]


def modules(cfg: Config, target: str) -> list:
    """The modules the case runs: the single-GPU prefill's and the per-pair variant's (fivar.distributed derives it
    from the variant on global positions; the runs of one sharding never straddle each other's diagonal, so causal
    is the kernels' own, fivar.distributed.positions.pair_causality), listed for the runner's one parallel build."""
    import fivar
    from ...distributed.positions import global_variant
    from ...jit.build import serving_modules
    from ...jit.targets import named
    if named(target) is None or not named(target).is_flashinfer:  # the twin, the reference: nothing to build
        return []
    v = fivar.load(cfg.variant)
    out = {}
    for var in (v, global_variant(v, False)):
        for m in serving_modules(var, "single_prefill", target, "bf16", cfg.head_dim):
            out[m.uri] = m
    return list(out.values())


def measure(cfg: Config) -> list[Measurement]:
    import torch

    from ..contenders import selected
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = min(gpus, MAX_WORLD)
    if world < 2:
        return [Measurement("*", "ms", None, "error", detail={"error": f"context parallelism needs >= 2 CUDA GPUs, "
                                                                       f"this host has {gpus}"})]
    cfg = replace(cfg, backend=_target(cfg), contenders=tuple(c for c in cfg.contenders if selected(c)))
    return [Measurement(**r) for r in run_group(cfg, world)]


def _case(cfg: Config, quick: bool) -> Case:
    what = f"documents({cfg.docs})" if cfg.docs else f"softcap window {cfg.window}"
    name = f"{cfg.variant} causal S={cfg.seqlen} {'fwd+bwd' if cfg.backward else 'prefill'}"
    budget = replace(cfg, budget_s=0.5 if quick else cfg.budget_s, warmup=1 if quick else cfg.warmup)
    shape = {"seqlen": cfg.seqlen, "heads": f"{cfg.heads[0]}/{cfg.heads[1]}", "head_dim": cfg.head_dim,
             "dtype": "bf16", "causal": True, "sharding": "balanced", "mask": what}
    return Case("context-parallel", name, "train" if cfg.backward else "prefill", shape,
                lambda: Prepared(measure=lambda: measure(budget)), baseline=SINGLE,
                modules=lambda: modules(cfg, _target(cfg)))


def cases(quick: bool = False) -> list:
    seq = QUICK_SEQ if quick else SEQ
    docs = Config("document_mask", seq, docs=DOCS[seq], seed=1)
    window = Config("softcap_sliding_window", seq, window=WINDOW, seed=2)
    out = [docs, window]
    out += [replace(docs, backward=True), replace(window, backward=True)]
    if not quick:  # 512k: the documents and the window again, forward and forward+backward
        long_docs = Config("document_mask", LONG_SEQ, docs=DOCS[LONG_SEQ], seed=3, budget_s=1.5, warmup=1)
        long_window = Config("softcap_sliding_window", LONG_SEQ, window=WINDOW, seed=4, budget_s=1.5, warmup=1)
        out += [long_docs, long_window, replace(long_docs, backward=True), replace(long_window, backward=True)]
    return [_case(c, quick) for c in out]
