"""``ft=torchft`` on ``launcher=slurm``: one job, one job step per replica group, on the test
SLURM cluster; a kill -9 and a hang of one group while the other steps on, a preemption that
requeues the job (real SLURM, real torchft)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ft_cluster import drill_two_faults, sigterm_while_running, steps_of

from wf_launch.rundir import files

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_the_slurm_drill_kills_then_hangs_one_group_and_the_other_steps_on(
    slurm_cluster, tmp_path: Path
) -> None:
    record = drill_two_faults("slurm", ["launcher.nodes=2"], slurm_cluster.env, tmp_path)
    assert record["ft"]["recoveries"][0]["cause"] == "SIGKILL"
    # one job, each replica group a job step of its own, on a node of its own
    run = tmp_path / "drill" / "interrupted"
    steps = [
        json.loads((files.ft_replica_dir(run, k) / "slurm_step.json").read_text()) for k in (0, 1)
    ]
    assert steps[0]["job"] == steps[1]["job"] == str(record["slurm"]["job_id"])
    assert steps[0]["step"] != steps[1]["step"]
    assert steps[0]["node"] != steps[1]["node"], steps  # --relative: group K on node K


def _preempt(env: dict[str, str]) -> Callable[[Path, subprocess.Popen[str]], None]:
    """The preemption warning (``scancel --signal=USR2``, what ``--signal=USR2@N`` sends) to the
    run's job; then wait until the requeued job's groups step again."""

    def act(run: Path, launch: subprocess.Popen[str]) -> None:
        job = json.loads((run / files.SLURM_JOB).read_text())["job_id"]
        subprocess.run(["scancel", "--signal=USR2", str(job)], check=True, env=env, timeout=30)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launch.poll() is None:
            shown = subprocess.run(
                ["scontrol", "-o", "show", "job", str(job)], capture_output=True, text=True, env=env
            ).stdout
            if "Restarts=1 " in shown and "JobState=RUNNING" in shown:
                break
            time.sleep(0.3)
        done = steps_of(run, 1)
        while time.monotonic() < deadline and launch.poll() is None and steps_of(run, 1) < done + 6:
            time.sleep(0.2)
        assert launch.poll() is None, "the launch ended before the requeued job stepped"

    return act


def test_preemption_requeues_and_resumes_every_group_then_sigterm_stops_them(
    slurm_cluster, tmp_path: Path
) -> None:
    """The preemption warning: the supervisor stops every group (they save), requeues the job,
    and the requeued job's groups resume from their checkpoints. Then SIGTERM to the waiting
    launch cancels the job: the supervisor passes it to every group's step, the ranks save, the
    run ends interrupted, and nothing is left in the queue."""
    where = ["launcher=slurm", "launcher.nodes=2"]
    env = slurm_cluster.env
    run, record = sigterm_while_running(where, env, tmp_path, _preempt(env))
    assert record["slurm"]["requeues"] == 1
    for k in (0, 1):
        log = files.rank_log(files.ft_replica_dir(run, k), 0).read_text()
        assert re.search(r"train: attempt 1 resumes from step ([4-9]|\d\d)", log), log[-2000:]
    queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=env)
    assert queue.stdout.strip() == ""
