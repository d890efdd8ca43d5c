"""``ft=torchft`` on ``launcher=slurm``: one job, one job step per replica group, on the test
SLURM cluster; a kill -9 and a hang of one group while the other steps on (real SLURM, real
torchft)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from ft_cluster import drill_two_faults, sigterm_while_running

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


def test_sigterm_to_the_launch_stops_every_group_and_records_how_to_resume(
    slurm_cluster, tmp_path: Path
) -> None:
    """SIGTERM to the waiting launch cancels the job: the supervisor passes it to every group's
    step, the ranks save, and nothing is left in the queue."""
    where = ["launcher=slurm", "launcher.nodes=2"]
    sigterm_while_running(where, slurm_cluster.env, tmp_path)
    queue = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=slurm_cluster.env)
    assert queue.stdout.strip() == ""
