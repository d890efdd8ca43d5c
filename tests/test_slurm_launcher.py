"""``launcher=slurm`` through the real CLI on the real throw-away SLURM cluster: runs on one and
two nodes, a failing rank's root cause, dry run, detach + status, cancel, layout errors before
submit, a sweep submitted at once, and a time-limit signal that runs every rank's hook and
requeues the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import USER_TASKS, leftover_processes, run_python_m
from slurm_fixture import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SLURM = "launcher=slurm"
TEST_TASKS = "task.modules=[wf_test_tasks]"
PREEMPT_TASKS = "task.modules=[wf_slurm_test_tasks]"


def _env(cluster: SlurmCluster) -> dict[str, str]:
    env = dict(cluster.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    return env


def _cli(
    cluster: SlurmCluster,
    args: list[str],
    run_dir: Path,
    timeout: float = 120,
    multirun: bool = False,
) -> subprocess.CompletedProcess[str]:
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    return run_python_m(
        "wf_launch",
        [*(["-m"] if multirun else []), *args, where],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(cluster),
        cwd=run_dir.parent,
    )


def _status(
    cluster: SlurmCluster, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return run_python_m(
        "wf_launch.status",
        [*args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(cluster),
    )


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def _job(run_dir: Path) -> dict:
    return json.loads((run_dir / "slurm_job.json").read_text())


def _jobs_named(cluster: SlurmCluster, name: str) -> list[str]:
    out = cluster.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "--name", name, "-S", "now-1hour"])
    queued = cluster.run(["squeue", "-h", "-n", name, "-o", "%i"])
    return out.stdout.split() + queued.stdout.split()


@pytest.fixture(scope="module")
def preempted_run(
    slurm_cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A 2-node run with a 3-minute limit and USR2 100 s before it, started before the other tests
    so its wait for slurmctld's time-limit pass (every 30 s: 80-110 s) overlaps them. (With a
    shorter limit the signal can come before a loaded machine has started Python and torch in the
    ranks, and then submitit's own handler ends the task: seen in CI with a 2-minute limit.)"""
    run_dir = tmp_path_factory.mktemp("preempt") / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wf_launch",
            SLURM,
            "task=resumable",
            PREEMPT_TASKS,
            "engine.cp_size=2",
            "launcher.nodes=2",
            "launcher.time_min=3",
            "launcher.signal_delay_s=100",
            "launcher.max_requeues=1",
            f"hydra.run.dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(slurm_cluster),
        cwd=run_dir.parent,
    )
    yield proc, run_dir
    if proc.poll() is None:
        proc.kill()
        if (run_dir / "slurm_job.json").exists():
            _status(slurm_cluster, "--cancel", str(run_dir))


@pytest.fixture(scope="module", autouse=True)
def _start_preempted_first(preempted_run: tuple[subprocess.Popen, Path]) -> None:
    """Submit the time-limit job before any other test (see ``preempted_run``)."""


def test_four_ranks_on_one_node_run_the_demo(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(slurm_cluster, [SLURM, "engine.cp_size=4"], run_dir)
    assert proc.returncode == 0, proc.stderr
    res = _result(run_dir)
    assert res["status"] == "ok" and res["exit_code"] == 0 and res["launcher"] == "slurm"
    assert res["layout"]["world_size"] == 4 and res["slurm"]["state"] == "COMPLETED"
    holders = [r for r in res["results"].values() if "max_abs_err" in r]
    assert holders and all(r["ok"] and r["max_abs_err"] < 1e-4 for r in holders)
    job_id = _job(run_dir)["job_id"]
    folder = run_dir / "submitit"
    assert sorted(p.name for p in folder.glob(f"{job_id}_*_log.out")) == [
        f"{job_id}_{t}_log.out" for t in range(4)
    ]
    assert sorted(p.name for p in (run_dir / "logs").glob("rank*.log")) == [
        f"rank{r}.log" for r in range(4)
    ]
    assert leftover_processes(str(run_dir)) == []


def test_two_nodes_two_ranks_each_with_cp_and_pp(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    if slurm_cluster.nodes < 2:
        pytest.skip("needs a 2-node cluster")
    run_dir = tmp_path / "run"
    proc = _cli(
        slurm_cluster,
        [
            SLURM,
            "engine.cp_size=2",
            "engine.pp_size=2",
            "launcher.nodes=2",
            "launcher.tasks_per_node=2",
        ],
        run_dir,
    )
    assert proc.returncode == 0, proc.stderr
    res = _result(run_dir)
    assert res["status"] == "ok"
    assert res["layout"] == {
        "tp": 1,
        "cp": 2,
        "pp": 2,
        "dp": 1,
        "order": "tp-cp-pp-dp",
        "world_size": 4,
    }
    assert all(r["ok"] for r in res["results"].values() if "ok" in r)
    nodes = slurm_cluster.run(
        ["sacct", "-j", _job(run_dir)["job_id"], "-X", "-n", "-P", "-o", "NNodes"]
    )
    assert nodes.stdout.split() == ["2"]
    assert "[r3 tp0 cp1 pp1 dp0]" in (run_dir / "logs" / "rank3.log").read_text()
    placement = res[
        "placement"
    ]  # SLURM's node names: ranks 0,1 on the first node, 2,3 on the second
    assert (
        placement["0"]["node"]
        == placement["1"]["node"]
        != placement["2"]["node"]
        == placement["3"]["node"]
    )


def test_failing_rank_is_reported_failed_with_its_root_cause(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(
        slurm_cluster,
        [
            SLURM,
            "task=misbehave",
            TEST_TASKS,
            "task.how=raise",
            "task.rank=2",
            "engine.cp_size=2",
            "engine.pp_size=2",
            "launcher.nodes=2",
        ],
        run_dir,
    )
    assert proc.returncode == 1
    assert (
        "rank 2 (r2 tp0 cp0 pp1 dp0) failed first: ValueError: rank 2 refuses: bad batch 17"
        in proc.stderr
    )
    res = _result(run_dir)
    assert res["status"] == "failed" and res["exit_code"] == 1 and res["slurm"]["state"] == "FAILED"
    failure = res["failure"]
    assert (failure["rank"], failure["type"]) == (2, "ValueError")
    assert "bad batch 17" in Path(failure["log"]).read_text()
    assert leftover_processes(str(run_dir)) == []


def test_dry_run_prints_the_sbatch_script_and_submits_nothing(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    name = f"dry-{uuid.uuid4().hex[:8]}"
    proc = _cli(
        slurm_cluster,
        [
            SLURM,
            "engine.cp_size=2",
            "engine.pp_size=2",
            "launcher.nodes=2",
            "launcher.dry_run=true",
            f"launcher.job_name={name}",
            "launcher.partition=debug",
            "launcher.setup=[echo hello]",
            "launcher.srun_args=['--cpu-bind=none']",
        ],
        run_dir,
    )
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout.split("sbatch script:\n", 1)[1]
    for line in (
        "#!/bin/bash",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --signal=USR2@90",
        f"#SBATCH --job-name={name}",
        "#SBATCH --partition=debug",
        "#SBATCH --requeue",
        "echo hello",
    ):
        assert line in script.splitlines(), line
    assert "--kill-on-bad-exit=1 --cpu-bind=none" in script and "submitit.core._submit" in script
    assert not (run_dir / "slurm_job.json").exists() and not (run_dir / "submitit").exists()
    assert _jobs_named(slurm_cluster, name) == []


def test_detached_submit_then_status(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [SLURM, "engine.cp_size=2", "launcher.wait=false"]
    dry = _cli(slurm_cluster, [*args, "launcher.dry_run=true"], run_dir)
    proc = _cli(slurm_cluster, args, run_dir)
    assert proc.returncode == 0, proc.stderr
    job = _job(run_dir)
    assert f"submitted SLURM job {job['job_id']}" in proc.stdout
    assert not (run_dir / "result.json").exists() or "exit_code" not in _result(run_dir)
    submitted = (run_dir / "submitit" / f"{job['job_id']}_submission.sh").read_text()
    assert (
        submitted.strip() == dry.stdout.split("sbatch script:\n", 1)[1].strip()
    )  # dry run shows what is sent
    status = _status(slurm_cluster, "--wait", str(run_dir))
    assert status.returncode == 0, status.stdout + status.stderr
    assert f"SLURM job {job['job_id']} COMPLETED -> ok (exit 0)" in status.stdout
    assert "rank 0: ok" in status.stdout and "rank 1: ok" in status.stdout
    res = _result(run_dir)
    assert (
        res["status"] == "ok" and res["exit_code"] == 0 and res["slurm"]["job_id"] == job["job_id"]
    )


def test_cancel_ends_the_job_and_leaves_nothing(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(
        slurm_cluster,
        [
            SLURM,
            "task=misbehave",
            TEST_TASKS,
            "task.how=sleep_all",
            "task.sleep_s=300",
            "engine.cp_size=2",
            "launcher.wait=false",
        ],
        run_dir,
    )
    assert proc.returncode == 0, proc.stderr
    deadline = time.monotonic() + 60
    while not all(
        (run_dir / "logs" / f"rank{r}.log").exists()
        and "sleeping" in (run_dir / "logs" / f"rank{r}.log").read_text()
        for r in range(2)
    ):
        assert time.monotonic() < deadline, "ranks never reached the task"
        time.sleep(0.3)
    status = _status(slurm_cluster, "--cancel", str(run_dir))
    assert status.returncode == 143, status.stdout + status.stderr
    assert "-> cancelled" in status.stdout
    res = _result(run_dir)
    assert res["status"] == "cancelled" and res["exit_code"] == 143
    assert res["slurm"]["state"].startswith("CANCELLED")
    assert leftover_processes(str(run_dir), grace_s=1.0) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["engine.cp_size=4", "launcher.nodes=2", "launcher.tasks_per_node=1"],
            (
                "launcher.tasks_per_node=1 is not allowed: launcher.nodes (2) x "
                "launcher.tasks_per_node (1) = 2 SLURM "
                "tasks, but the layout (tp*cp*pp*dp) has 4 rank(s)"
            ),
        ),
        (
            ["engine.cp_size=3", "launcher.nodes=2"],
            "launcher.nodes=2 is not allowed: the layout's 3 rank(s)",
        ),
        (
            ["engine.cp_size=2", "engine.distributed_backend=nccl"],
            "launcher.gpus_per_node=0 is not allowed: engine.distributed_backend='nccl' needs one "
            "GPU per task",
        ),
    ],
)
def test_bad_layout_is_refused_before_anything_is_submitted(
    slurm_cluster: SlurmCluster, tmp_path: Path, args: list[str], message: str
) -> None:
    run_dir = tmp_path / "run"
    name = f"bad-{uuid.uuid4().hex[:8]}"
    proc = _cli(slurm_cluster, [SLURM, *args, f"launcher.job_name={name}"], run_dir)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (run_dir / "slurm_job.json").exists()
    assert _result(run_dir)["status"] == "invalid"
    assert _jobs_named(slurm_cluster, name) == []


def test_sweep_submits_every_point_at_once_and_reports(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    proc = _cli(
        slurm_cluster,
        [SLURM, "engine.cp_size=2", "engine.order=tp-cp-pp-dp,dp-pp-cp-tp"],
        sweep,
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr
    ids = [_job(sweep / str(n))["job_id"] for n in range(2)]
    array = ids[0].split("_")[0]
    assert ids == [f"{array}_0", f"{array}_1"]  # one job array: both points submitted by one sbatch
    assert [_result(sweep / str(n))["status"] for n in range(2)] == ["ok", "ok"]
    report = (sweep / "sweep_summary.md").read_text()
    assert "2 point(s): 2 ok" in report
    assert (sweep / "sweep_chart.png").stat().st_size > 0


def test_time_limit_signal_runs_every_ranks_hook_and_requeues(
    preempted_run: tuple[subprocess.Popen, Path],
) -> None:
    proc, run_dir = preempted_run
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    res = _result(run_dir)
    assert res["status"] == "ok" and res["slurm"]["state"] == "COMPLETED"
    for rank in (0, 1):
        marker = json.loads((run_dir / "logs" / f"rank{rank}.preempt.json").read_text())
        assert (marker["restart"], marker["hook"], marker["requeue"]) == (0, "ok", True)
        assert (
            res["results"][str(rank)]["restart"] == 1
        )  # the requeued run, through the same entrypoint
        assert res["results"][str(rank)]["resumed_steps"] > 0  # the state this rank's hook saved
