"""The preemption drill: an interrupted run (rank killed, launcher stopped, job preempted) ends
bitwise identical to an uninterrupted one, and result.json's attempts say what each interruption
cost."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import cli_env, leftover_processes, python_m, run_python_m

from wf_launch.drivers.drill import main as drill_main
from wf_launch.rundir.claim import RunDirInUse, claim


def _drill(
    args: list[str], directory: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_python_m(
        "wf_launch.drill",
        [*args, "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        cwd=directory.parent,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--inject", "kill9@x"], "--inject 'kill9@x': expected KIND@STEP"),
        (
            ["--inject", "usr2@5"],
            "'usr2' is not an interruption of the local backend; choose from ['kill9', 'sigterm']",
        ),
        (
            ["--backend", "slurm", "--inject", "kill9@5"],
            "'kill9' is not an interruption of the slurm backend",
        ),
        (["--inject", "kill9@8,sigterm@4"], "steps must be distinct and increasing, got [8, 4]"),
        (["--random", "0"], "--random 0: expected an integer >= 1"),
        (["hydra.run.dir=/tmp/x"], "the drill sets hydra.run.dir itself"),
        (["launcher.resume=true"], "the drill sets launcher.resume itself"),
    ],
)
def test_bad_drill_arguments_are_refused_before_anything_runs(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (the slow tests run ``python -m wf_launch.drill`` itself)."""
    assert drill_main([*args, "--dir", str(tmp_path / "drill")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "drill" / "reference").exists()


def test_resume_continues_an_interrupted_run_and_refuses_a_completed_one(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "attempt0.json").write_text('{"attempt": 0, "last_step": 7}')
    (run / "result.json").write_text('{"status": "interrupted", "exit_code": 143}')
    claim(run, resume=True).release()
    assert not (run / "result.json").exists()  # the last record moved into logs/, the rest stays
    assert (
        json.loads((run / "logs" / "result.before-attempt1.json").read_text())["status"]
        == "interrupted"
    )
    assert (run / "logs" / "attempt0.json").exists()
    (run / "result.json").write_text('{"status": "ok", "exit_code": 0}')
    with pytest.raises(RunDirInUse, match="completed .status 'ok'.; nothing to resume"):
        claim(run, resume=True)
    with pytest.raises(RunDirInUse, match="choose one"):
        claim(run, overwrite=True, resume=True)


@pytest.mark.slow
def test_local_drill_kill9_then_sigterm_ends_identical(tmp_path: Path) -> None:
    """At pp2 x dp2: a kill -9 at cp2 x dp2 resumes bitwise in tests/test_train_task.py; what the
    drill adds (the attempts' causes, the stop flag's save, the record and ``status``) is the
    same at any layout."""
    directory = tmp_path / "drill"
    proc = _drill(
        [
            "task=train",
            "engine.pp_size=2",
            "engine.dp_size=2",
            "task.steps=28",
            "task.checkpoint_every=4",
            "--inject",
            "kill9@6,sigterm@10",
        ],
        directory,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "drill verdict: IDENTICAL" in proc.stdout
    summary = json.loads((directory / "drill.json").read_text())
    assert (
        summary["identical"]
        and summary["reference"]["weights_sha256"] == summary["interrupted"]["weights_sha256"]
    )
    first, restarted, resumed = summary["attempts"]
    assert first["cause"] == "launch" and first["ended_by"] == "rank 3 killed by SIGKILL"
    # A kill -9 loses the steps since the last checkpoint: at most checkpoint_every.
    assert restarted["cause"] == "rank 3 killed by SIGKILL" and restarted["resumed_from"] == 4
    assert 0 < restarted["steps_lost"] <= 4
    # SIGTERM to the launcher: the stop flag saves at the agreed step, so nothing is lost.
    assert resumed["cause"] == "stop flag: SIGTERM" and resumed["steps_lost"] == 0
    assert resumed["resumed_from"] == restarted["last_step"] and resumed["last_step"] == 28
    record = json.loads((directory / "interrupted" / "result.json").read_text())
    assert record["status"] == "ok" and record["attempts"] == summary["attempts"]
    status = run_python_m(
        "wf_launch.status",
        [str(directory / "interrupted")],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert status.returncode == 0, status.stderr
    assert "local run ended -> ok (exit 0)" in status.stdout
    assert "attempt 2: stop flag: SIGTERM; resumed from step" in status.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["engine.dp_size=2", "--inject", "kill9@1500"],
        ["ft=torchft", "--no-reference", "--inject", "kill9:replica1@1500"],
    ],
    ids=["drill", "ft-drill"],
)
def test_a_sigterm_to_the_drill_stops_the_run_it_started(tmp_path: Path, args: list[str]) -> None:
    """The drill starts each run in a session of its own (a ``kill`` of the drill reaches only
    the drill): a SIGTERM to it must stop that run, ranks included, and leave nothing behind."""
    directory = tmp_path / "drill"
    proc = python_m(
        "wf_launch.drill",
        ["task=train", "task.steps=2000", "task.step_sleep_s=0.05", *args, "--dir", str(directory)],
        fresh=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(directory.glob("**/logs/rank0.progress.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert leftover_processes(str(directory)) == []
