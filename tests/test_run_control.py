"""Run control on real gloo groups: distributed_run, fault-propagating collectives, queries."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from multirank import run_ranks

from worldfoundry.core.distributed.run_control import (
    DistributedProcessGroup,
    DistributedState,
    ParallelState,
    all_reduce,
    backend,
    barrier,
    broadcast_from,
    distributed_run,
    is_available,
    is_distributed_launch,
    is_distributed_run,
    is_initialized,
    is_master,
    rank,
    size,
)

_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def _caught(fn, *args, **kwargs) -> tuple[str, str] | tuple[str, object]:
    """('ok', value) or (exception type name, message / exit code)."""
    try:
        return ("ok", fn(*args, **kwargs))
    except SystemExit as e:
        return ("SystemExit", e.code)
    except BaseException as e:
        return (type(e).__name__, str(e))


# --------------------------------------------------------------------------- single process


def test_state_and_queries_in_a_single_process(single_process: None) -> None:
    assert is_available()
    assert not is_initialized() and not is_distributed_launch() and not is_distributed_run()
    assert (rank(), size(), backend(), is_master()) == (0, 1, None, True)
    barrier()  # a no-op without a group
    with distributed_run(device="cpu") as state:
        assert state == DistributedState(rank=0, world_size=1, device=torch.device("cpu"))
        assert state.is_main
        assert not is_initialized()
    assert not DistributedState(rank=1, world_size=2, device="cpu").is_main


def test_collectives_run_fn_alone_in_a_single_process(single_process: None) -> None:
    assert all_reduce("n", lambda: 5, lambda vs: vs) == [5]
    assert broadcast_from("cfg", lambda: {"a": 1}) == {"a": 1}
    with pytest.raises(ZeroDivisionError):
        all_reduce("bad", lambda: 1 / 0, min)
    with pytest.raises(ValueError, match=r"rank=1 is outside the run; allowed 0\.\.0"):
        broadcast_from("cfg", lambda: 1, rank=1)
    with pytest.raises(TypeError, match="label must be a str"):
        all_reduce(3, lambda: 1, min)  # type: ignore[arg-type]


def test_cuda_without_cuda_says_to_pass_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(RuntimeError, match=r"needs CUDA.*pass device='cpu'"):
        with distributed_run(device="cuda"):
            pass
    with pytest.raises(
        ValueError, match=r"device='mps' is not supported on a distributed launch.*allowed"
    ):
        with distributed_run(device="mps"):
            pass
    assert not is_initialized()


def test_launch_without_a_group_refuses_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    assert is_distributed_launch() and not is_distributed_run()
    with pytest.raises(
        RuntimeError, match=r"rank 2 of a distributed launch .*not set up.*distributed_run"
    ):
        all_reduce("x", lambda: 1, sum)
    with pytest.raises(RuntimeError, match="not set up"):
        broadcast_from("x", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ValueError, match=r"WORLD_SIZE='four' is not an integer"):
        is_distributed_launch()


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta"):
        with distributed_run(timeout=30, device="cpu"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match=r"device='nope' is not a device"):
        with distributed_run(device="nope"):
            pass
    with pytest.raises(ValueError, match=r"group=3 is not allowed"):
        DistributedProcessGroup(3)


def test_unused_groups_without_a_run() -> None:
    state = ParallelState()
    assert not state.tensor_parallel_group.is_initialized()
    assert (
        state.tensor_parallel_group.rank() == -1 and state.tensor_parallel_group.world_size() == -1
    )
    assert DistributedProcessGroup.get_dist_syncd_obj(7, state.data_parallel_group, max) == 7
    assert "tensor_parallel_group" in repr(state)


# --------------------------------------------------------------------------- distributed_run on a
# launch


def _run_owns_group(rank_: int, world: int) -> dict:
    before = is_initialized()
    with distributed_run(timeout=timedelta(minutes=5), device="cpu") as state:
        inside = (
            state.rank,
            state.world_size,
            str(state.device),
            state.is_main,
            backend(),
            is_distributed_run(),
            is_master(),
            rank(),
            size(),
        )
        barrier()
    return {"before": before, "inside": inside, "after": is_initialized()}


@pytest.mark.slow
def test_distributed_run_sets_up_gloo_and_destroys_it() -> None:
    results = run_ranks(_run_owns_group, 2, init=False)
    for r, res in enumerate(results):
        assert res["before"] is False and res["after"] is False
        assert res["inside"] == (r, 2, "cpu", r == 0, "gloo", True, r == 0, r, 2)


def _run_leaves_callers_group(rank_: int, world: int) -> dict:
    import torch.distributed as dist

    with distributed_run(device="cpu") as state:
        got = (state.rank, state.world_size)
    raised = _caught(_raise_inside_run)
    return {
        "state": got,
        "after": dist.is_initialized(),
        "raised": raised,
        "after_raise": dist.is_initialized(),
        "works": all_reduce("after", lambda: rank_, sum),
    }


def _raise_inside_run() -> None:
    with distributed_run(device="cpu"):
        raise KeyError("mine")


@pytest.mark.slow
def test_distributed_run_leaves_the_callers_group_alone() -> None:
    results = run_ranks(_run_leaves_callers_group, 2)  # the harness set the group up
    for r, res in enumerate(results):
        assert res["state"] == (r, 2)
        assert res["after"] and res["after_raise"]
        assert res["raised"] == ("KeyError", "'mine'")
        assert res["works"] == 1


def _body_sets_up_group(rank_: int, world: int) -> dict:
    import torch.distributed as dist

    outcome = {}
    with distributed_run(device="cpu") as state:
        outcome["state"] = (state.rank, state.world_size)
        dist.init_process_group("gloo", rank=0, world_size=1)
        outcome["inside"] = dist.is_initialized()
    outcome["after"] = dist.is_initialized()
    try:
        with distributed_run(device="cpu"):
            dist.init_process_group("gloo", rank=0, world_size=1)
            raise ValueError("body failed")
    except ValueError:
        outcome["after_raise"] = dist.is_initialized()
    return outcome


@pytest.mark.slow
def test_single_process_run_destroys_a_group_the_body_set_up() -> None:
    [res] = run_ranks(_body_sets_up_group, 1, init=False)  # WORLD_SIZE=1: not a launch
    assert res == {"state": (0, 1), "inside": True, "after": False, "after_raise": False}


def _body_raises_on_one_rank(rank_: int, world: int) -> dict:
    import os

    import torch.distributed as dist

    start = time.monotonic()
    try:
        with distributed_run(timeout=timedelta(minutes=5), device="cpu"):
            barrier()
            if rank_ == 2:
                raise ValueError("rank 2 body failed")
            time.sleep(0.2)
            dist.all_reduce(torch.ones(1))  # waits on rank 2, which never comes
    except Exception as e:
        return {
            "error": f"{type(e).__name__}: {e}",
            "seconds": time.monotonic() - start,
            "group_left": dist.is_initialized(),
            "pid": os.getpid(),
        }
    return {"error": None}


@pytest.mark.slow
def test_body_raising_on_one_rank_ends_the_run_without_a_hang() -> None:
    start = time.monotonic()
    results = run_ranks(_body_raises_on_one_rank, 4, init=False, timeout=60)
    assert time.monotonic() - start < 30  # far below the 5-minute group timeout
    assert results[2]["error"] == "ValueError: rank 2 body failed"
    for r, res in enumerate(results):
        assert res["error"] is not None, f"rank {r} finished although rank 2 never joined"
        assert res["group_left"] is False  # aborted: nothing left to wait on
        assert res["seconds"] < 20
        if r != 2:
            assert res["error"].startswith("RuntimeError")


# --------------------------------------------------------------------------- all_reduce /
# broadcast_from


def _collectives(rank_: int, world: int) -> dict:
    out: dict = {}
    out["sum"] = all_reduce("sum", lambda: rank_ + 1, sum)
    out["order"] = all_reduce("order", lambda: f"r{rank_}", lambda vs: vs)
    out["bcast"] = broadcast_from("env", lambda: {"from": rank_}, rank=1)

    def fail_on_1() -> int:
        if rank_ == 1:
            raise ValueError("bad batch")
        return rank_

    start = time.monotonic()
    out["raise"] = _caught(all_reduce, "batch", fail_on_1, min)
    out["raise_s"] = time.monotonic() - start

    def two_fail() -> int:
        if rank_ in (2, 3):
            raise KeyError(f"k{rank_}")
        return 0

    out["two_fail"] = _caught(all_reduce, "two", two_fail, min)

    def unpicklable() -> object:
        return (lambda: 0) if rank_ == 3 else 0

    out["unpicklable"] = _caught(all_reduce, "pickle", unpicklable, lambda vs: vs)

    def exits() -> int:
        if rank_ in (1, 2):
            raise SystemExit(3 + rank_)
        return 0

    out["exit"] = _caught(all_reduce, "exit", exits, min)

    def exit_and_error() -> int:
        if rank_ == 0:
            raise SystemExit(9)
        if rank_ == 2:
            raise OSError("disk")
        return 0

    out["mixed"] = _caught(all_reduce, "mixed", exit_and_error, min)
    out["labels"] = _caught(all_reduce, "step-a" if rank_ != 3 else "step-b", lambda: 1, sum)
    out["kinds"] = (
        _caught(all_reduce, "x", lambda: 1, sum)
        if rank_ % 2
        else _caught(broadcast_from, "x", lambda: 1)
    )

    def src_fails() -> int:
        raise RuntimeError("no such file")

    out["bcast_raise"] = _caught(broadcast_from, "read", src_fails, rank=0)

    def src_exits() -> int:
        raise SystemExit(4)

    out["bcast_exit"] = _caught(broadcast_from, "leave", src_exits, rank=2)
    out["bcast_labels"] = _caught(broadcast_from, "cfg" if rank_ != 2 else "other", lambda: 1)
    out["still_works"] = all_reduce("end", lambda: rank_, max)
    return out


@pytest.mark.slow
def test_fault_propagating_collectives_at_4_ranks() -> None:
    start = time.monotonic()
    results = run_ranks(_collectives, 4, timeout=60)
    assert time.monotonic() - start < 30
    for r, res in enumerate(results):
        assert res["sum"] == 10
        assert res["order"] == ["r0", "r1", "r2", "r3"]
        assert res["bcast"] == {"from": 1}
        # one rank's fn raising: it raises its own, the others name it, all promptly
        if r == 1:
            assert res["raise"] == ("ValueError", "bad batch")
        else:
            assert res["raise"] == (
                "RuntimeError",
                "all_reduce('batch'): rank 1 failed: ValueError: bad batch",
            )
        assert res["raise_s"] < 5
        if r in (2, 3):
            assert res["two_fail"] == ("KeyError", f"'k{r}'")
        else:
            assert res["two_fail"] == (
                "RuntimeError",
                "all_reduce('two'): rank 2 failed: KeyError: 'k2'",
            )
        kind, msg = res["unpicklable"]
        assert kind == ("TypeError" if r == 3 else "RuntimeError")
        assert "rank 3" in msg and "does not pickle" in msg
        # SystemExit only: every rank exits, with its own code or the first one's
        assert res["exit"] == ("SystemExit", {1: 4, 2: 5}.get(r, 4))
        # a non-SystemExit error wins: its rank raises it, the others name it
        if r == 2:
            assert res["mixed"] == ("OSError", "disk")
        else:
            assert res["mixed"] == (
                "RuntimeError",
                "all_reduce('mixed'): rank 2 failed: OSError: disk",
            )
        kind, msg = res["labels"]
        assert (
            kind == "RuntimeError" and "'step-a'" in msg and "'step-b'" in msg and "rank 3" in msg
        )
        kind, msg = res["kinds"]
        assert (
            kind == "RuntimeError"
            and "all_reduce('x')" in msg
            and "broadcast_from('x', rank=0)" in msg
        )
        assert res["bcast_raise"] == (
            ("RuntimeError", "no such file")
            if r == 0
            else (
                "RuntimeError",
                "broadcast_from('read', rank=0): rank 0 failed: RuntimeError: no such file",
            )
        )
        assert res["bcast_exit"] == ("SystemExit", 4)
        kind, msg = res["bcast_labels"]
        assert kind == "RuntimeError" and "'cfg'" in msg and "'other'" in msg
        assert res["still_works"] == 3


def _groups(rank_: int, world: int) -> dict:
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    state = ParallelState(data_parallel_group=None, tensor_parallel_group=pair)
    dp, tp, ep = (
        state.data_parallel_group,
        state.tensor_parallel_group,
        state.expert_model_parallel_group,
    )
    synced = DistributedProcessGroup.get_dist_syncd_obj(rank_, [dp, ep], max)
    synced_tp = DistributedProcessGroup.get_dist_syncd_obj(rank_, tp, lambda vs: sum(vs))
    return {
        "dp": (dp.rank(), dp.world_size()),
        "tp": (tp.rank(), tp.world_size()),
        "ep": (ep.is_initialized(), ep.rank()),
        "synced": synced,
        "synced_tp": synced_tp,
        "master": is_master(),
        "rank_in_pair": rank(pair) if rank_ < 2 else None,
    }


@pytest.mark.slow
def test_parallel_state_groups_on_a_real_run() -> None:
    results = run_ranks(_groups, 3)
    for r, res in enumerate(results):
        assert res["dp"] == (r, 3)
        assert res["ep"] == (False, -1)
        assert res["synced"] == 2
        assert res["master"] == (r == 0)
        if r < 2:
            assert res["tp"] == (r, 2) and res["synced_tp"] == 1 and res["rank_in_pair"] == r
        else:  # not a member of the pair: unused there, the object passes through
            assert res["tp"] == (-1, -1) and res["synced_tp"] == r


# --------------------------------------------------------------------------- uniformity edge cases


class _Unprintable(Exception):
    """An exception whose str() raises: describing it must not strand the peers."""

    def __str__(self) -> str:
        raise RuntimeError("str() of this exception raises")


class _BadCode:
    def __str__(self) -> str:
        raise RuntimeError("str() of this exit code raises")


def _rebuild_fails() -> None:
    raise ValueError("cannot rebuild")


def _rebuild_fails_on_rank_2() -> int:
    import os

    if os.environ.get("RANK") == "2":
        raise ValueError("cannot rebuild here")
    return 1


class _NoLoad:
    """Pickles fine; unpickling calls a function that raises."""

    def __reduce__(self):
        return (_rebuild_fails, ())


class _NoLoadOnRank2:
    """Pickles fine; unpickling fails on rank 2 only."""

    def __reduce__(self):
        return (_rebuild_fails_on_rank_2, ())


def _kind(fn, *args, **kwargs) -> tuple[str, str]:
    """Like _caught, but never calls str() on an exception that may not allow it."""
    try:
        return ("ok", repr(fn(*args, **kwargs)))
    except SystemExit as e:
        return (
            "SystemExit",
            "code is str-able" if not isinstance(e.code, _BadCode) else "own code",
        )
    except _Unprintable:
        return ("_Unprintable", "own error")
    except BaseException as e:
        return (type(e).__name__, str(e))


def _edge_cases(rank_: int, world: int) -> dict:
    out: dict = {}
    start = time.monotonic()

    def unprintable() -> int:
        if rank_ == 1:
            raise _Unprintable()
        return rank_

    out["unprintable"] = _kind(all_reduce, "u", unprintable, sum)

    def unprintable_src() -> int:
        raise _Unprintable()

    out["unprintable_src"] = _kind(broadcast_from, "u", unprintable_src, rank=2)

    def bad_exit() -> int:
        if rank_ == 0:
            raise SystemExit(_BadCode())
        return 0

    out["bad_exit"] = _kind(all_reduce, "e", bad_exit, sum)
    out["no_load"] = _kind(
        all_reduce, "nl", lambda: _NoLoad() if rank_ == 1 else 0, lambda vs: len(vs)
    )
    out["no_load_on_2"] = _kind(
        all_reduce, "nl2", lambda: _NoLoadOnRank2() if rank_ == 0 else 0, len
    )
    out["bcast_no_load"] = _kind(broadcast_from, "bnl", lambda: _NoLoad(), rank=0)
    out["bcast_no_load_on_2"] = _kind(broadcast_from, "bnl2", lambda: _NoLoadOnRank2(), rank=1)
    out["bad_label"] = _kind(all_reduce, 5 if rank_ == 1 else "lbl", lambda: 1, sum)
    out["bad_src"] = _kind(broadcast_from, "src", lambda: 1, rank=9 if rank_ == 2 else 0)
    out["bad_src_type"] = _kind(broadcast_from, "src", lambda: 1, rank="0" if rank_ == 0 else 0)
    out["seconds"] = time.monotonic() - start
    out["still_works"] = all_reduce("end", lambda: rank_, max)
    return out


@pytest.mark.slow
def test_every_rank_raises_alike_on_unprintable_errors_unloadable_values_and_bad_arguments() -> (
    None
):
    results = run_ranks(_edge_cases, 3, timeout=45)
    for r, res in enumerate(results):
        assert res["seconds"] < 15
        # an exception whose str() raises: it still joins; peers name it
        if r == 1:
            assert res["unprintable"] == ("_Unprintable", "own error")
        else:
            kind, msg = res["unprintable"]
            assert (
                kind == "RuntimeError"
                and "rank 1 failed: _Unprintable: <unprintable _Unprintable" in msg
            )
        if r == 2:
            assert res["unprintable_src"] == ("_Unprintable", "own error")
        else:
            kind, msg = res["unprintable_src"]
            assert kind == "RuntimeError" and "rank 2 failed: _Unprintable" in msg
        assert res["bad_exit"][0] == "SystemExit"
        # a value that pickles but does not unpickle: every rank raises, its producer included
        for key, src, where in (
            ("no_load", 1, "all_reduce('nl')"),
            ("bcast_no_load", 0, "broadcast_from('bnl'"),
        ):
            kind, msg = res[key]
            assert kind == "RuntimeError", (r, key, res[key])
            assert where in msg and f"rank {src}'s value pickled but does not unpickle" in msg
            assert "ValueError: cannot rebuild" in msg
        # ... also when it fails on one peer only
        for key in ("no_load_on_2", "bcast_no_load_on_2"):
            kind, msg = res[key]
            assert (
                kind == "RuntimeError" and "(on rank 2)" in msg and "cannot rebuild here" in msg
            ), (r, key)
        # a bad argument on one rank: it raises its own, the peers a RuntimeError naming it
        kind, msg = res["bad_label"]
        if r == 1:
            assert (kind, msg) == ("TypeError", "all_reduce: label must be a str, got int")
        else:
            assert kind == "RuntimeError" and "rank 1 at all_reduce(<label of type int>)" in msg
        kind, msg = res["bad_src"]
        if r == 2:
            assert kind == "ValueError" and "rank=9 is outside the run; allowed 0..2" in msg
        else:
            assert kind == "RuntimeError" and "rank 2 at broadcast_from('src', rank=9)" in msg
        kind, msg = res["bad_src_type"]
        if r == 0:
            assert (kind, msg) == ("TypeError", "broadcast_from: rank must be an int, got 0")
        else:
            assert kind == "RuntimeError" and "broadcast_from('src', rank=<str>)" in msg
        assert res["still_works"] == 2


def _run_with_timeout(rank_: int, world: int, seconds: float) -> tuple[str, str, bool]:
    import torch.distributed as dist

    try:
        with distributed_run(timeout=timedelta(seconds=seconds), device="cpu"):
            return ("ok", "", dist.is_initialized())
    except ValueError as e:
        return ("ValueError", str(e), dist.is_initialized())


@pytest.mark.slow
@pytest.mark.parametrize("seconds", [0.0, -5.0, -0.000001])
def test_distributed_run_refuses_a_timeout_that_is_not_positive(seconds: float) -> None:
    # a launch of 2 whose second rank never comes: a refusal must come before any rendezvous
    [res] = run_ranks(
        _run_with_timeout, 1, seconds, init=False, env={"WORLD_SIZE": "2"}, timeout=20
    )
    kind, msg, group_up = res
    assert kind == "ValueError" and not group_up
    assert (
        msg.startswith("distributed_run: timeout=datetime.timedelta(")
        and "must be a positive" in msg
    )
