"""The CLI keeps its word: config mistakes exit 2 naming the field meant, Ctrl-C stops gracefully
and says how to resume, a run keeps one id across attempts, failures alike are shown once, the bar
is never broken by a log line, the drill refuses injections that prove nothing, and provenance is
recorded wherever the command starts."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from cli_helpers import (
    cli_env,
    leftover_processes,
    python_m,
    result,
    run_cli,
    run_python_m,
    start_cli,
)

from wf_launch.rank.progress import ProgressReporter
from wf_launch.readers.plot import expand_runs, run_labels

TASKS = "task.modules=[wf_identity_tasks]"
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ every config mistake exits 2
@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "engine.cp_sise=2",
            "engine.cp_sise=2 is not allowed: engine has no field 'cp_sise'; did you mean "
            "engine.cp_size=2?",
        ),
        (
            "+engine.cp_sise=2",
            "engine.cp_sise=2 is not allowed: no such field (did you mean engine.cp_size?)",
        ),
        (
            "task=nonexistent",
            "task=nonexistent is not allowed: choose one of ['call', 'demo', 'layout', 'noop', "
            "'script', 'train']",
        ),
        (
            "task=trian",
            "task=trian is not allowed: choose one of ['call', 'demo', 'layout', 'noop', "
            "'script', 'train']; did you mean task=train?",
        ),
        ("engine.pp_size=two", "engine.pp_size=two is not allowed: expected an integer"),
        (
            "engine.distributed_backend=cpu:gloo,cuda:nccl",
            "engine.distributed_backend=cpu:gloo,cuda:nccl is ambiguous: a comma makes a list or "
            "a sweep; for the string, quote it",
        ),
        (
            "task=task_schema",
            "task=task_schema is not allowed: task_schema is an internal schema, not an option",
        ),
        (
            "launcher=local_schema",
            "launcher=local_schema is not allowed: local_schema is an internal schema",
        ),
        (
            "tracking=nope",
            "tracking=nope is not allowed: choose one of ['mlflow', 'none', 'tensorboard', "
            "'wandb']",
        ),
        ("task.seed=${oops}", "task.seed: Interpolation key 'oops' not found"),
    ],
)
def test_every_config_mistake_exits_2_naming_what_was_meant(
    tmp_path: Path, override: str, needle: str
) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli([override], run_dir, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"wf_launch: config error: {needle}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "To append to your config use +" not in proc.stderr
    assert not (run_dir / "logs").exists()


def test_help_and_error_messages_offer_no_internal_schema() -> None:
    from wf_launch.cli import register_configs
    from wf_launch.config.overrides import group_options
    from wf_launch.rank.task_registry import load_task_modules

    load_task_modules()
    register_configs()
    tasks, launchers = (
        group_options("task"),
        group_options("launcher"),
    )  # other tests may register more
    assert {"demo", "layout", "noop", "train"} <= set(tasks) and not any(
        t.endswith("_schema") for t in tasks
    )
    assert {"local", "slurm"} <= set(launchers) and not any(
        t.endswith("_schema") for t in launchers
    )
    assert group_options("tracking") == ["mlflow", "none", "tensorboard", "wandb"]


# ------------------------------------------------------------------ Ctrl-C
def _wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "logs" / "rank0.progress.json"
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"step {step} never reached in {run_dir}")


@pytest.mark.slow
def test_ctrl_c_stops_through_the_stop_flag_saves_and_the_printed_command_resumes(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    args = ["task=train", "engine.dp_size=2", "task.steps=10", "task.step_sleep_s=0.25"]
    proc = start_cli(args, run_dir)
    try:
        _wait_for_step(run_dir, 3)
        os.killpg(
            proc.pid, signal.SIGINT
        )  # Ctrl-C reaches the terminal's whole foreground process group
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Ctrl-C: every rank stops at its next step boundary" in err and "Traceback" not in err
    record = result(run_dir)
    assert record["status"] == "interrupted" and record["signal"] == "SIGINT"
    stopped_at = record["attempts"][-1]["last_step"]
    assert record["attempts"][-1]["ended_by"] == "stop flag: SIGINT" or record["attempts"][-1][
        "ended_by"
    ].startswith("stop flag")
    assert (
        run_dir / "checkpoints" / f"step_{stopped_at:08d}" / "COMMIT"
    ).is_file()  # the task saved
    hint = re.search(
        r"continue it from its checkpoint of step (\d+): (python -m wf_launch .*)$", err, re.M
    )
    assert hint and int(hint.group(1)) == stopped_at, err
    assert "launcher.resume=true" in hint.group(2) and f"hydra.run.dir={run_dir}" in hint.group(2)
    again = subprocess.run(
        [sys.executable, *hint.group(2).split()[1:]],
        capture_output=True,
        text=True,
        timeout=180,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert again.returncode == 0, again.stderr
    assert result(run_dir)["attempts"][-1]["resumed_from"] == stopped_at
    assert leftover_processes(str(run_dir)) == []


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_cli(["task=slow_steps", TASKS, "task.step_sleep_s=20"], run_dir)  # a step: 20 s
    try:
        _wait_for_step(run_dir, 1, timeout=180)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(1.0)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and stopped_in < 12, (
        stopped_in,
        err,
    )  # not the 20 s step, nor the 30 s grace
    assert result(run_dir)["status"] == "interrupted" and leftover_processes(str(run_dir)) == []


@pytest.mark.slow
def test_ctrl_c_while_the_run_starts_leaves_a_record_and_no_traceback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_cli(["task=train", "engine.dp_size=2"], run_dir)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "config.yaml").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(
            proc.pid, signal.SIGINT
        )  # the launcher is still importing what the ranks will need
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (
        proc.returncode == 130 and "Traceback" not in err and len(err.strip().splitlines()) <= 6
    ), err
    record = result(run_dir)
    assert record["status"] == "interrupted" and record["exit_code"] == 130
    status = run_python_m(
        "wf_launch.status",
        [str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert status.returncode == 130 and "interrupted" in status.stdout, status.stdout


# ------------------------------------------------------------------ one run id
@pytest.mark.slow
def test_a_run_keeps_its_id_across_a_restart_and_a_resume_and_each_sweep_point_has_its_own(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    first = run_cli(["task=whoami", TASKS, "engine.dp_size=2", "task.fail_attempt=0"], run_dir)
    assert first.returncode == 1
    run_id = (run_dir / "run_id").read_text().strip()
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{8}", run_id) and result(run_dir)["run_id"] == run_id
    refused = run_cli(["task=whoami", TASKS, "engine.dp_size=2"], run_dir)
    assert (
        refused.returncode == 2
        and "or continue it from the start (it saved no checkpoint): python -m "
        "wf_launch task=whoami"
        in refused.stderr
        and "launcher.resume=true" in refused.stderr
    ), refused.stderr
    resumed = run_cli(
        ["task=whoami", TASKS, "engine.dp_size=2", "task.fail_attempt=0", "launcher.resume=true"],
        run_dir,
    )
    assert resumed.returncode == 0, resumed.stderr
    record = result(run_dir)
    assert record["run_id"] == run_id and (run_dir / "run_id").read_text().strip() == run_id
    assert [(r["run_id"], r["env"], r["attempt"]) for r in record["results"].values()] == [
        (run_id, run_id, 1)
    ] * 2
    env = json.loads(
        (run_dir / "environment.json").read_text()
    )  # started outside any checkout: the code's commit
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    assert env["cwd"] == str(tmp_path) and env["git_commit"] == head
    assert env["sources"]["task.modules[0]"]["path"].endswith("wf_identity_tasks.py")
    sweep = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "-m",
            "task=whoami",
            TASKS,
            "engine.dp_size=1,2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert sweep.returncode == 0, sweep.stderr
    ids = [result(tmp_path / "sweep" / p)["results"]["0"]["run_id"] for p in ("0", "1")]
    assert len(set(ids)) == 2 and run_id not in ids


# ------------------------------------------------------------------ a console a person can read
@pytest.mark.slow
def test_ranks_failing_alike_are_shown_once_with_one_traceback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["task=fail_alike", TASKS, "engine.dp_size=6", "task.odd=[4]"], run_dir, timeout=180
    )
    assert proc.returncode == 1
    err = proc.stderr
    assert err.count("ranks 0-3,5 (5 ranks) failed alike: ValueError: bad shape [4, 4]") == 1, err
    assert (
        err.count("rank 4 (r4 tp0 cp0 pp0 dp4) failed") == 1
        and "TypeError: rank 4 got a str" in err
    )
    assert err.count("Traceback (most recent call last)") == 2, err  # one per distinct failure
    assert err.count("raise ValueError") == 1 and len(err.splitlines()) < 40, err
    for rank in range(6):  # the rank logs keep everything
        assert (
            "Traceback (most recent call last)"
            in (run_dir / "logs" / f"rank{rank}.log").read_text()
        )


def _render(raw: bytes) -> list[str]:
    """The screen a terminal shows for ``raw``: carriage returns, line feeds, erase-to-end, colours
    ignored."""
    lines, row, col = [[]], 0, 0
    text = re.sub(r"\x1b\[[0-9;?]*m", "", raw.decode("utf-8", "replace"))
    i = 0
    while i < len(text):
        ch = text[i]
        if text.startswith("\x1b[K", i):
            del lines[row][col:]
            i += 3
            continue
        if text.startswith("\x1b[A", i):
            row = max(0, row - 1)
            i += 3
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            if row == len(lines):
                lines.append([])
        else:
            line = lines[row]
            line.extend(" " * (col - len(line)))
            line[col : col + 1] = [ch]
            col += 1
        i += 1
    return ["".join(line).rstrip() for line in lines]


def _in_a_terminal(args: list[str], cwd: Path, timeout: float = 180) -> tuple[int, bytes]:
    master, slave = pty.openpty()
    fcntl.ioctl(
        slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 400, 0, 0)
    )  # wide: no line wraps
    proc = python_m(
        "wf_launch",
        [*args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=cli_env(),
        cwd=cwd,
        start_new_session=True,
    )
    os.close(slave)
    raw, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            raw += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), raw


@pytest.mark.slow
def test_the_progress_bar_is_never_broken_by_log_lines_and_ends_once_in_a_terminal(
    tmp_path: Path,
) -> None:
    code, raw = _in_a_terminal(
        [
            "task=chatty",
            TASKS,
            "engine.dp_size=2",
            "task.steps=24",
            "task.step_sleep_s=0.1",
            "task.say_every=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        tmp_path,
    )
    assert code == 0, raw.decode(errors="replace")[-2000:]
    screen = [line for line in _render(raw) if line]
    bars = [line for line in screen if "%|" in line]
    assert bars, screen
    assert all(
        line.startswith("wf_launch:") and "[r" not in line.split("|", 2)[-1] for line in bars
    ), bars
    assert len([line for line in bars if "100%|" in line]) == 1 and bars[-1].startswith(
        "wf_launch: 100%|"
    ), bars
    said = [line for line in screen if "chatty step" in line]
    assert len(said) == 24 and all(
        re.match(r"\d\d:\d\d:\d\d\.\d{3} \[r[01] ", line) for line in said
    ), said
    assert (
        screen[-1].endswith(f"run ok in {screen[-1].split('run ok in ')[1]}")
        and "result.json" in screen[-1]
    )


# ------------------------------------------------------------------ several runs on one chart
def test_plot_draws_a_sweeps_points_on_one_chart_named_by_their_overrides(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for point, dp in ((0, 1), (1, 2)):
        run = sweep / str(point)
        (run / "logs").mkdir(parents=True)
        (run / "overrides.yaml").write_text(f"- task=train\n- engine.dp_size={dp}\n")
        rep = ProgressReporter(run, 0)
        for step in range(1, 21):
            rep(step, 20, loss=1.0 / (step + dp))
        rep.close()
    runs = expand_runs([sweep])
    assert runs == [sweep / "0", sweep / "1"]
    assert run_labels(runs) == {sweep / "0": "engine.dp_size=1", sweep / "1": "engine.dp_size=2"}
    proc = run_python_m(
        "wf_launch.plot",
        [str(sweep), "loss"],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert proc.returncode == 0, proc.stderr
    png = sweep / "metrics.png"
    assert (
        proc.stdout.strip() == str(png)
        and png.read_bytes()[:4] == b"\x89PNG"
        and png.stat().st_size > 10_000
    )
    both = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch.plot",
            str(sweep / "0"),
            str(sweep / "1"),
            "--out",
            str(tmp_path / "two.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
    )
    assert both.returncode == 0 and (tmp_path / "two.png").is_file(), both.stderr


# ------------------------------------------------------------------ the drill proves something
@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (
            ["task=train", "engine.dp_size=2", "--inject", "kill9@6,sigterm@10"],
            2,
            "--inject sigterm@10: the task runs task.steps=10 steps and its stop is agreed a step "
            "later",
        ),
        (["task=train", "task.steps=20", "--inject", "kill9@25"], 2, "choose a step <= 19"),
        (
            ["task=train", "task.steps=20", "task.checkpoint_every=8", "--inject", "kill9@6"],
            2,
            "--inject kill9@6: no checkpoint precedes it (task.checkpoint_every=8)",
        ),
        (
            ["task=train", "task.steps=20", "--inject", "kill9@6,sigterm@12"],
            0,
            "so the drill sets task.checkpoint_every=2 (for both runs)",
        ),
        (
            ["task=train", "task.steps=20", "--inject", "sigterm@4,kill9@6"],
            0,
            "interruptions: sigterm@4, kill9@6",
        ),
        (
            ["task=train", "engine.dp_sise=2", "--inject", "kill9@3"],
            2,
            "did you mean engine.dp_size=2?",
        ),
    ],
)
def test_the_drill_refuses_injections_that_prove_nothing(
    tmp_path: Path, args: list[str], code: int, needle: str
) -> None:
    proc = run_python_m(
        "wf_launch.drill",
        [*args, "--dry-run", "--dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert needle in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "d").exists()
