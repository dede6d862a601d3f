"""Gloo process groups of spawned CPU processes, kept across the tests of a file: starting one costs seconds on a
small machine (each process imports torch and fivar), running a case in one costs far less."""
import datetime
import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """`world` spawned processes of one gloo group: run(fn, *args) calls fn(rank, world, *args) (a module-level
    function: the processes import it) on every rank and returns each rank's result, in rank order. Each call starts
    from what a fresh process would hold: fivar.distributed.core's constants as imported (tests change its blocks)
    and no plan kept by an earlier call. A failure in any rank fails the call with that rank's traceback, and the
    group is ended then, not reused (its other ranks may be waiting in a collective)."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world, self.results = world, ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_serve, args=(rank, world, port, self.tasks[rank], self.results),
                                  daemon=True) for rank in range(world)]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout_s: float = 300) -> list:
        for q in self.tasks:
            q.put((fn, args))
        got = {}
        while len(got) < self.world:
            try:
                rank, error, value = self.results.get(timeout=timeout_s)
            except Exception:
                self.close()
                raise AssertionError(f"{fn.__name__}: ranks {sorted(set(range(self.world)) - set(got))} did not "
                                     f"finish within {timeout_s:.0f} s") from None
            if error is not None:
                self.close()
                raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{error}")
            got[rank] = value
        return [got[r] for r in range(self.world)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self):
        for p in self.procs:  # this group's own processes, by id: nothing of theirs is needed any more
            p.kill()
        for p in self.procs:
            p.join(10)


class Groups:
    """A context manager giving get(world): the kept Group of `world` ranks, started on first use (again after a
    failure ended it); every group it started is ended on exit."""

    def __init__(self):
        self.started: dict[int, Group] = {}

    def __enter__(self):
        def get(world: int) -> Group:
            if world not in self.started or not self.started[world].alive():
                self.started[world] = Group(world)
            return self.started[world]
        return get

    def __exit__(self, *exc):
        for g in self.started.values():
            g.close()


def _serve(rank, world, port, tasks, results):
    from fivar.distributed import core
    from fivar.runtime.plan_cache import invalidate_plans
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    constants = {k: v for k, v in vars(core).items() if k.isupper()}
    while True:
        fn, args = tasks.get()
        try:
            value = fn(rank, world, *args)
            results.put((rank, None, value))
        except BaseException:
            results.put((rank, traceback.format_exc(), None))
        finally:
            vars(core).update(constants)
            invalidate_plans()
