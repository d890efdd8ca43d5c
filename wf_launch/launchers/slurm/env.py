"""Inside a SLURM task: the rank's environment, what every task runs, and the requeue policy.

Preemption: sbatch's ``--signal=USR2@signal_delay_s`` reaches every task of the srun
step, and the entrypoint's handler (``RankSpec.preempt`` = :class:`SlurmRequeue`) runs
the task's ``on_preempt(ctx)`` hook on every rank before rank 0 requeues the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from typing import Any

from ...entrypoint import ATTEMPT_VAR, Preempted, RankSpec, rank_main
from .submitit_adapter import job_environment

__all__ = ["SlurmRank", "SlurmRequeue", "export_rank_env", "master_port"]

_PORT_RANGE = (20000, 32000)  # below Linux's ephemeral range


@dataclass(frozen=True)
class SlurmRequeue:
    """The entrypoint's preemption policy on SLURM (see ``entrypoint._install_preempt_handler``)."""

    signal: str
    wait_s: float
    max_requeues: int

    def restart(self) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)

    def allowed(self) -> bool:
        return self.restart() < self.max_requeues

    def requeue(self) -> None:
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60,
                       capture_output=True)


def master_port(job_id: str, restart: int) -> int:
    """A port derived from the job (and cluster), the same on every task; a requeue gets a new one."""
    key = f"{os.environ.get('SLURM_CLUSTER_NAME', '')}:{os.environ.get('SLURM_CONF', '')}:{job_id}:{restart}"
    low, high = _PORT_RANGE
    return low + zlib.crc32(key.encode()) % (high - low)


def export_rank_env() -> dict[str, str]:
    """RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT from SLURM's
    task variables (as submitit's TorchDistributedEnvironment, with a port unique per cluster)."""
    job = job_environment()
    env = {
        "RANK": str(job.global_rank), "WORLD_SIZE": str(job.num_tasks), "LOCAL_RANK": str(job.local_rank),
        "LOCAL_WORLD_SIZE": str(job.num_tasks // max(1, job.num_nodes)), "MASTER_ADDR": job.hostnames[0],
        "MASTER_PORT": str(master_port(os.environ.get("SLURM_JOB_ID", job.job_id),
                                       int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))),
    }
    os.environ.update(env)
    return env


@dataclass(frozen=True)
class SlurmRank:
    """What every SLURM task runs (submitit pickles it): the rank's environment, then ``rank_main``."""

    spec: RankSpec

    def __call__(self) -> dict[str, Any]:
        export_rank_env()
        os.environ[ATTEMPT_VAR] = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
        try:
            return rank_main(self.spec)
        except Preempted:
            sys.__stdout__.flush()
            sys.__stderr__.flush()
            os._exit(0)
