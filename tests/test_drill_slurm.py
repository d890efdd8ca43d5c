"""On the real SLURM cluster: the drill across 2 nodes, a preempted sweep point, and the code
snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import USER_TASKS, popen_argv, run_argv, run_python_m
from slurm_fixture import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
TRAIN = [
    "task=train",
    "task.checkpoint_every=4",
    "task.step_sleep_s=0.1",
    "engine.dp_size=2",
    "launcher.nodes=2",
]


def _env(cluster: SlurmCluster, pythonpath: list[Path] | None = None) -> dict[str, str]:
    env = dict(cluster.env)
    paths = [str(p) for p in (pythonpath or [USER_TASKS])]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
    return env


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def test_slurm_drill_across_two_nodes_ends_identical(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    directory = tmp_path / "drill"
    proc = run_argv(
        [
            sys.executable,
            "-m",
            "wf_launch.drill",
            *TRAIN,
            "task.steps=30",
            "--backend",
            "slurm",
            "--inject",
            "usr2@5",
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
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "drill verdict: IDENTICAL" in proc.stdout
    summary = json.loads((directory / "drill.json").read_text())
    first, requeued = summary["attempts"]
    assert first["ended_by"] == "preempted: USR2 (stop flag)"
    assert requeued["cause"] == "preempted: USR2 (stop flag)" and requeued["steps_lost"] == 0
    assert requeued["resumed_from"] == first["last_step"] and requeued["last_step"] == 30
    assert json.loads((directory / "interrupted" / "slurm_job.json").read_text())["nodes"] == 2
    status = run_python_m(
        "wf_launch.status",
        [str(directory / "interrupted")],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(slurm_cluster),
    )
    assert "attempt 1: preempted: USR2 (stop flag); resumed from step" in status.stdout, (
        status.stdout
    )


def _wait_for(path: Path, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{what} never happened ({path})"
        time.sleep(0.3)


def _restarts(cluster: SlurmCluster, job_id: str) -> int:
    """SLURM's own restart count of a job (kept MinJobAge after it ends)."""
    out = cluster.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
    found = [w for w in out.split() if w.startswith("Restarts=")]
    return int(found[0].split("=")[1]) if found else -1


def test_a_preempted_sweep_point_requeues_alone_and_both_match_the_reference(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = _env(slurm_cluster)
    args = ["launcher=slurm", *TRAIN, "task.steps=30"]
    cli = [sys.executable, "-m", "wf_launch"]
    reference = popen_argv(
        [*cli, *args, f"hydra.run.dir={tmp_path / 'reference'}"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    sweep = (
        tmp_path / "sweep"
    )  # two points that must give the same weights: async or synchronous saves
    proc = popen_argv(
        [*cli, "-m", *args, "task.async_save=false,true", f"hydra.sweep.dir={sweep}"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        progress = sweep / "0" / "logs" / "rank0.progress.json"
        deadline = time.monotonic() + 240
        while not (
            progress.exists() and json.loads(progress.read_text() or "{}").get("step", 0) >= 3
        ):
            assert time.monotonic() < deadline and proc.poll() is None, (
                "point 0 never reached step 3"
            )
            time.sleep(0.3)
        job = json.loads((sweep / "0" / "slurm_job.json").read_text())["job_id"]
        slurm_cluster.run(["scancel", "--signal=USR2", job])
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        assert reference.wait(timeout=600) == 0, reference.stderr.read() if reference.stderr else ""
    finally:
        for p in (proc, reference):
            if p.poll() is None:
                p.kill()
    ids = [json.loads((sweep / str(n) / "slurm_job.json").read_text())["job_id"] for n in range(2)]
    assert ids[0] == job and [_restarts(slurm_cluster, i) for i in ids] == [
        1,
        0,
    ]  # the healthy point never requeued
    expected = _result(tmp_path / "reference")["results"]["0"]["weights_sha256"]
    preempted, healthy = _result(sweep / "0"), _result(sweep / "1")
    assert [a["cause"] for a in preempted["attempts"]] == ["launch", "preempted: USR2 (stop flag)"]
    assert [a["cause"] for a in healthy["attempts"]] == [
        "launch"
    ]  # restart count 0: never requeued
    for record in (preempted, healthy):
        assert record["status"] == "ok" and record["results"]["0"]["weights_sha256"] == expected


PROBE = """from wf_launch import register_task
import wf_launch

VERSION = "{version}"


@register_task("code_probe")
def code_probe(ctx):
    return {{"version": VERSION, "wf_launch": wf_launch.__file__}}
"""


def _project_copy(dest: Path) -> Path:
    """A throw-away git checkout of this project (plus a probe task), the one the CLI imports
    below."""
    files = run_argv(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, files.split("\0")):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes((REPO / rel).read_bytes())
    (dest / "tests" / "user_tasks" / "wf_code_probe.py").write_text(
        PROBE.format(version="submitted")
    )
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    run_argv([*git, "init", "-q"], cwd=dest, check=True)
    run_argv([*git, "add", "-A"], cwd=dest, check=True)
    run_argv([*git, "commit", "-qm", "submitted"], cwd=dest, check=True)
    return dest


def test_a_queued_job_runs_the_code_it_was_submitted_with(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    project = _project_copy(tmp_path / "project")
    env = _env(slurm_cluster, [project, project / "tests" / "user_tasks"])
    runs = {"snapshot": tmp_path / "snap", "live": tmp_path / "live"}
    procs = {  # fresh interpreters: the copy's wf_launch, not the one the fork server imported
        name: subprocess.Popen(
            [
                sys.executable,
                "-m",
                "wf_launch",
                "launcher=slurm",
                "task=code_probe",
                "task.modules=[wf_code_probe]",
                "+launcher.sbatch_extra={begin: now+15}",
                f"launcher.snapshot={str(name == 'snapshot').lower()}",
                f"hydra.run.dir={run_dir}",
            ],
            env=env,
            cwd=project,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, run_dir in runs.items()
    }
    try:
        for run_dir in runs.values():
            _wait_for(run_dir / "slurm_job.json", "the submission")
        # Edit the checkout while both jobs wait in the queue.
        (project / "tests" / "user_tasks" / "wf_code_probe.py").write_text(
            PROBE.format(version="edited")
        )
        for name, proc in procs.items():
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{name}: {err}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    snap = _result(runs["snapshot"])["results"]["0"]
    assert snap["version"] == "submitted"
    assert Path(snap["wf_launch"]).is_relative_to(runs["snapshot"] / "code")
    live = _result(runs["live"])["results"]["0"]
    assert live["version"] == "edited" and Path(live["wf_launch"]).is_relative_to(project)
    environment = json.loads((runs["snapshot"] / "environment.json").read_text())
    assert any(p.startswith("torch==") for p in environment["packages"])
