"""A SLURM run shown live (by the waiting launcher, or by ``status --follow`` on a detached run):
queue state, the console ranks' lines, progress, and the final line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import USER_TASKS, leftover_processes, popen_argv, run_argv, run_python_m
from slurm_fixture import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_slurm_wait_shows_state_rank_lines_and_the_final_line(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    env = dict(slurm_cluster.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    run_dir = tmp_path / "run"
    proc = run_argv(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=slurm",
            "engine.cp_size=2",
            "launcher.console_ranks=[0]",
            "launcher.progress_interval_s=0.1",
            "launcher.poll_interval_s=0.2",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    job = (run_dir / "slurm_job.json").read_text()
    assert "SLURM job " in err and ": RUNNING on " in err, err
    assert "[r0 tp0 cp0 pp0 dp0] demo: " in err, err
    assert "[r1 tp0 cp1 pp0 dp0]" not in err
    assert "step 3/3 (100%)" in err, err
    assert "run ok in " in err and f"{run_dir / 'result.json'}" in err and job


def _wait_for(path: Path, pattern: str, proc: subprocess.Popen, timeout_s: float = 240) -> str:
    """The text of ``path`` once it matches ``pattern`` (fails if ``proc`` ends first or time runs
    out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if re.search(pattern, text):
            return text
        assert proc.poll() is None, (
            f"--follow ended (rc {proc.returncode}) before {pattern!r}:\n{text}"
        )
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout_s} s:\n{text}")


def _runs(where: Path, env: dict[str, str]) -> list[dict]:
    out = run_python_m(
        "wf_launch.runs",
        [str(where), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_follow_shows_a_detached_slurm_run_live_and_ctrl_c_leaves_it_running(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """Held (``--begin``) until ``--follow`` showed it pending; Ctrl-C to one follow, the next to
    the end; ``--tail`` and the runs list while it runs and after."""
    env = dict(slurm_cluster.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    run_dir = tmp_path / "run"
    steps = 20
    submit = run_argv(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=slurm",
            "launcher.wait=false",
            "task=ticker",
            "task.modules=[wf_test_tasks]",
            f"task.steps={steps}",
            "task.step_sleep_s=0.1",
            "task.fail_rank=1",
            f"task.hold_until={tmp_path / 'go'}",  # the run goes on until the checks below are done
            "engine.dp_size=2",
            "launcher.console_ranks=[0]",
            "launcher.progress_interval_s=0.1",
            "+launcher.sbatch_extra={begin:now+3600}",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert submit.returncode == 0, submit.stderr
    job_id = json.loads((run_dir / "slurm_job.json").read_text())["job_id"]
    follow_cmd = [sys.executable, "-m", "wf_launch.status", "--follow", str(run_dir)]
    try:
        first_out = tmp_path / "follow1.err"
        with open(first_out, "w") as err:
            first = popen_argv(
                follow_cmd,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                cwd=tmp_path,
                start_new_session=True,
            )
        try:
            _wait_for(first_out, rf"SLURM job {job_id}: PENDING \(BeginTime\)", first)
            slurm_cluster.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
            text = _wait_for(first_out, rf"step \d+/{steps} \(\d+%\)", first)
            text = _wait_for(first_out, r"\[r0 tp0 cp0 pp0 dp0\] tick ", first)
        except BaseException:
            first.kill()
            raise
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130, first_out.read_text()
        text = first_out.read_text()
        assert re.search(
            rf"PENDING \(BeginTime\)\n(.*\n)*.*SLURM job {job_id}: RUNNING on n", text
        ), text
        assert "slowest rank " in text and "loss=" in text and "[r1 " not in text, text
        assert "stopped following; the run goes on" in text and "Traceback" not in text, text
        assert (
            slurm_cluster.run(["squeue", "-h", "-j", job_id, "-o", "%T"]).stdout.strip()
            == "RUNNING"
        )
        assert not (run_dir / "result.json").exists()
        tail = run_python_m(
            "wf_launch.status",
            ["--tail", "2", str(run_dir)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert tail.returncode == 0 and tail.stdout.startswith(
            f"==> {run_dir / 'logs' / 'rank0.log'} <==\n"
        )
        assert len(tail.stdout.splitlines()) == 3 and "[r1 " not in tail.stdout, tail.stdout
        assert [(r["status"], r["launcher"]) for r in _runs(tmp_path, env)] == [
            ("running", f"slurm {job_id}")
        ]

        (tmp_path / "go").touch()
        second = run_argv(
            follow_cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path
        )
        from wf_launch.rundir.record import RunRecord, Status

        record = RunRecord.read(run_dir)
        assert record is not None and record.final and record.status is Status.FAILED, second.stderr
        assert second.returncode == record.exit_code != 0, second.stderr
        assert f"step {steps}/{steps} (100%)" in second.stderr, second.stderr
        assert (
            f"run failed in {record.timings['wall_s']:.2f}s: {run_dir / 'result.json'}"
            in second.stderr
        )
        assert f"rank 1 fails after {steps} steps, as asked" in second.stderr, second.stderr
        assert [(r["status"], r["launcher"], r["task"]) for r in _runs(tmp_path, env)] == [
            ("failed", f"slurm {job_id}", "ticker")
        ]
    finally:
        run_argv(["scancel", job_id], env=env, capture_output=True, timeout=60)
        deadline = time.monotonic() + 120
        while slurm_cluster.run(["squeue", "-h", "-j", job_id], check=False).stdout.strip():
            assert time.monotonic() < deadline, f"SLURM job {job_id} still queued"
            time.sleep(0.5)
    assert leftover_processes(str(run_dir)) == []
