"""PP scheduler on real gloo groups: ring traffic, FIFO queued receives, lifecycle and
re-initialization."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from multirank import run_ranks

from worldfoundry.core.distributed import groups, pipeline


def _message(sender: int, k: int) -> torch.Tensor:
    """The k-th message ``sender`` sends: shape and content both identify it."""
    return torch.full((k + 1, 3), float(100 * sender + k))


def _ring_round(sched: pipeline.PPScheduler, n_msgs: int = 3) -> None:
    """Queue n receives, send n messages to the next stage, check they come back in FIFO order."""
    prev = sched.prev_rank
    for k in range(n_msgs):
        sched.queue_irecv_prev((k + 1, 3), torch.float32)
    assert sched.pending == n_msgs
    sends = [sched.isend_next(_message(sched.group.rank, k)) for k in range(n_msgs + 1)]
    for k in range(n_msgs):
        got = sched.queue_irecv_prev_data()
        assert got.device == torch.device("cpu")
        assert torch.equal(got, _message(prev, k)), f"message {k} out of order: {got}"
    last = sched.recv_prev_data((n_msgs + 1, 3), torch.float32)  # after every queued one
    assert torch.equal(last, _message(prev, n_msgs))
    for work in sends:
        work.wait()
    with pytest.raises(RuntimeError, match="no receive is queued; call queue_irecv_prev"):
        sched.queue_irecv_prev_data()


def _ring(rank: int, world: int, pp_size: int, cp_size: int) -> list[int]:
    with pytest.raises(RuntimeError, match="PP scheduler is not initialized: call .*dist_init"):
        pipeline.pp_scheduler()
    groups.initialize_model_parallel(pp_size=pp_size, cp_size=cp_size)
    try:
        sched = pipeline.init_pp_scheduler()
        assert pipeline.pp_scheduler() is sched
        with pytest.raises(RuntimeError, match="already initialized"):
            pipeline.init_pp_scheduler()
        pp = groups.get_pp_group()
        assert (sched.next_rank, sched.prev_rank) == (pp.next_rank, pp.prev_rank)
        _ring_round(sched)
        buf = torch.empty(2, 2)
        recv = sched.irecv_prev(buf)
        sched.isend_next(torch.full((2, 2), float(rank))).wait()
        recv.wait()
        assert torch.equal(buf, torch.full((2, 2), float(sched.prev_rank)))
        return pp.ranks
    finally:
        groups.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.parametrize(("world", "pp_size", "cp_size"), [(2, 2, 1), (4, 4, 1), (4, 2, 2)])
def test_ring_send_receive_fifo(world: int, pp_size: int, cp_size: int) -> None:
    ranks = run_ranks(_ring, world, pp_size, cp_size, timeout=60)
    assert ranks[0] == list(
        range(0, world, cp_size)
    )  # with cp inside, pp neighbours are cp_size apart


def _config(**engine: object) -> SimpleNamespace:
    return SimpleNamespace(engine_config=SimpleNamespace(distributed_backend="gloo", **engine))


def _reinit(rank: int, world: int) -> tuple[int, int]:
    from worldfoundry.core.distributed import dist_init, get_cp_size_t
    from worldfoundry.core.distributed.context_parallel import find_split

    dist_init(_config(pp_size=4, cp_size=1))
    first = pipeline.pp_scheduler()
    _ring_round(first)
    find_split((1, 16, 8, 32, 32), 2)
    first.queue_irecv_prev((5,), torch.float32)  # never matched: dropped by the reset
    groups.destroy_model_parallel()
    assert get_cp_size_t() is None
    with pytest.raises(RuntimeError, match="not initialized"):
        pipeline.pp_scheduler()
    with pytest.raises(RuntimeError, match="was reset"):
        first.isend_next(torch.ones(1))

    dist_init(
        _config(pp_size=4, cp_size=1)
    )  # same (world) group again: the stale receive must not match
    second = pipeline.pp_scheduler()
    assert second is not first and second.tag != first.tag
    _ring_round(second)
    groups.destroy_model_parallel()

    dist_init(_config(pp_size=2, cp_size=2))  # another layout
    third = pipeline.pp_scheduler()
    _ring_round(third, n_msgs=2)
    return third.prev_rank, third.next_rank


@pytest.mark.slow
def test_reset_by_destroy_and_reinitialize_with_another_layout() -> None:
    neighbours = run_ranks(_reinit, 4, timeout=60)
    assert neighbours == [(2, 2), (3, 3), (0, 0), (1, 1)]  # cp inner: pp groups {0,2} and {1,3}


def test_before_init_and_without_groups() -> None:
    pipeline._reset_pp_scheduler()
    with pytest.raises(
        RuntimeError, match=r"call worldfoundry.core.distributed.dist_init\(config\)"
    ):
        pipeline.pp_scheduler()
    with pytest.raises(RuntimeError, match="not initialized"):
        pipeline.init_pp_scheduler()
    pipeline._reset_pp_scheduler()  # idempotent


def test_queue_error_on_a_lone_stage_is_immediate() -> None:
    lone = groups.GroupCoordinator("pp", [0], 0, None, None)
    sched = pipeline.PPScheduler(lone, device="cpu")
    with pytest.raises(RuntimeError, match="no receive is queued"):
        sched.queue_irecv_prev_data()
    with pytest.raises(RuntimeError, match="pp group has one rank"):
        sched.queue_irecv_prev((1,), torch.float32)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        pipeline.PPScheduler(lone, device="cpu", timeout=-1)
