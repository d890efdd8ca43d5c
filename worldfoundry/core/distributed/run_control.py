"""Run control: the run's process group for a block, and collectives that survive a failing rank.

``distributed_run`` owns the run's process group for a block; ``all_reduce`` and
``broadcast_from`` run the caller's ``fn`` inside the collective so that a rank whose
``fn`` fails still joins, and every rank then raises alike instead of one rank leaving
its peers waiting in a collective it never reaches.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from loguru import logger

from ..torch_private import abort_all_process_groups
from ..validation import is_int
from . import runtime as _rt
from .identity import (
    DistributedProcessGroup,
    ParallelState,
    backend,
    barrier,
    is_available,
    is_distributed_launch,
    is_distributed_run,
    is_initialized,
    is_master,
    rank,
    size,
)
from .init import LaunchEnv, env_int, start_default_group

__all__ = [
    "DistributedProcessGroup",
    "DistributedState",
    "ParallelState",
    "all_reduce",
    "backend",
    "barrier",
    "broadcast_from",
    "distributed_run",
    "is_available",
    "is_distributed_launch",
    "is_distributed_run",
    "is_initialized",
    "is_master",
    "rank",
    "size",
]

_V = TypeVar("_V")


# --------------------------------------------------------------------------- distributed_run


@dataclass(frozen=True)
class DistributedState:
    """This process's place in a run: its rank, the run's size, and the device it computes on.

    ``distributed_run()`` yields it, for a single process too (rank 0 of a run of one).
    """

    rank: int
    world_size: int
    device: torch.device | str

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the rank that writes the run's outputs."""
        return self.rank == 0


def _parse_device(device: torch.device | str) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"distributed_run: device must be a str or torch.device, got {type(device).__name__}"
        )
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"distributed_run: device={device!r} is not a device ({e})") from None


def _require_cuda(local_rank: int | None) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "distributed_run(device='cuda') needs CUDA, but torch.cuda.is_available() is False; "
            "pass device='cpu' to run on CPU (gloo on a distributed launch)"
        )
    count = torch.cuda.device_count()
    if local_rank is not None and not 0 <= local_rank < count:
        raise RuntimeError(
            f"distributed_run: LOCAL_RANK={local_rank} has no CUDA device (this node has {count}); "
            f"allowed LOCAL_RANK is 0..{count - 1}"
        )


def _launch_device(dev: torch.device) -> torch.device:
    """The device a launched rank binds: cuda:LOCAL_RANK for 'cuda', cpu for 'cpu'."""
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(
            f"distributed_run: device={str(dev)!r} is not supported on a distributed launch; "
            "allowed: 'cuda' (NCCL, binds cuda:LOCAL_RANK) or 'cpu' (gloo)"
        )
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError(
            "distributed_run: a distributed launch (WORLD_SIZE>1) with device='cuda' needs "
            "LOCAL_RANK in the environment to bind this rank's GPU"
        )
    local_rank = env_int("LOCAL_RANK", 0)
    if dev.index is not None and dev.index != local_rank:
        raise ValueError(
            f"distributed_run: device={str(dev)!r} differs from this rank's cuda:{local_rank} "
            "(LOCAL_RANK); pass device='cuda' to bind it"
        )
    _require_cuda(local_rank)
    return torch.device("cuda", local_rank)


def _abort_world() -> None:
    """Abort every process group without waiting on peers (falling back to plain teardown)."""
    try:
        if abort_all_process_groups():
            return
        world = dist.GroupMember.WORLD
        if world is not None and hasattr(world, "abort"):
            world.abort()
            return
        dist.destroy_process_group()
    except Exception as e:  # the body's error is what the caller must see
        logger.warning(
            "distributed_run: aborting the process group failed: {}: {}", type(e).__name__, e
        )


@contextmanager
def distributed_run(
    timeout: timedelta | None = None, device: torch.device | str = "cuda"
) -> Iterator[DistributedState]:
    """Own the run's process group for the block, and yield this process's state.

    On a distributed launch (WORLD_SIZE>1) it sets the process group up with ``timeout``
    (a positive ``timedelta``; zero or negative is a ValueError before anything is set up)
    unless the caller set one up already: ``device='cuda'`` binds ``cuda:LOCAL_RANK`` on
    NCCL, ``device='cpu'`` uses gloo. Without a launch it sets nothing up and the state is
    on ``device``. Rank and size are always the live group's (0 of 1 without one).

    On exit, even if the body raises, it destroys the group the run set up (or the body
    did); a group that was there at entry is the caller's and is left alone. A rank whose
    body raised in a run of several ranks aborts the group instead of destroying it, so it
    leaves without waiting on peers that may sit in a collective it never reaches; the
    exception then propagates.
    """
    _check_timeout(timeout)
    dev = _parse_device(device)
    pre_existing = is_initialized()
    if is_distributed_launch():
        dev = _launch_device(dev)
        # dist_init's start-up path: NCCL starts as cpu:gloo,cuda:nccl, cuda:LOCAL_RANK bound
        dev, _ = start_default_group(
            "nccl" if dev.type == "cuda" else "gloo", timeout, LaunchEnv.from_environ()
        )
    elif dev.type == "cuda":
        _require_cuda(dev.index)

    state = DistributedState(rank=rank(), world_size=size(), device=dev)
    try:
        yield state
    except BaseException:
        if not pre_existing and is_initialized():
            _release(failed=True)
        raise
    if not pre_existing and is_initialized():
        _release(failed=False)


def _check_timeout(timeout: Any) -> None:
    """TypeError or ValueError, before anything is set up, for a timeout that is not allowed."""
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"distributed_run: timeout must be a datetime.timedelta or None, got {timeout!r}"
        )
    if timeout is not None and timeout <= timedelta(0):
        raise ValueError(
            f"distributed_run: timeout={timeout!r} must be a positive datetime.timedelta "
            f"(got {timeout.total_seconds()} s)"
        )


def _release(failed: bool) -> None:
    """Give up the group the run set up, with whatever the body built on it.

    A failed rank of several aborts the group (its peers may sit in a collective it never
    reaches) and only forgets the runtime; otherwise the runtime closes its groups, then
    the default group is destroyed.
    """
    if failed and size() > 1:
        _abort_world()
        _rt.current().close(destroy=False)
        return
    _rt.current().close()  # groups the body built on this run's group go with it
    if is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------- fault-propagating collectives

_OK, _ERROR, _EXIT = "ok", "error", "exit"


def _safe_str(obj: Any) -> str:
    """``str(obj)``, or a stand-in when its ``__str__`` (and ``__repr__``) raise: never raises."""
    try:
        return str(obj)
    except BaseException:
        pass
    try:
        return f"<unprintable {type(obj).__name__}: {object.__repr__(obj)}>"
    except BaseException:
        return "<unprintable object>"


def _describe(exc: BaseException) -> str:
    """``'Type: message'`` for a header, whatever the exception's ``__str__`` does."""
    return f"{type(exc).__name__}: {_safe_str(exc)}"


class _Outcome:
    """What ``fn`` did on this rank: its pickled value, or the exception it raised."""

    def __init__(self) -> None:
        self.value: Any = None
        self.payload: bytes = b""
        self.exc: BaseException | None = None

    def header(self, where: str) -> tuple[str, str, Any]:
        """The small, always-picklable record every rank exchanges; building it never raises."""
        try:
            if self.exc is None:
                return (where, _OK, len(self.payload))
            if isinstance(self.exc, SystemExit):
                code = self.exc.code
                if code is None or isinstance(code, int):
                    return (
                        where,
                        _EXIT,
                        None if code is None else int(code),
                    )  # int(): a plain int pickles
                return (where, _EXIT, _safe_str(code))
            return (where, _ERROR, _describe(self.exc))
        except BaseException:
            return (where, _ERROR, "<the error could not be described>")


def _run_fn(fn: Callable[[], Any], where: str, me: int) -> _Outcome:
    out = _Outcome()
    try:
        out.value = fn()
    except BaseException as e:  # every rank must still join, SystemExit included
        out.exc = e
        return out
    try:
        out.payload = pickle.dumps(out.value, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as e:  # a __reduce__ may raise anything: still join
        err = TypeError(
            f"{where} on rank {me}: fn returned a {type(out.value).__name__} that does not pickle: "
            f"{_describe(e)}"
        )
        err.__cause__ = e
        out.exc = err
    return out


def _arg_error(exc: BaseException) -> _Outcome:
    """An outcome for a rank whose own arguments are wrong: it still joins, then raises ``exc``."""
    out = _Outcome()
    out.exc = exc
    return out


def _unpickle(where: str, src: int, me: int, payload: bytes) -> Any:
    try:
        return pickle.loads(payload)
    except BaseException as e:  # whatever a __reduce__ callable raises
        err = RuntimeError(
            f"{where}: rank {src}'s value pickled but does not unpickle "
            f"(on rank {me}): {_describe(e)}"
        )
        raise err from e


def _agree_on_unpickling(me: int, world: int, mine: BaseException | None) -> None:
    """A second, tiny exchange: if unpickling failed on any rank, every rank raises alike.

    A value can pickle on its rank and still fail to load on a peer (a ``__reduce__``
    that raises, a class only one rank can import); without this the producing rank
    would return while its peers raise, and the run would split at the next collective.
    Every rank raises the first failing rank's ``RuntimeError`` message.
    """
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, None if mine is None else _safe_str(mine))
    failed = [info for info in reports if info is not None]
    if not failed:
        return
    if mine is not None and _safe_str(mine) == failed[0]:
        raise mine
    raise RuntimeError(failed[0])


def _check_group_ready(where: str) -> bool:
    """True when a collective is needed; raise on a launch whose group is not up yet."""
    if is_initialized():
        return size() > 1
    if is_distributed_launch():
        raise RuntimeError(
            f"{where}: this is rank {os.environ.get('RANK', '?')} of a distributed launch "
            f"(WORLD_SIZE={os.environ.get('WORLD_SIZE')}) but the process group is not set up; "
            "call it inside distributed_run()"
        )
    return False


def _raise_uniformly(
    where: str, headers: list[tuple[str, str, Any]], out: _Outcome, me: int
) -> None:
    """Raise the same way on every rank when ranks disagree on the point or any fn failed."""
    first_where = headers[0][0]
    for r, (w, _, _) in enumerate(headers):
        if w != first_where:
            err = RuntimeError(
                f"ranks reached different collectives at the same point: rank 0 at {first_where}, "
                f"rank {r} at {w} (this is rank {me}, at {where})"
            )
            if isinstance(out.exc, (TypeError, ValueError)) and getattr(
                out.exc, "_wf_bad_argument", False
            ):
                raise out.exc from err
            raise err from out.exc
    failures = [(r, status, info) for r, (_, status, info) in enumerate(headers) if status != _OK]
    if not failures:
        return
    errors = [f for f in failures if f[1] == _ERROR]
    if errors:
        if out.exc is not None and not isinstance(out.exc, SystemExit):
            raise out.exc
        r, _, info = errors[0]
        raise RuntimeError(f"{where}: rank {r} failed: {info}")
    if out.exc is not None:
        raise out.exc
    raise SystemExit(failures[0][2])


def _bad_argument(exc: BaseException) -> BaseException:
    exc._wf_bad_argument = True  # type: ignore[attr-defined]
    return exc


def _label(label: Any) -> str:
    """The label as shown in messages (``str.__repr__``, so a str subclass cannot raise here)."""
    if isinstance(label, str):
        return str.__repr__(label)
    return f"<label of type {type(label).__name__}>"


def all_reduce(label: str, fn: Callable[[], _V], combine: Callable[[list[_V]], _V]) -> _V:
    """Return ``combine`` of every rank's ``fn()``, on every rank.

    ``combine`` gets the ranks' values in rank order. If ``fn`` raises on any rank, or
    returns a value that does not pickle, every rank raises alike instead of waiting: a
    rank with a non-SystemExit error raises its own and the others a RuntimeError naming
    the first such rank; if every error is a SystemExit, every rank exits (its own, or
    the first one's code). Ranks at different labels fail, naming both. Collective; in a
    single process ``fn`` runs alone; a rank of a launch whose group is not up raises.
    """
    bad = None
    if not isinstance(label, str):
        bad = _bad_argument(
            TypeError(f"all_reduce: label must be a str, got {type(label).__name__}")
        )
    where = f"all_reduce({_label(label)})"
    if not _check_group_ready(where):
        if bad is not None:
            raise bad
        return combine([fn()])
    me, world = rank(), size()
    out = _run_fn(fn, where, me) if bad is None else _arg_error(bad)
    headers: list[Any] = [None] * world
    dist.all_gather_object(headers, out.header(where))
    _raise_uniformly(where, headers, out, me)
    payloads: list[Any] = [None] * world
    dist.all_gather_object(payloads, out.payload)
    values: list[Any] = []
    failure: BaseException | None = None
    for r, p in enumerate(payloads):
        if r == me:
            values.append(out.value)
            continue
        try:
            values.append(_unpickle(where, r, me, p))
        except RuntimeError as e:
            failure = failure or e
    _agree_on_unpickling(me, world, failure)
    return combine(values)


def broadcast_from(label: str, fn: Callable[[], _V], rank: int = 0) -> _V:
    """Return ``fn()`` run on ``rank`` only, on every rank.

    For a value each rank could compute differently (environment, its GPU, files on its
    node). If ``fn`` raises or returns a value that does not pickle, every rank raises:
    ``rank`` its own error, the others a SystemExit with its code if that is what it was,
    else a RuntimeError. Ranks at different labels (or naming different source ranks) all
    fail. Collective; in a single process ``fn`` runs alone; a rank of a launch whose
    group is not set up yet raises.
    """
    bad = None
    if not isinstance(label, str):
        bad = _bad_argument(
            TypeError(f"broadcast_from: label must be a str, got {type(label).__name__}")
        )
    elif not is_int(rank):
        bad = _bad_argument(
            TypeError(f"broadcast_from: rank must be an int, got {_safe_str(rank)}")
        )
    shown_rank = rank if is_int(rank) else f"<{type(rank).__name__}>"
    where = f"broadcast_from({_label(label)}, rank={shown_rank})"
    collective = _check_group_ready(where)
    world = size()
    me = dist.get_rank() if collective else 0
    if bad is None and not 0 <= rank < world:
        bad = _bad_argument(
            ValueError(
                f"broadcast_from: rank={rank} is outside the run; allowed 0..{world - 1} "
                f"(this is rank {me})"
            )
        )
    if not collective:
        if bad is not None:
            raise bad
        return fn()
    if bad is not None:
        out = _arg_error(bad)
    elif me == rank:
        out = _run_fn(fn, where, me)
    else:
        out = _Outcome()
    headers: list[Any] = [None] * world
    dist.all_gather_object(headers, out.header(where))
    _raise_uniformly(where, headers, out, me)
    box = [out.payload if me == rank else None]
    dist.broadcast_object_list(box, src=rank)
    value, failure = out.value, None
    if me != rank:
        try:
            value = _unpickle(where, rank, me, box[0])
        except RuntimeError as e:
            failure = e
    _agree_on_unpickling(me, world, failure)
    return value
