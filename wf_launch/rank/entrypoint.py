"""The one rank entrypoint every launcher uses.

A rank gets a :class:`RankSpec` (the resolved config, frozen once in the launcher,
and the run directory) and the usual RANK / WORLD_SIZE / LOCAL_RANK environment.
It never re-runs Hydra. Steps: logging -> ``dist_init`` -> task -> gather every
rank's return value to rank 0 (which writes ``result.json``) -> tear the groups
down. A failing rank records its exception in ``logs/rank{r}.error.json`` before
it leaves (:mod:`.failure`), so the launcher can name the root cause.

A task that starts its own process group (``task=script``, ``task=call``: code
written for torchrun) skips ``dist_init`` and gathers through exit records instead
(:func:`_run_own_group`); one that asks for a fresh interpreter runs in a child
interpreter of the rank process (:mod:`.fresh`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.env import LaunchEnv

from ..config.layout import layout_of, rank_label
from ..rundir import attempts, exits, files
from ..rundir.identity import RUN_ID_ENV, ensure_run_id
from ..rundir.record import RunRecord, Status
from . import fresh, script_api, stackdump
from .failure import current_attempt, is_peer_loss, is_timeout_error, record_failure
from .preempt import Preempted, PreemptHandler, requeue_after_stop, stop_on_sigterm
from .ranklog import FILE_ONLY, setup_rank_logging
from .task_context import build_context, build_own_group_context
from .task_registry import get_task, load_task_modules, task_owns_group

__all__ = ["Preempted", "RankSpec", "rank_main"]


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


@dataclass
class _Rank:
    """One rank's state while :func:`rank_main` runs it."""

    spec: RankSpec
    rank: int
    world_size: int
    coords: dict[str, int]
    log: Any
    keep_open: list[Any]
    timings: dict[str, float]
    preempt: PreemptHandler | None = None
    ctx: Any = None

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.run_dir)


def _set_threads(n: int) -> None:
    """Torch's threads for this rank; through ``OMP_NUM_THREADS`` when torch is not imported yet (a
    fresh interpreter running a script: torch reads it at import, and the script imports torch
    itself)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(max(1, n))
    else:
        os.environ["OMP_NUM_THREADS"] = str(max(1, n))


def _setup(spec: RankSpec) -> _Rank:
    """Logging, faulthandler, the stack-dump signal, torch threads and the preemption handler."""

    t_start = time.time()
    env = LaunchEnv.from_environ()
    run_dir = Path(spec.run_dir)
    coords = layout_of(spec.config).coords(env.rank)
    os.environ[RUN_ID_ENV] = ensure_run_id(
        run_dir
    )  # ctx.run_id; scripts and child processes inherit it
    console = spec.console_ranks is None or env.rank in spec.console_ranks
    log_path = files.rank_log(run_dir, env.rank)
    log = setup_rank_logging(
        log_path, env.rank, rank_label(env.rank, coords), console, max_log_mb=spec.max_log_mb
    )
    fault_file = open(log_path, "a")  # noqa: SIM115 - kept open for faulthandler until exit
    faulthandler.enable(file=fault_file)
    keep_open = [fault_file, stackdump.install(run_dir, env.rank)]
    _set_threads(spec.threads_per_rank)
    rank = _Rank(
        spec,
        env.rank,
        env.world_size,
        coords,
        log,
        keep_open,
        {"start_s": round(t_start - spec.launch_time, 4), "t_start": t_start},
    )
    if spec.preempt is not None:
        rank.preempt = PreemptHandler(spec.preempt, run_dir, env.rank, env.world_size, log)
    return rank


def _load_task(r: _Rank) -> tuple[Any, bool]:
    """The task function, and whether it starts its own process group
    (``register_task(own_group=True)``)."""

    task_cfg = r.spec.config["task"]
    load_task_modules(task_cfg.get("modules") or [], builtins=False)
    return get_task(task_cfg["name"]), task_owns_group(task_cfg["name"])


def _join(r: _Rank, task: Any) -> None:
    """Join the process groups (``dist_init``) and build the task's context."""
    # torch: launchers import this module for RankSpec; only a joining rank imports torch
    from worldfoundry.core.distributed import groups
    from worldfoundry.core.distributed.init import dist_init  # torch, as above

    r.log.debug(f"rank {r.rank} joining the process group (pid {os.getpid()})")
    files.rank_marker(r.run_dir, r.rank, "arrived").write_text(f"{current_attempt()}\n")
    device = dist_init({"engine_config": r.spec.config["engine"]})
    _joined(r)
    r.log.debug(f"dist_init done on {device} ({groups.get_layout().describe()})")
    r.ctx = build_context(r.spec.config, r.run_dir, device, r.log)
    _handle_signals(r, task)


def _joined(r: _Rank) -> None:
    """The rank is in (its groups are up, or it starts its own): the start-up watch and rank 0's
    attempt record."""
    r.timings["t_init"] = time.time()
    r.timings["init_s"] = round(r.timings["t_init"] - r.timings["t_start"], 4)
    files.rank_marker(r.run_dir, r.rank, "joined").write_text(f"{current_attempt()}\n")
    if r.rank == 0:
        attempts.update(r.run_dir, current_attempt(), started_at=r.timings["t_start"])


def _handle_signals(r: _Rank, task: Any) -> None:
    """Preemption (the launcher's policy) or SIGTERM reach the task through its context's stop
    flag."""

    script_api.bind(
        r.ctx
    )  # wf_launch.progress / should_stop / checkpoint / report_result work in any task
    if r.preempt is None:
        stop_on_sigterm(r.ctx)
        return
    preempt = r.preempt
    preempt.task, preempt.ctx = task, r.ctx
    warning = f"SIG{preempt.policy.signal}"
    if r.ctx.stop is not None:
        r.ctx.stop.preempt_signal = warning
    if warning != "SIGTERM":  # SIGTERM still stops the run for good (a Ctrl-C passed on)
        stop_on_sigterm(r.ctx, lambda: preempt.busy)


def _finish_task(r: _Rank, barrier: Any = None) -> None:
    """After the task returned: commit a pending save, agree on a stop (and requeue), record the
    attempt.

    ``barrier``: how the ranks wait for each other before a requeue (default: the world group).
    """
    ctx, spec = r.ctx, r.spec
    if ctx._checkpointer is not None:
        ctx._checkpointer.close()  # commits a pending asynchronous save
    if ctx.stop is not None:
        ctx.stop.drain()
        if ctx.stop.for_preemption and spec.preempt is not None and spec.preempt.allowed():
            _end_attempt(r, f"preempted: {spec.preempt.signal} (stop flag)")
            requeue_after_stop(spec.preempt, r.run_dir, ctx, r.rank, r.log, barrier)
    stopped = ctx.stop is not None and ctx.stop.agreed
    _end_attempt(
        r, f"stop flag: {ctx.stop.requested or 'another rank'}" if stopped else "completed"
    )
    _close_reporter(r, "interrupted" if stopped else "ok")


def _close_reporter(r: _Rank, status: str) -> None:
    """Flush ``metrics.jsonl`` and tell the trackers how this attempt ended ('ok', 'interrupted',
    'failed')."""
    if r.ctx is not None and r.ctx.reporter is not None:
        try:
            r.ctx.reporter.close(status)
        except Exception as exc:  # the record of the run matters more than its trackers
            r.log.warning(f"closing the progress reporter failed: {type(exc).__name__}: {exc}")


def rank_main(spec: RankSpec) -> dict[str, Any]:
    """Run one rank of the job described by ``spec``; returns the task's value.

    Raises whatever the rank failed with, after recording it.
    """
    in_child = fresh.run_fresh_if_asked(spec)
    if in_child is not None:
        return in_child
    r = _setup(spec)
    try:
        task, own_group = _load_task(r)
        if own_group:
            return _run_own_group(r, task)
        _join(r, task)
        r.timings["task_entry_s"] = round(time.time() - spec.launch_time, 4)
        value = _json_checked(spec.config["task"]["name"], task(r.ctx))
        r.timings["task_s"] = round(time.time() - r.timings["t_init"], 4)
        _finish_task(r)
        timings = {k: v for k, v in r.timings.items() if not k.startswith("t_")}
        gathered = _gather_to_rank0(
            {
                "rank": r.rank,
                "coords": r.coords,
                "result": value,
                "timings": timings,
                "host": socket.gethostname(),
            }
        )
        if gathered is not None and spec.write_result:
            _write_success(spec, gathered)
        # imports torch: not before a script does (fresh)
        from worldfoundry.core.distributed import groups

        groups.destroy_model_parallel()
        return value
    except Preempted:
        if r.ctx is not None and not (attempts.read(r.run_dir, current_attempt()) or {}).get(
            "ended_by"
        ):
            _end_attempt(r, f"preempted: {spec.preempt.signal}")
        _close_reporter(r, "interrupted")
        r.log.warning(f"rank {r.rank} leaves for the requeue")
        raise
    except BaseException as exc:
        _record(r, exc)
        raise
    finally:
        from loguru import logger

        logger.complete()


def _run_own_group(r: _Rank, task: Any) -> dict[str, Any]:
    """A task that starts its own process group, or none (``task=script``, ``task=call``).

    No ``dist_init`` and no groups in ``ctx``: the task tears down whatever group its code
    left. Every rank records how it ended in its exit record (:mod:`wf_launch.rundir.exits`);
    rank 0 waits for all of them and writes ``result.json`` from them, no collective needed.
    """

    files.rank_marker(r.run_dir, r.rank, "arrived").write_text(f"{current_attempt()}\n")
    _joined(r)
    r.ctx = build_own_group_context(r.spec.config, r.run_dir, r.log)
    _handle_signals(r, task)
    r.timings["task_entry_s"] = round(time.time() - r.spec.launch_time, 4)
    value = _json_checked(r.spec.config["task"]["name"], task(r.ctx))
    r.timings["task_s"] = round(time.time() - r.timings["t_init"], 4)
    timings = {k: v for k, v in r.timings.items() if not k.startswith("t_")}
    exits.write_exit(
        r.run_dir,
        r.rank,
        current_attempt(),
        exit_code=0,
        result=value,
        timings=timings,
        host=socket.gethostname(),
        coords=r.coords,
    )

    def every_rank() -> list[dict[str, Any]]:
        return exits.wait_for_exits(
            r.run_dir,
            r.world_size,
            current_attempt(),
            on_wait=lambda missing: r.log.info(
                f"rank 0 waits for ranks {missing} to end (the run's results are gathered when "
                "every rank is done)"
            ),
        )

    _finish_task(r, barrier=every_rank if r.rank == 0 else lambda: None)
    if r.rank == 0 and r.spec.write_result:
        _write_success(r.spec, every_rank())
    return value


def _record(r: _Rank, exc: BaseException) -> None:
    """A failing rank: end the attempt, ask for every rank's stacks on a timeout, record and log the
    failure.

    The rank log always gets the failure; the console gets it from the launcher, which shows
    ranks that failed alike once, from their records. When the record cannot be written (a full
    disk, a quota) the failure goes to the console from here, followed by the write's error, and
    the task's exception, not the write's, is what the rank fails with.
    """
    _end_attempt(r, None)
    if is_timeout_error(exc) and r.world_size > 1 and r.spec.on_timeout is not None:
        try:
            # e.g. SLURM: every rank of the job dumps its stacks, before srun ends them
            r.spec.on_timeout()
        except Exception as hook_exc:
            r.log.warning(f"stack dump request failed: {type(hook_exc).__name__}: {hook_exc}")
    try:
        record_failure(r.run_dir, r.rank, r.coords, exc)
        write_exc: OSError | None = None
    except OSError as err:
        write_exc = err
    log = r.log.bind(**{FILE_ONLY: True}) if write_exc is None else r.log
    if is_peer_loss(exc):
        log.warning(f"rank {r.rank} lost a peer: {type(exc).__name__}: {str(exc)[:200]}")
        log.opt(exception=exc).debug("traceback")
    elif (
        getattr(exc, "exit_code", None) is not None
    ):  # a script's sys.exit(n): where it was called is in the message
        log.error(f"rank {r.rank} failed: {type(exc).__name__}: {exc}")
        log.opt(exception=exc).debug("traceback")
    else:
        log.opt(exception=exc).error(f"rank {r.rank} failed: {type(exc).__name__}: {exc}")
    if write_exc is not None:
        r.log.error(
            f"rank {r.rank} could not write its failure record "
            f"{files.rank_error(r.run_dir, r.rank)} "
            f"({type(write_exc).__name__}: {write_exc}); its failure is the "
            f"{type(exc).__name__} above"
        )
    _close_reporter(r, "failed")


def _end_attempt(r: _Rank, ended_by: str | None) -> None:
    """Rank 0 records how far this attempt got and (when it knows) why it ended; the launcher fills
    the rest."""
    if r.rank != 0 or r.ctx is None:
        return
    step = r.ctx.reporter.step if r.ctx.reporter is not None else None
    fields: dict[str, Any] = {"ended_at": time.time(), "last_step": step}
    if ended_by is not None:
        fields["ended_by"] = ended_by
    try:
        attempts.update(r.run_dir, current_attempt(), **fields)
    except OSError:
        pass


def _json_checked(task: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(
            f"task {task!r} returned {type(value).__name__}; a task returns a JSON-able dict"
        )
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"task {task!r} returned a dict that is not JSON-able: {exc}") from exc
    return value


def _gather_to_rank0(payload: dict[str, Any]) -> list[dict[str, Any]] | None:
    import torch.distributed as dist

    # torch: launchers import this module for RankSpec; only a joined rank gathers
    from worldfoundry.core.distributed.groups import get_world_group

    world = get_world_group()
    if world.world_size == 1:
        return [payload]
    out: list[Any] | None = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(payload, out, dst=0, group=world.cpu_group)
    return out


def _write_success(spec: RankSpec, gathered: list[dict[str, Any]]) -> None:

    layout = layout_of(spec.config)
    RunRecord(
        status=Status.OK,
        run_dir=str(spec.run_dir),
        task=spec.config["task"]["name"],
        layout={**layout.sizes, "order": "-".join(layout.dims), "world_size": layout.world_size},
        results={str(g["rank"]): g["result"] for g in gathered},
        timings={"ranks": {str(g["rank"]): g["timings"] for g in gathered}},
        hosts=sorted({g["host"] for g in gathered}),
        finished_at=time.time(),
    ).write()
