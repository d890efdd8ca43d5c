"""The tuner on the real throw-away SLURM cluster: a round's trials go out as one job array, each on
nodes of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import USER_TASKS
from slurm_fixture import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_tune_on_slurm_submits_each_round_as_a_job_array(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = dict(slurm_cluster.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    d = tmp_path / "tune"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch.tune",
            "task=clockwork",
            "task.modules=[wf_tune_tasks]",
            "launcher=slurm",
            "world_size=2",
            "task.steps=12",
            "--warmup",
            "1",
            "--min-steps",
            "3",
            "--dir",
            str(d),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = json.loads((d / "tune.json").read_text())
    assert state["launcher"] == "slurm"
    r0 = d / "rounds" / "r0"
    points = sorted((p for p in r0.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert (
        len(points) == len(state["rounds"][0]["trials"]) == 3
    )  # tp2, cp2, dp2 (pp2 needs 2 micro-batches)
    ids = [json.loads((p / "slurm_job.json").read_text())["job_id"] for p in points]
    array = ids[0].split("_")[0]
    assert ids == [f"{array}_{n}" for n in range(3)]  # one sbatch: the round is a job array
    script = next((r0 / "submitit").glob("*_submission.sh")).read_text()
    assert "#SBATCH --exclusive" in script  # a trial's nodes are its own
    winner = next(p for p in state["space"] if p["id"] == state["winner"])
    assert winner["sizes"] == {"tp": 1, "cp": 1, "pp": 1, "dp": 2}  # the known function's best
    assert all(m["status"] == "ok" for m in state["measurements"] if m["round"] == 0)
