"""Local ranks on torch's elastic agent (see :mod:`.elastic`), one process per rank.

Rendezvous is c10d on ``127.0.0.1:0`` (the OS picks a free port, so concurrent
launches never collide) unless ``launcher.rdzv_port`` names one. ``start_method:
auto`` forks from this process, which has imported torch but never run a torch op
or touched CUDA; it falls back to spawn where fork is unsafe. By the time the
agent forks, it runs threads of its own (the rendezvous stores' servers), so a
forked rank waits at a :class:`~.elastic.ForkGate` until every rank is forked.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from loguru import logger

from .. import rundir
from ..entrypoint import RankSpec, rank_main
from ..outcome import EXIT_FAILED, EXIT_OK, RunOutcome, finalize_result, success_summary
from ..plan import LaunchPlan
from ..report import explain_failure

if TYPE_CHECKING:
    from .elastic import ForkGate

_PR_SET_PDEATHSIG = 1


def choose_start_method(requested: str) -> str:
    """``auto`` -> fork when safe (Linux, CUDA untouched, one thread), else spawn."""
    if requested != "auto":
        return requested
    import torch

    if not sys.platform.startswith("linux"):
        return "spawn"
    if torch.cuda.is_initialized() or threading.active_count() > 1:
        return "spawn"
    return "fork"


def threads_per_rank(requested: int, nproc: int) -> int:
    """Torch threads for each rank: ``requested``, or the cores shared out (at least 1)."""
    if requested > 0:
        return requested
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def describe(plan: LaunchPlan) -> str:
    """The launch plan as text (for ``launcher.dry_run``)."""
    lc = plan.config["launcher"]
    nproc = plan.world_size
    port = lc["rdzv_port"] or "a free port (0)"
    return "\n".join([
        f"launcher      local (torch elastic agent), {nproc} rank process(es) on this host",
        f"layout        {plan.layout.describe()}",
        f"task          {plan.task}",
        f"rendezvous    c10d at 127.0.0.1:{port}",
        f"start method  {choose_start_method(lc['start_method'])} (requested {lc['start_method']})",
        f"threads/rank  {threads_per_rank(lc['threads_per_rank'], nproc)}",
        f"max restarts  {lc['max_restarts']}",
        f"run dir       {plan.run_dir}",
        f"rank logs     {plan.run_dir / rundir.LOGS}/rank{{0..{nproc - 1}}}.log",
    ])


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the launcher dies, so no rank outlives it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def local_rank_entry(spec: RankSpec, launcher_pid: int, gate: ForkGate | None = None) -> dict[str, Any]:
    """What each local rank process runs: signal set-up, then the shared entrypoint."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if gate is not None:
        gate.wait()  # before any libc call that may take a lock a launcher thread held at fork
    _die_with_parent()
    if os.getppid() != launcher_pid:
        os._exit(1)
    try:
        return rank_main(spec)
    except BaseException:
        sys.__stdout__.flush()
        sys.__stderr__.flush()
        os._exit(1)


class _ToLoguru(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logger.opt(depth=6).log("DEBUG", f"[{record.name}] {record.getMessage()}")


def _route_elastic_logs() -> None:
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.handlers[:] = [_ToLoguru()]
    elastic.setLevel(logging.INFO)
    elastic.propagate = False


def launch(plan: LaunchPlan) -> RunOutcome:
    """Start every rank, wait for them, and record the outcome in the run directory."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.launcher.api import LaunchConfig

    from .elastic import ForkGate, RanksFailed, run_agent

    lc = plan.config["launcher"]
    nproc = plan.world_size
    method = choose_start_method(lc["start_method"])
    threads = threads_per_rank(lc["threads_per_rank"], nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    _route_elastic_logs()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"wf-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{lc['rdzv_port']}",
        rdzv_configs={"timeout": 120}, max_restarts=lc["max_restarts"],
        monitor_interval=lc["monitor_interval_s"], start_method=method,
        logs_specs=DefaultLogsSpecs(log_dir=str(plan.run_dir / ".elastic")),
        local_addr="127.0.0.1", shutdown_timeout=lc["shutdown_timeout_s"],
    )
    spec = RankSpec(config=plan.config, run_dir=str(plan.run_dir), threads_per_rank=threads,
                    console_ranks=lc.get("console_ranks"), launch_time=time.time())
    logger.info(f"launching {nproc} rank(s): {plan.layout.describe()}, task={plan.task}, "
                f"start method {method}, run dir {plan.run_dir}")
    info = {"launcher": "local", "task": plan.task, "overrides": plan.overrides,
            "run_dir": str(plan.run_dir), "environment": rundir.environment_info()}
    t0 = time.time()
    try:
        gate = ForkGate()
        run_agent(config, local_rank_entry, spec, os.getpid(), gate, gate=gate)
    except RanksFailed as exc:
        return _failed(plan, info, exc.exit_codes, time.time() - t0)
    except (SignalException, KeyboardInterrupt) as exc:
        signum = getattr(exc, "sigval", signal.SIGINT)
        name = signal.Signals(signum).name
        summary = f"interrupted by {name}: every rank was stopped"
        logger.debug(summary)
        code = 128 + int(signum)
        finalize_result(plan.run_dir, info, "interrupted", code,
                        {"failure": {"cause": "interrupt", "signal": name, "message": summary},
                         "timings": {"wall_s": round(time.time() - t0, 4)}})
        return RunOutcome("interrupted", code, plan.run_dir, summary)
    wall = time.time() - t0
    result = finalize_result(plan.run_dir, info, "ok", EXIT_OK, {"timings": {"wall_s": round(wall, 4)}})
    summary = success_summary(result)
    logger.info(f"run ok in {wall:.2f}s: {plan.run_dir / rundir.RESULT}")
    return RunOutcome("ok", EXIT_OK, plan.run_dir, summary, result)


def _failed(plan: LaunchPlan, info: dict[str, Any], exits: dict[int, int], wall: float) -> RunOutcome:
    explained = explain_failure(plan.run_dir, exits, plan.label, plan.layout.coords)
    if explained is None:
        cause = {"rank": -1, "cause": "unknown", "type": "Unknown", "message": "no rank reported a failure"}
        summary = "run failed, but no rank left a failure record"
    else:
        cause, summary = explained
    logger.debug(f"run failed: {summary}")
    finalize_result(plan.run_dir, info, "failed", EXIT_FAILED,
                    {"failure": cause, "exits": {str(k): v for k, v in exits.items()},
                     "timings": {"wall_s": round(wall, 4)}})
    return RunOutcome("failed", EXIT_FAILED, plan.run_dir, summary)
