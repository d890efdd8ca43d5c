"""The CLI keeps its word (issue 30, section 3): a resume into a mistyped folder is refused,
``launcher.resume=auto`` resumes or starts, NCCL without GPUs is refused before launch, and
Ctrl-C at any moment of start-up exits 130 without a traceback, leaving a record wherever a
run directory exists."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import cli_env, leftover_processes, result, run_cli, run_python_m, start_cli

TASKS = "task.modules=[wf_identity_tasks]"


# ------------------------------------------------------------------ resume keeps its word
@pytest.mark.slow
def test_resume_into_a_mistyped_folder_is_refused_and_auto_resumes_or_starts(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "runs" / "local_ctrlc"
    run_dir.parent.mkdir()
    whoami = ["task=whoami", TASKS, "engine.dp_size=2"]
    first = run_cli([*whoami, "task.fail_attempt=0", "launcher.resume=auto"], run_dir)
    assert first.returncode == 1 and result(run_dir)["status"] == "failed", first.stderr

    typo = tmp_path / "runs" / "local_ctrIc"
    refused = run_cli([*whoami, "launcher.resume=true"], typo)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"wf_launch: launcher.resume=true: there is no run in {typo} to resume; did you mean "
        f"{run_dir}? (launcher.resume=auto starts a run when none is there)"
    ]
    assert not typo.exists()  # nothing trained from scratch, no empty folder left

    resumed = run_cli([*whoami, "task.fail_attempt=0", "launcher.resume=auto"], run_dir)
    assert resumed.returncode == 0, resumed.stderr
    record = result(run_dir)
    assert record["status"] == "ok" and [a["attempt"] for a in record["attempts"]] == [0, 1]


def test_resume_takes_true_false_or_auto(tmp_path: Path) -> None:
    proc = run_cli(["task=noop", "launcher.resume=maybe", "launcher.dry_run=true"], tmp_path / "r")
    assert proc.returncode == 2
    assert "launcher.resume='maybe' is not allowed: choose one of [True, False, 'auto']" in (
        proc.stderr
    )
    assert "auto: continue it if one is there, else start one" in proc.stderr


# ------------------------------------------------------------------ NCCL needs GPUs
@pytest.mark.skipif(
    subprocess.run(
        [sys.executable, "-c", "import torch; assert not torch.cuda.is_available()"],
        capture_output=True,
    ).returncode,
    reason="this host has a GPU",
)
@pytest.mark.parametrize("dry_run", [True, False])
def test_nccl_without_a_gpu_is_refused_before_launch(tmp_path: Path, dry_run: bool) -> None:
    run_dir = tmp_path / "run"
    args = ["engine.distributed_backend=nccl", "engine.dp_size=2"]
    proc = run_cli([*args, f"launcher.dry_run={str(dry_run).lower()}"], run_dir)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "wf_launch: config error: engine.distributed_backend='nccl' is not allowed: NCCL needs "
        "a GPU per rank: the layout has 2 rank(s) and this host 0 GPU(s); use gloo here, or a "
        "launcher whose nodes have GPUs"
    ]
    assert not (run_dir / "logs").exists()  # no rank started


# ------------------------------------------------------------------ Ctrl-C at any moment
def _mapped(library: str) -> Callable[[int, Path], bool]:
    """Whether the launcher has mapped ``library``: it is importing the package (or has)."""

    def seen(pid: int, run_dir: Path) -> bool:
        try:
            return library in Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            return False

    return seen


MOMENTS: dict[str, Callable[[int, Path], bool]] = {
    "hydra importing (its yaml)": _mapped("_yaml.cpython"),
    "run dir made": lambda pid, run_dir: run_dir.is_dir(),
    "config written": lambda pid, run_dir: (run_dir / "config.yaml").exists(),
    "torch importing": _mapped("libtorch"),
    "ranks starting": lambda pid, run_dir: (run_dir / "logs" / "rank0.log").exists(),
}
"""Moments of start-up, each an event seen from outside. Python's own start, before the first
line of wf_launch runs, is the interpreter's (a KeyboardInterrupt traceback, killed by SIGINT)."""


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_at_any_moment_of_start_up_exits_130_without_a_traceback(
    tmp_path: Path, moment: str
) -> None:
    run_dir = tmp_path / "run"
    proc = start_cli(["task=slow_steps", TASKS, "engine.dp_size=2"], run_dir, fresh=True)
    reached = MOMENTS[moment]
    try:
        deadline = time.monotonic() + 180
        while not reached(proc.pid, run_dir) and proc.poll() is None:
            assert time.monotonic() < deadline, f"{moment} never came"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err and "Error" not in err, err
    if not run_dir.exists():
        assert err.strip().splitlines() == [
            "wf_launch: interrupted (Ctrl-C) before the run started; nothing was launched"
        ]
    else:
        record = result(run_dir)  # wherever a run directory exists, it holds the record
        assert record["status"] == "interrupted" and record["signal"] == "SIGINT", record
    assert leftover_processes(str(run_dir)) == []


@pytest.mark.slow
def test_a_ctrl_c_that_an_import_swallowed_still_stops_the_launch(tmp_path: Path) -> None:
    """A library's bare ``except:`` (torch's imports have some) can swallow the KeyboardInterrupt
    of a Ctrl-C that cut its import short. CI once met it: the run dir was made, the Ctrl-C
    came, and the launch ran its ranks to the end and exited 0. The noted Ctrl-C is honoured
    before any rank starts."""
    run_dir, mark = tmp_path / "run", tmp_path / "importing"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "task=swallowed",
            "task.modules=[wf_swallow_tasks]",
            "engine.dp_size=2",
            f"hydra.run.dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env({"WF_TEST_SWALLOW_S": "30", "WF_TEST_SWALLOW_MARK": str(mark)}),
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the task module was never imported"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert not (run_dir / "logs" / "rank0.log").exists(), err  # no rank started
    if (run_dir / "result.json").exists():
        assert result(run_dir)["status"] == "interrupted"
    assert leftover_processes(str(run_dir)) == []


# ------------------------------------------------------------------ what the run says of itself
def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until rank 0 has published ``step`` (its progress file), or the launch ended."""
    path = run_dir / "logs" / "rank0.progress.json"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if json.loads(path.read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"step {step} never reached in {run_dir}")


@pytest.mark.slow
def test_status_names_a_ctrl_c_and_a_resume_shows_its_new_total_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train = ["task=train", "engine.dp_size=2", "task.step_sleep_s=0.3", "task.checkpoint_every=2"]
    proc = start_cli([*train, "task.steps=40"], run_dir)
    try:
        _wait_for_step(run_dir, 4, proc)
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    resumed = run_cli([*train, "task.steps=8", "launcher.resume=true"], run_dir)
    assert resumed.returncode == 0, resumed.stderr
    status = run_python_m(
        "wf_launch.status",
        [str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert "attempt 0: launch;" in status.stdout, status.stdout
    assert "ended by stop flag: SIGINT (Ctrl-C)" in status.stdout, status.stdout
    assert "attempt 1: stop flag: SIGINT (Ctrl-C);" in status.stdout, status.stdout
    assert "SIGTERM" not in status.stdout, status.stdout
    totals = re.findall(r"\[wf_launch\] INFO +step \d+/(\d+)", resumed.stderr)
    assert totals and set(totals) == {"8"}, resumed.stderr  # never the stale 40


@pytest.mark.slow
def test_a_stall_warning_is_logged_at_warning_level(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "task=slow_steps",
            TASKS,
            "task.steps=2",
            "task.step_sleep_s=4",
            "launcher.stall_warning_s=1",
        ],
        run_dir,
    )
    assert proc.returncode == 0, proc.stderr
    stalls = [line for line in proc.stderr.splitlines() if "no progress for" in line]
    assert stalls and all("[wf_launch] WARNING " in line for line in stalls), proc.stderr
