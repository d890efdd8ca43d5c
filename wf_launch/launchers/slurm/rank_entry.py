"""Inside a SLURM task: the rank's environment, what every task runs, and the requeue policy.

sbatch's ``--signal=USR2@signal_delay_s`` reaches every task; the entrypoint's handler
(:class:`SlurmRequeue`) runs the task's ``on_preempt`` hook before rank 0 requeues the job.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any

from worldfoundry.core.distributed.env import ATTEMPT_ENV, LAUNCH_PORTS

from ...rank.entrypoint import Preempted, RankSpec, rank_main
from ...rank.hardexit import exit_after_cleanup, exit_status, flush_and_exit
from ...rank.stackdump import DUMP_SIGNAL, NODE_ENV
from .submitit_adapter import job_environment


@dataclass(frozen=True)
class SlurmRequeue:
    """The preemption policy on SLURM (see :class:`wf_launch.rank.preempt.PreemptHandler`)."""

    signal: str
    wait_s: float
    max_requeues: int

    @staticmethod
    def restart() -> int:
        """The job's requeues so far."""
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)

    def allowed(self) -> bool:
        return self.restart() < self.max_requeues

    def requeue(self) -> None:
        subprocess.run(
            ["scontrol", "requeue", requeue_target()], check=True, timeout=60, capture_output=True
        )


@dataclass(frozen=True)
class SlurmStackDump:
    """``RankSpec.on_timeout`` on SLURM: ``scancel --signal=URG`` (the job's steps, where every
    rank dumps its stacks), then ``settle_s`` for the dumps to land before srun ends them."""

    settle_s: float = 1.5

    def __call__(self) -> None:
        dump = f"--signal={DUMP_SIGNAL.name.removeprefix('SIG')}"
        subprocess.run(["scancel", dump, requeue_target()], capture_output=True, timeout=10)
        time.sleep(self.settle_s)


def requeue_target(environ: dict[str, str] | None = None) -> str:
    """The id that requeues this job alone: ``ARRAYJOB_TASK`` for an array task (the first
    task's ``SLURM_JOB_ID`` is the array's: it would requeue every point), else the job id."""
    env = os.environ if environ is None else environ
    array, task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return env["SLURM_JOB_ID"]


def master_port(job_id: str, restart: int, environ: dict[str, str] | None = None) -> int:
    """The rendezvous port every task agrees on (a requeue gets another): a reserved port of
    the step, else one that follows the job id (a sweep's points on a node differ)."""
    env = os.environ if environ is None else environ
    reserved = env.get("SLURM_STEP_RESV_PORTS", "")
    first = reserved.split(",")[0].split("-")[0].strip()
    if first.isdigit() and 0 < int(first) < 65536:
        return int(first) + (restart % max(1, _resv_count(reserved)))
    low, high = LAUNCH_PORTS
    span = high - low
    cluster = f"{env.get('SLURM_CLUSTER_NAME', '')}:{env.get('SLURM_CONF', '')}"
    offset = zlib.crc32(cluster.encode()) % span
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return low + (offset + int(digits) + 7919 * restart) % span


def _resv_count(reserved: str) -> int:
    count = 0
    for part in reserved.split(","):
        lo, _, hi = part.partition("-")
        if lo.strip().isdigit():
            count += (int(hi) - int(lo) + 1) if hi.strip().isdigit() else 1
    return count


def export_rank_env(max_restarts: int = 0) -> dict[str, str]:
    """torchrun's environment (RANK ... TORCHELASTIC_*) and ``WF_NODE`` from SLURM's task
    variables; a job on one node listens on loopback only, one across nodes on the first's."""
    job = job_environment()
    one_node = job.num_nodes == 1
    job_id = os.environ.get("SLURM_JOB_ID", job.job_id)
    restart = SlurmRequeue.restart()
    env = {
        "RANK": str(job.global_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "LOCAL_RANK": str(job.local_rank),
        "LOCAL_WORLD_SIZE": str(job.num_tasks // max(1, job.num_nodes)),
        "MASTER_ADDR": "127.0.0.1" if one_node else job.hostnames[0],
        "MASTER_PORT": str(master_port(job_id, restart)),
        "GROUP_RANK": str(job.node),
        "GROUP_WORLD_SIZE": str(job.num_nodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(job.global_rank),
        "ROLE_WORLD_SIZE": str(job.num_tasks),
        "TORCHELASTIC_RUN_ID": str(job_id),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        NODE_ENV: os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
    }
    if one_node:
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME") or "lo"
    os.environ.update(env)
    return env


@dataclass(frozen=True)
class SlurmRank:
    """What every SLURM task runs (submitit pickles it): the environment, then ``rank_main``."""

    spec: RankSpec

    def __call__(self) -> dict[str, Any]:
        export_rank_env(int(getattr(self.spec.preempt, "max_requeues", 0) or 0))
        os.environ[ATTEMPT_ENV] = str(self.spec.attempt_base + SlurmRequeue.restart())
        try:
            value = rank_main(self.spec)
        except Preempted:
            flush_and_exit(0)
        except BaseException as exc:
            # submitit records the error and re-raises; Python's traceback of it then goes to
            # SLURM's log of the task (submitit/JOB_TASK_log.err), not to the rank log the
            # launcher shows: the rank recorded its failure, and the launcher shows ranks that
            # failed alike once, with the user's frames
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            exit_after_cleanup(exit_status(exc))
            raise
        # submitit writes the result; then leave before torch's teardown can abort
        exit_after_cleanup(0)
        return value
