"""The one rank entrypoint every launcher uses.

A rank gets a :class:`RankSpec` (the resolved config, frozen once in the launcher,
and the run directory) and the usual RANK / WORLD_SIZE / LOCAL_RANK environment.
It never re-runs Hydra. Steps: logging -> ``dist_init`` -> task -> gather every
rank's return value to rank 0 (which writes ``result.json``) -> tear the groups
down. A failing rank records its exception in ``logs/rank{r}.error.json`` before
it leaves, so the launcher can name the root cause.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.env import ATTEMPT_ENV, launch_attempt
from worldfoundry.core.distributed.topology import Layout

from . import attempts, rundir, stacks
from .ranklog import rank_label, setup_rank_logging

__all__ = ["ATTEMPT_VAR", "Preempted", "RankSpec", "joined_marker", "layout_of", "preempt_marker", "rank_main",
           "record_failure"]

ATTEMPT_VAR = ATTEMPT_ENV
"""Which try of the run this rank belongs to (0, 1, ...): every launcher sets it, the runtime reads it."""


@dataclass(frozen=True)
class RankSpec:
    """What the launcher hands every rank: plain, picklable data."""

    config: dict[str, Any]
    run_dir: str
    threads_per_rank: int = 1
    console_ranks: list[int] | None = None
    launch_time: float = field(default_factory=time.time)
    write_result: bool = True
    preempt: Any = None
    max_log_mb: float = 0
    on_timeout: Any = None
    attempt_base: int = 0


class Preempted(BaseException):
    """This rank stops because the job goes back to the queue (not a failure)."""


class _PreemptState:
    """What the preemption signal handler needs once the task has started."""

    task: Any = None
    ctx: Any = None
    busy: bool = False


def preempt_marker(run_dir: Path | str, rank: int) -> Path:
    """Where a rank records that it handled the preemption signal (and its hook's outcome)."""
    return Path(run_dir) / rundir.LOGS / f"rank{rank}.preempt.json"


def _install_preempt_handler(spec: RankSpec, rank: int, world_size: int, log: Any) -> _PreemptState:
    """On ``spec.preempt.signal`` run the task's ``on_preempt(ctx)`` hook on this rank, record it,
    and, if ``spec.preempt.allowed()``, let rank 0 requeue (``spec.preempt.requeue()``) once every
    rank has recorded its hook (or ``spec.preempt.wait_s`` passed); then every rank raises
    :class:`Preempted`. With no requeue left the task goes on until the time limit ends it.

    ``spec.preempt`` is any picklable object with ``signal`` (e.g. 'USR2'), ``wait_s``,
    ``restart()`` (this run's restart count), ``allowed()`` and ``requeue()``.
    """
    policy = spec.preempt
    state = _PreemptState()

    def handler(signum: int, frame: Any) -> None:
        stop = getattr(state.ctx, "stop", None)
        if stop is not None and stop.polled:
            # The task polls ctx.should_stop(): the signal only sets the flag; the task saves at its
            # next step boundary and returns, and the entrypoint requeues afterwards.
            stop.request(signal.Signals(signum).name)
            return
        if state.busy:
            return
        state.busy = True
        restart = policy.restart()
        hook = getattr(state.task, "on_preempt", None)
        outcome = "no hook" if hook is None else "not started"
        log.warning(f"rank {rank}: {signal.Signals(signum).name} (preemption / time limit)")
        if hook is not None and state.ctx is not None:
            try:
                hook(state.ctx)
                outcome = "ok"
            except Exception as exc:
                outcome = f"error: {type(exc).__name__}: {exc}"
                log.opt(exception=exc).error(f"on_preempt hook failed: {exc}")
        requeue = policy.allowed()
        rundir.atomic_write_json(preempt_marker(spec.run_dir, rank), {
            "rank": rank, "restart": restart, "hook": outcome, "requeue": requeue, "time": time.time(),
            "host": socket.gethostname(), "pid": os.getpid()})
        if not requeue:
            log.warning("no requeue left: the task goes on until the time limit")
            state.busy = False
            return
        if rank == 0:
            deadline = time.monotonic() + policy.wait_s
            while time.monotonic() < deadline:
                done = [(rundir.read_json(preempt_marker(spec.run_dir, r)) or {}).get("restart")
                        for r in range(world_size)]
                if all(d == restart for d in done):
                    break
                time.sleep(0.1)
            log.warning("requeueing the job")
            policy.requeue()
        raise Preempted(f"rank {rank}: job requeued after restart {restart}")

    signal.signal(getattr(signal, f"SIG{policy.signal}"), handler)
    return state


def _stop_on_sigterm(ctx: Any) -> None:
    """SIGTERM to a local rank: a stop request once the task polls ``ctx.should_stop()``, else the default."""

    def handler(signum: int, frame: Any) -> None:
        if ctx.stop is not None and ctx.stop.polled:
            ctx.stop.request("SIGTERM")
            return
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)


def _requeue_after_stop(spec: RankSpec, ctx: Any, rank: int, world_size: int, log: Any) -> None:
    """Every rank agreed to stop (the task saved and returned): rank 0 requeues the job, all leave quietly."""
    restart = spec.preempt.restart()
    rundir.atomic_write_json(preempt_marker(spec.run_dir, rank), {
        "rank": rank, "restart": restart, "hook": "stop flag", "requeue": True, "time": time.time(),
        "signal_at": ctx.stop.requested_at, "host": socket.gethostname(), "pid": os.getpid()})
    ctx.groups["world"].barrier()
    if rank == 0:
        log.warning("every rank stopped at the same step: requeueing the job")
        spec.preempt.requeue()
    raise Preempted(f"rank {rank}: job requeued after restart {restart} (stop flag)")


def layout_of(config: dict[str, Any]) -> Layout:
    """The layout a resolved config describes (world size = product of the sizes)."""
    return Layout.from_engine(config["engine"])


_GLOO_TIMEOUT = re.compile(r"^\[[^\]]*gloo[^\]]*\] Timed out|^Application timeout caused pair closure")
_TIMEOUT_WORDS = re.compile(r"timed out|timeout|deadline exceeded", re.IGNORECASE)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def is_timeout_error(exc: BaseException) -> bool:
    """Whether ``exc`` is (or was caused by) a collective or store that gave up waiting.

    Recognised by type and origin, never by a word alone: torch's
    ``DistStoreError`` / ``DistBackendError`` with timeout wording (store waits,
    NCCL's watchdog), and gloo's own ``RuntimeError`` whose message comes from gloo's
    transport (``[.../gloo/...] Timed out waiting ...``). A user's
    ``ValueError("bad timeout")`` is not a timeout.
    """
    import torch.distributed as dist

    for e in _chain(exc):
        if isinstance(e, (dist.DistStoreError, dist.DistBackendError)) and _TIMEOUT_WORDS.search(str(e)):
            return True
        if type(e) is RuntimeError and _GLOO_TIMEOUT.search(str(e)):
            return True
    return False


def is_peer_loss(exc: BaseException) -> bool:
    """Whether ``exc`` only says another rank went away (a consequence, not a cause)."""
    from .report import PEER_LOSS

    return bool(PEER_LOSS.search(str(exc)))


def joined_marker(run_dir: Path | str, rank: int, phase: str = "joined") -> Path:
    """Where a rank records (with its attempt) that it ``arrived`` at ``dist_init``, or ``joined`` the groups."""
    return Path(run_dir) / rundir.LOGS / f"rank{rank}.{phase}"


def _attempt() -> int:
    """Which try of the run this is (:data:`ATTEMPT_VAR`, set by the launcher; 0 when unset)."""
    try:
        return launch_attempt()
    except ValueError:
        return 0


def record_failure(run_dir: Path, rank: int, coords: dict[str, int], exc: BaseException) -> dict[str, Any]:
    """Write this rank's failure record (atomically) and return it."""
    kind = "timeout" if is_timeout_error(exc) else (
        "interrupt" if isinstance(exc, KeyboardInterrupt) else "exception")
    record = {
        "rank": rank,
        "coords": coords,
        "kind": kind,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "time": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "log": str(rundir.rank_log(run_dir, rank)),
        "attempt": _attempt(),
    }
    rundir.atomic_write_json(rundir.rank_error(run_dir, rank), record)
    return record


def _json_checked(task: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"task {task!r} returned {type(value).__name__}; a task returns a JSON-able dict")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"task {task!r} returned a dict that is not JSON-able: {exc}") from exc
    return value


def _gather_to_rank0(payload: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch.distributed as dist

    from worldfoundry.core.distributed.groups import get_world_group

    world = get_world_group()
    if world.world_size == 1:
        return [payload]
    out: list[Any] | None = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(payload, out, dst=0, group=world.cpu_group)
    return out


def rank_main(spec: RankSpec) -> dict[str, Any]:
    """Run one rank of the job described by ``spec``; returns the task's value.

    Raises whatever the rank failed with, after recording it.
    """
    import torch

    from worldfoundry.core.distributed import groups
    from worldfoundry.core.distributed.init import LaunchEnv, dist_init

    from .tasks.context import build_context
    from .tasks.registry import get_task, load_task_modules

    t_start = time.time()
    run_dir = Path(spec.run_dir)
    env = LaunchEnv.from_environ()
    coords = layout_of(spec.config).coords(env.rank)
    console = spec.console_ranks is None or env.rank in spec.console_ranks
    log_path = rundir.rank_log(run_dir, env.rank)
    log = setup_rank_logging(log_path, env.rank, rank_label(env.rank, coords), console,
                             max_log_mb=spec.max_log_mb)
    fault_file = open(log_path, "a")  # noqa: SIM115 - kept open for faulthandler until exit
    faulthandler.enable(file=fault_file)
    stacks_out = stacks.install(run_dir, env.rank)  # noqa: F841 - kept open for faulthandler until exit
    torch.set_num_threads(max(1, spec.threads_per_rank))
    task_cfg = spec.config["task"]
    timings: dict[str, float] = {"start_s": round(t_start - spec.launch_time, 4)}
    preempt = None if spec.preempt is None else _install_preempt_handler(spec, env.rank, env.world_size, log)
    ctx = None
    try:
        load_task_modules(task_cfg.get("modules") or [], builtins=False)
        task = get_task(task_cfg["name"])
        log.debug(f"rank {env.rank} joining the process group (pid {os.getpid()})")
        joined_marker(run_dir, env.rank, "arrived").write_text(f"{_attempt()}\n")
        device = dist_init({"engine_config": spec.config["engine"]})
        t_init = time.time()
        timings["init_s"] = round(t_init - t_start, 4)
        joined_marker(run_dir, env.rank).write_text(f"{_attempt()}\n")
        if env.rank == 0:
            attempts.update(run_dir, _attempt(), started_at=t_start)
        log.debug(f"dist_init done on {device} ({groups.get_layout().describe()})")
        ctx = build_context(spec.config, run_dir, device, log)
        if preempt is not None:
            preempt.task, preempt.ctx = task, ctx
        else:
            _stop_on_sigterm(ctx)
        timings["task_entry_s"] = round(time.time() - spec.launch_time, 4)
        value = _json_checked(task_cfg["name"], task(ctx))
        timings["task_s"] = round(time.time() - t_init, 4)
        if ctx._checkpointer is not None:
            ctx._checkpointer.close()  # commits a pending asynchronous save
        if ctx.stop is not None:
            ctx.stop.drain()
            if ctx.stop.agreed and spec.preempt is not None and spec.preempt.allowed():
                _end_attempt(run_dir, env.rank, ctx, f"preempted: {spec.preempt.signal} (stop flag)")
                _requeue_after_stop(spec, ctx, env.rank, env.world_size, log)
        stopped = ctx.stop is not None and ctx.stop.agreed
        _end_attempt(run_dir, env.rank, ctx, f"stop flag: {ctx.stop.requested or 'another rank'}"
                     if stopped else "completed")
        if ctx.reporter is not None:
            ctx.reporter.close()
        gathered = _gather_to_rank0({"rank": env.rank, "coords": coords, "result": value,
                                     "timings": timings, "host": socket.gethostname()})
        if gathered is not None and spec.write_result:
            _write_success(spec, gathered)
        groups.destroy_model_parallel()
        return value
    except Preempted:
        if ctx is not None and not (attempts.read(run_dir, _attempt()) or {}).get("ended_by"):
            _end_attempt(run_dir, env.rank, ctx, f"preempted: {spec.preempt.signal}")
        log.warning(f"rank {env.rank} leaves for the requeue")
        raise
    except BaseException as exc:
        _end_attempt(run_dir, env.rank, ctx, None)
        timed_out = is_timeout_error(exc) and env.world_size > 1
        if timed_out and spec.on_timeout is not None:
            try:
                spec.on_timeout()  # e.g. SLURM: every rank of the job dumps its stacks, before srun ends them
            except Exception as hook_exc:
                log.warning(f"stack dump request failed: {type(hook_exc).__name__}: {hook_exc}")
        record_failure(run_dir, env.rank, coords, exc)
        if is_peer_loss(exc):
            log.warning(f"rank {env.rank} lost a peer: {type(exc).__name__}: {str(exc)[:200]}")
            log.opt(exception=exc).debug("traceback")
        else:
            log.opt(exception=exc).error(f"rank {env.rank} failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        from loguru import logger

        logger.complete()


def _end_attempt(run_dir: Path, rank: int, ctx: Any, ended_by: str | None) -> None:
    """Rank 0 records how far this attempt got and (when it knows) why it ended; the launcher fills the rest."""
    if rank != 0 or ctx is None:
        return
    step = ctx.reporter.step if ctx.reporter is not None else None
    fields: dict[str, Any] = {"ended_at": time.time(), "last_step": step}
    if ended_by is not None:
        fields["ended_by"] = ended_by
    try:
        attempts.update(run_dir, _attempt(), **fields)
    except OSError:
        pass


def _write_success(spec: RankSpec, gathered: list[dict[str, Any]]) -> None:
    from .record import RunRecord, Status

    layout = layout_of(spec.config)
    RunRecord(
        status=Status.OK, run_dir=str(spec.run_dir), task=spec.config["task"]["name"],
        layout={**layout.sizes, "order": "-".join(layout.dims), "world_size": layout.world_size},
        results={str(g["rank"]): g["result"] for g in gathered},
        timings={"ranks": {str(g["rank"]): g["timings"] for g in gathered}},
        hosts=sorted({g["host"] for g in gathered}), finished_at=time.time(),
    ).write()
