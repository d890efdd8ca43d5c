"""Timeouts are recognised by type and origin: a word in a user's message is not a timeout."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from multirank import run_ranks

from wf_launch.rank.failure import is_timeout_error


def _real_timeouts(rank: int, world_size: int) -> dict[str, bool]:
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    out: dict[str, bool] = {}
    if rank == 1:
        time.sleep(4)
        return out
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as exc:
        out["gloo_all_reduce"] = is_timeout_error(exc)
        try:
            raise RuntimeError("PPScheduler.irecv_prev: receive did not complete") from exc
        except RuntimeError as wrapped:
            out["wrapped"] = is_timeout_error(wrapped)
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        _get_default_store().wait(["never-set"], timedelta(milliseconds=300))
    except Exception as exc:
        out["store_wait"] = is_timeout_error(exc)
    return out


@pytest.mark.slow
def test_torch_and_gloo_timeouts_are_timeouts() -> None:
    res = run_ranks(_real_timeouts, 2, timeout=60)[0]
    assert res == {"gloo_all_reduce": True, "wrapped": True, "store_wait": True}


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad timeout"),
        TimeoutError("my own timeout"),
        RuntimeError("deadline exceeded in my parser"),
        KeyError("Timed out waiting"),
    ],
)
def test_a_word_in_a_user_error_is_not_a_timeout(exc: BaseException) -> None:
    assert not is_timeout_error(exc)
