"""``ft=torchft`` on SLURM: one allocation, one job step per replica group.

The job (submitit, one task on each node of ``launcher.nodes``) runs a supervisor in its first
task; the other tasks only hold their nodes. The supervisor starts torchft's Lighthouse on its
node's address, then one job step per replica group (``srun --overlap --relative=K % nodes``:
group K on the allocation's node K modulo the nodes) that runs the local launcher's replica group
(:func:`..local.replicas.replica_main`: torch's elastic agent for the engine layout, in
``RUN_DIR/replicas/K``, restarting its ranks on a failure, ``ft.max_replica_restarts`` times).
A step that ends without its group's final record (its node was lost, the step was killed) is
started again in place, while the group has restarts left; a step that cannot start (its node is
gone) leaves the others running degraded. The hang watch kills a hung group's ranks (on this
host by pid, elsewhere its step with ``scancel``). SIGTERM or the preemption signal to the job
reaches the supervisor, which passes SIGTERM to every step (the ranks save at their next step):
after SIGTERM the run ends ``interrupted``; after the preemption signal the supervisor requeues
the job while ``launcher.max_requeues`` allows, and the requeued job's groups resume from their
checkpoints, as a run without ft does. The supervisor writes ``result.json`` with its ``ft``
section.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from ...config.ft import FtConfig
from ...config.layout import run_layout
from ...rank.ft import FT_HOST_ENV, append_event
from ...rank.hardexit import flush_and_exit
from ...rundir import files
from ...rundir.io import atomic_write_json, read_json
from ...rundir.record import RecordError, RunRecord
from ..ft_hang import HangWatch, kill_here
from ..ft_lighthouse import Lighthouse, LighthouseFailed
from ..ft_record import last_step
from ..ft_replicas import lighthouse_failed, prepare_replica_dir, record_replicas, start_lighthouse
from ..launch_plan import LaunchPlan
from ..local.launcher import launch as local_launch
from ..local.replicas import replica_main
from .rank_entry import SlurmRequeue

__all__ = ["SlurmFtSupervisor", "node_address", "replica_launch_config", "step_main"]

POLL_S = 0.2
STEP_FILE = "slurm_step.json"
"""In a replica group's directory: the job step that runs it now (for a tear-down by scancel)."""
STEP_PLAN = "ft_step_plan.json"
"""In a replica group's directory: the config its step runs (the local launcher's)."""


def node_address(node: str | None = None) -> str:
    """This node's address in the cluster (SLURM's ``NodeAddr``; else its host name's)."""
    node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        out = subprocess.run(
            ["scontrol", "-o", "show", "node", node], capture_output=True, text=True, timeout=10
        ).stdout
        found = re.search(r"\bNodeAddr=(\S+)", out)
        if found:
            return socket.gethostbyname(found.group(1))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return socket.gethostbyname(socket.gethostname())


def replica_launch_config(plan: LaunchPlan, ft: FtConfig) -> dict[str, Any]:
    """The ``launcher`` section a replica group's step runs with: the local launcher (torch's
    elastic agent on the step's node), its ranks restarted ``ft.max_replica_restarts`` times."""
    lc = plan.launcher_config
    return {
        "name": "local",
        "max_restarts": ft.max_replica_restarts,
        "threads_per_rank": int(lc.cpus_per_task),
        "console_ranks": lc.console_ranks,
        "max_log_mb": lc.max_log_mb,
        "oversubscribe": True,  # the allocation decides what fits, not this host's cores
    }


@dataclass(frozen=True)
class SlurmFtSupervisor:
    """What the ft job's tasks run (submitit pickles it): the supervisor in the first task."""

    plan: LaunchPlan

    def __call__(self) -> int:
        if int(os.environ.get("SLURM_PROCID", "0")) != 0:
            return 0  # a node held for the replica groups' steps
        return _Supervisor(self.plan).run()


class _Supervisor:
    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.ft = FtConfig.from_dict(plan.config["ft"])
        self.nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1") or 1)
        self.stopping: str | None = None
        self.lock = threading.Lock()
        self.steps: dict[int, subprocess.Popen[bytes]] = {}
        self.codes: dict[int, int | None] = {}

    def run(self) -> int:
        plan, ft = self.plan, self.ft
        t0 = time.time()
        try:
            lighthouse, address = start_lighthouse(plan, ft, node_address())
        except LighthouseFailed as exc:
            return lighthouse_failed(plan, str(exc)).exit_code
        for name in ("SIGTERM", "SIGUSR2", "SIGINT"):
            signal.signal(getattr(signal, name), self._on_signal)
        threads = []
        for k in range(ft.replicas):
            path = self._step_plan(k)
            t = threading.Thread(target=self._group, args=(k, path, address), daemon=True)
            t.start()
            threads.append(t)
        try:
            self._supervise(threads, lighthouse)
        finally:
            if lighthouse is not None:
                lighthouse.stop()
        if self._requeued():
            flush_and_exit(0)  # scontrol requeue ends this job; the next one resumes every group
        restarts = len(lighthouse.restarts) if lighthouse is not None else 0
        outcome = record_replicas(
            plan, ft, self.codes, restarts, self.stopping, time.time() - t0, slurm=_job()
        )
        return outcome.exit_code

    def _supervise(self, threads: list[threading.Thread], lighthouse: Lighthouse | None) -> None:
        """Until every group's steps are over: the Lighthouse restarted when it dies, a hung
        group torn down."""
        plan, ft = self.plan, self.ft
        watch = HangWatch(plan.run_dir, ft.replicas, plan.world_size, ft.hang_after_s, _kill_group)
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(POLL_S / len(threads))
            if self.stopping is not None:
                continue
            if lighthouse is not None and not lighthouse.alive():
                try:
                    lighthouse.restart()
                except LighthouseFailed as exc:
                    logger.error(f"ft: {exc}")
            watch.check({k for k, t in enumerate(threads) if t.is_alive()})

    def _requeued(self) -> bool:
        """After the preemption warning every group saved at its next step: requeue the job while
        it has requeues left (``launcher.max_requeues``); whether it was requeued."""
        policy = preempt_policy(self.plan)
        if self.stopping != f"SIG{policy.signal}" or not policy.allowed():
            return False
        n = policy.restart() + 1
        logger.warning(
            f"ft: preempted ({self.stopping}): every replica group saved; requeueing the job "
            f"({n} of launcher.max_requeues={policy.max_requeues}); it resumes every group"
        )
        try:
            policy.requeue()
        except (OSError, subprocess.SubprocessError) as exc:
            logger.error(f"ft: the requeue failed ({exc}); the run ends interrupted")
            return False
        return True

    def _on_signal(self, signum: int, _frame: Any) -> None:
        """Stop every group: SIGTERM to each step (srun passes it to the agent, which stops its
        ranks at their next step)."""
        self.stopping = self.stopping or signal.Signals(signum).name
        with self.lock:
            for proc in self.steps.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

    def _step_plan(self, k: int) -> Path:
        """Replica group ``k``'s plan for its step (the local launcher's), in its directory."""
        plan = self.plan
        config = {**plan.config, "launcher": replica_launch_config(plan, self.ft)}
        replica_dir = prepare_replica_dir(plan, k)
        path = replica_dir / STEP_PLAN
        atomic_write_json(path, {"config": config, "overrides": plan.overrides})
        return path

    def _command(self, k: int, path: Path, lighthouse: str) -> list[str]:
        cpus = int(self.plan.launcher_config.cpus_per_task) * self.plan.world_size
        return [
            "srun",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--relative={k % self.nodes}",
            f"--cpus-per-task={cpus}",
            f"--job-name=wf-replica{k}",
            sys.executable,
            "-m",
            "wf_launch.launchers.slurm.ft",
            str(path),
            str(k),
            lighthouse,
        ]

    def _group(self, k: int, path: Path, lighthouse: str) -> None:
        """Replica group ``k``'s steps: again in place while it ends without its final record
        and has restarts left."""
        replica_dir = files.ft_replica_dir(self.plan.run_dir, k)
        restarts = 0
        while True:
            with self.lock:
                if self.stopping is not None:
                    break
                proc = subprocess.Popen(self._command(k, path, lighthouse))
                self.steps[k] = proc
            code = proc.wait()
            self.codes[k] = code
            if _final(replica_dir) or self.stopping is not None:
                break
            if restarts >= self.ft.max_replica_restarts:
                logger.error(f"ft: replica group {k}'s step ended (exit {code}); no restart left")
                break
            restarts += 1
            append_event(
                replica_dir,
                event="failed",
                attempt=restarts,
                rank=-1,
                cause=f"step exit {code}",
                failed_at_step=last_step(replica_dir),
            )
            logger.warning(
                f"ft: replica group {k}'s job step ended (exit {code}); starting it again"
            )
        record = _record(replica_dir)
        if record is not None and record.final:
            self.codes[k] = record.exit_code


def _final(replica_dir: Path) -> bool:
    record = _record(replica_dir)
    return record is not None and record.final


def _record(replica_dir: Path) -> RunRecord | None:
    try:
        return RunRecord.read(replica_dir)
    except RecordError:
        return None


def preempt_policy(plan: LaunchPlan) -> SlurmRequeue:
    """The run's preemption policy: submitit's signal (``--signal=USR2@signal_delay_s``), the
    requeues ``launcher.max_requeues`` allows."""
    lc = plan.launcher_config
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return SlurmRequeue(name, float(lc.preempt_wait_s), int(lc.max_requeues))


def _job() -> dict[str, Any]:
    return {
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "nodes": os.environ.get("SLURM_JOB_NODELIST"),
        "requeues": SlurmRequeue.restart(),
    }


def _kill_group(replica_dir: Path, pids: dict[int, int]) -> None:
    """The hang watch's tear-down: the group's ranks on this host by pid (its agent restarts
    them), else its whole job step (started again in place)."""
    kill_here(replica_dir, pids)
    step = read_json(replica_dir / STEP_FILE) or {}
    if not pids and step.get("step"):
        subprocess.run(
            ["scancel", "--signal=KILL", f"{step['job']}.{step['step']}"],
            capture_output=True,
            timeout=30,
        )


def step_main(argv: list[str]) -> None:
    """In a replica group's job step: the local launcher's replica group (never returns)."""
    path, k, lighthouse = Path(argv[0]), int(argv[1]), argv[2]
    given = read_json(path)
    config = given["config"]
    plan = LaunchPlan(config, run_layout(config), path.parent, list(given["overrides"]))
    atomic_write_json(
        plan.run_dir / STEP_FILE,
        {
            "job": os.environ.get("SLURM_JOB_ID"),
            "step": os.environ.get("SLURM_STEP_ID"),
            "node": os.environ.get("SLURMD_NODENAME"),
        },
    )
    os.environ[FT_HOST_ENV] = node_address()
    # the preemption warning reaches every process of the job's steps: the supervisor's alone
    # acts on it (a SIGTERM to each step, once); its default would end this group unsaved
    signal.signal(
        getattr(signal, f"SIG{os.environ.get('SUBMITIT_PREEMPT_SIGNAL', 'USR2')}"), signal.SIG_IGN
    )
    replica_main(local_launch, plan, k, lighthouse)


if __name__ == "__main__":
    step_main(sys.argv[1:])
