"""task=script on the real SLURM cluster: torchrun's environment on two nodes, the script run from
the code snapshot in the directory the command was started from, a rank's sys.exit(3) as the root
cause, and the preemption drill on a script that uses wf_launch's helpers (USR2, stop flag,
checkpoint, requeue, resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import USER_TASKS, run_python_m
from slurm_fixture import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[1]


def _env(cluster: SlurmCluster) -> dict[str, str]:
    env = dict(cluster.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    return env


def _cli(
    cluster: SlurmCluster, args: list[str], run_dir: Path, timeout: float = 240
) -> subprocess.CompletedProcess:
    return run_python_m(
        "wf_launch",
        ["launcher=slurm", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(cluster),
        cwd=run_dir.parent,
    )


def test_a_script_on_two_nodes_sees_torchruns_environment_and_runs_from_the_snapshot(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    if slurm_cluster.nodes < 2:
        pytest.skip("needs a 2-node cluster")
    run_dir = tmp_path / "run"
    proc = _cli(
        slurm_cluster,
        [
            "task=script",
            f"task.path={SCRIPTS / 'no_group.py'}",
            "task.args=[--out-dir,seen]",
            "engine.dp_size=2",
            "launcher.nodes=2",
            "launcher.max_requeues=1",
        ],
        run_dir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "ok" and record["results"] == {
        "0": {"exit_code": 0},
        "1": {"exit_code": 0},
    }
    job_id = json.loads((run_dir / "slurm_job.json").read_text())["job_id"]
    for rank in (0, 1):
        seen = json.loads((tmp_path / "seen" / f"rank{rank}.json").read_text())
        env = seen["env"]
        assert seen["cwd"] == str(tmp_path)  # where the command was started, not the snapshot
        assert seen["file"] == str(run_dir / "code" / SCRIPTS.relative_to(REPO) / "no_group.py")
        assert (
            env["RANK"] == env["ROLE_RANK"] == env["GROUP_RANK"] == str(rank)
            and env["LOCAL_RANK"] == "0"
        )
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "1"
        assert env["TORCHELASTIC_RUN_ID"] == job_id and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert (
            env["TORCHELASTIC_MAX_RESTARTS"] == "1"
            and env["MASTER_PORT"].isdigit()
            and env["MASTER_ADDR"]
        )
        assert env["WF_DP_SIZE"] == "2" and env["WF_RUN_DIR"] == str(run_dir)


def test_sys_exit_3_on_one_slurm_rank_is_the_root_cause(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(
        slurm_cluster,
        [
            "task=script",
            f"task.path={SCRIPTS / 'exit_on_rank.py'}",
            "task.args=[--rank,1,--code,3]",
            "engine.dp_size=2",
        ],
        run_dir,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    failure = json.loads((run_dir / "result.json").read_text())["failure"]
    assert failure["rank"] == 1 and failure["type"] == "ScriptExit" and failure["exit_code"] == 3, (
        failure
    )
    assert (
        "rank 1 exited with code 3 at exit_on_rank.py:21 in main (r1 tp0 cp0 pp0 dp1)"
        in proc.stderr
    ), proc.stderr[-3000:]


def test_the_slurm_drill_on_a_script_with_the_helpers_ends_identical(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """USR2 (the preemption warning) sets the stop flag; the script saves and ends; the job requeues
    itself and the script resumes from its checkpoint, ending bitwise identical to an uninterrupted
    run."""
    directory = tmp_path / "drill"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch.drill",
            "task=script",
            f"task.path={SCRIPTS / 'helpers_train.py'}",
            "task.args=[--steps,14,--step-sleep,0.2]",
            "engine.dp_size=2",
            "--backend",
            "slurm",
            "--inject",
            "usr2@4",
            "--dir",
            str(directory),
            "--timeout",
            "400",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(slurm_cluster),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    summary = json.loads((directory / "drill.json").read_text())
    first, requeued = summary["attempts"]
    assert first["ended_by"] == "preempted: USR2 (stop flag)", summary["attempts"]
    assert requeued["resumed_from"] == first["last_step"] and requeued["last_step"] == 14
