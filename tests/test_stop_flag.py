"""ctx.should_stop(): a signal seen by one rank becomes the same answer on every rank, cheaply."""

from __future__ import annotations

import time

import pytest
from multirank import run_ranks

from wf_launch.rank.stop import StopFlag

pytestmark = pytest.mark.slow


def _loop(rank: int, world_size: int, stop_rank: int, stop_at: int, every: int) -> int:
    import torch.distributed as dist

    flag = StopFlag(dist.group.WORLD, every=every)
    for step in range(1000):
        if rank == stop_rank and step == stop_at:
            flag.request("test")
        if flag.should_stop():
            flag.drain()
            return step
    flag.drain()
    return -1


def test_one_rank_stop_is_agreed_by_every_rank_at_the_same_step() -> None:
    steps = run_ranks(_loop, 4, 2, 5, 1, timeout=60)
    assert (
        steps == [steps[0]] * 4 and steps[0] == 6
    )  # posted with the call at step 5, read at step 6
    steps = run_ranks(_loop, 4, 1, 13, 10, timeout=60)
    assert (
        steps == [steps[0]] * 4 and steps[0] == 30
    )  # agreements at calls 0, 10, 20 (posts the flag), 30


def _cost(rank: int, world_size: int, n: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    flag = StopFlag(dist.group.WORLD)  # agrees every 10 calls
    buf = torch.zeros(1, dtype=torch.int32)
    for _ in range(20):
        flag.should_stop()
        dist.all_reduce(buf)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        flag.should_stop()
        time.sleep(0.002)  # a step: the posted all-reduce completes meanwhile
    polled = time.perf_counter() - t0 - n * 0.002
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(buf)
        time.sleep(0.002)
    blocking = time.perf_counter() - t0 - n * 0.002
    flag.drain()
    return polled / n, blocking / n


def test_polling_costs_less_than_a_blocking_all_reduce() -> None:
    costs = run_ranks(_cost, 8, 200, timeout=120)
    polled = max(c[0] for c in costs)
    blocking = max(c[1] for c in costs)
    assert polled < 0.5 * blocking, (polled, blocking)


def _kinds(rank: int, world_size: int, seen: list[str | None]) -> tuple[int, bool]:
    import torch.distributed as dist

    flag = StopFlag(dist.group.WORLD, every=1)
    flag.preempt_signal = "SIGUSR2"
    for step in range(100):
        if step == 3 and seen[rank] is not None:
            flag.request(seen[rank])
        if flag.should_stop():
            flag.drain()
            return step, flag.for_preemption
    flag.drain()
    return -1, False


def test_a_preemption_warning_requeues_but_any_other_stop_on_any_rank_ends_the_run() -> None:
    """SLURM's USR2 alone: every rank agrees the job goes back to the queue. A SIGTERM (a
    Ctrl-C passed on) seen by one rank while another saw the warning: every rank agrees to stop
    for good, never a requeue the user did not ask for."""
    warned = run_ranks(_kinds, 3, ["SIGUSR2", None, "SIGUSR2"], timeout=60)
    assert warned == [(4, True)] * 3
    mixed = run_ranks(_kinds, 3, ["SIGUSR2", "SIGTERM", None], timeout=60)
    assert mixed == [(4, False)] * 3
    stopped = run_ranks(_kinds, 3, [None, None, "SIGTERM"], timeout=60)
    assert stopped == [(4, False)] * 3
