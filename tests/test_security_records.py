"""Run files written by a crash, a full disk or someone else: status, runs, plot and the sweep
report read them without crashing, hanging or printing a terminal escape sequence (issue 19, items
6, 14, 15)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import cli_env

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_rundirs.py"
_spec = importlib.util.spec_from_file_location("fuzz_rundirs", _SCRIPT)
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_rundirs"] = fuzz
_spec.loader.exec_module(fuzz)

ESC_TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J"


@pytest.fixture
def tree(tmp_path: Path) -> dict[str, Path]:
    """The fuzzer's templates: local ok / failed runs, a detached SLURM run, a sweep of two
    points."""
    return fuzz.build(tmp_path)


@pytest.fixture
def shims(tmp_path: Path) -> dict[str, str]:
    """SLURM's commands fail at once (no scheduler), and every call is logged."""
    where = tmp_path / "bin"
    where.mkdir()
    for tool in fuzz.SHIMS:
        (where / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {where / "calls"}\nexit 1\n')
        (where / tool).chmod(0o755)
    return cli_env({"PATH": f"{where}{os.pathsep}{os.environ['PATH']}"})


def _tool(
    name: str, args: list[str], env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"wf_launch.{name}", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _edit(path: Path, **fields: object) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data))


def _no_traceback(proc: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_record_with_a_wrong_type_is_listed_unreadable_and_the_others_go_on(
    tree: dict[str, Path], shims: dict[str, str]
) -> None:
    _edit(tree["ok"] / "result.json", task=5)
    _edit(tree["failed"] / "result.json", failure="boom")
    runs = _tool("runs", [str(tree["ok"].parent), "--json"], shims)
    _no_traceback(runs)
    rows = {Path(r["run_dir"]).name: r for r in json.loads(runs.stdout)}
    assert rows["ok"]["status"] == "unreadable" and "field 'task' is a int" in rows["ok"]["problem"]
    assert (
        rows["failed"]["status"] == "unreadable"
        and "field 'failure' is a str" in rows["failed"]["problem"]
    )
    assert rows["slurm"]["status"] == "submitted"
    for name, field in (("ok", "task"), ("failed", "failure")):
        status = _tool("status", [str(tree[name])], shims)
        _no_traceback(status)
        assert f"{tree[name]}: unreadable: {tree[name] / 'result.json'}" in status.stdout, (
            status.stdout
        )
        assert f"field {field!r}" in status.stdout


def test_a_stray_attempt_number_is_read_once_and_a_bad_marker_is_named(
    tree: dict[str, Path], shims: dict[str, str]
) -> None:
    run = tree["failed"]
    (run / "logs" / "attempt999999999.json").write_text(
        json.dumps({"attempt": 999999999, "last_step": 3})
    )
    _edit(run / "logs" / "attempt1.json", last_step="x")
    _edit(run / "result.json", attempts=[])  # the markers, not the record's list, are shown
    t0 = time.monotonic()
    proc = _tool("status", [str(run)], shims)
    assert time.monotonic() - t0 < 30
    _no_traceback(proc)
    assert (
        f"unreadable: {run / 'logs' / 'attempt1.json'}, last_step='x' is not a step" in proc.stdout
    ), proc.stdout
    assert "attempt 999999999: " in proc.stdout


def test_a_malformed_slurm_job_file_is_named_and_never_reaches_slurm(
    tree: dict[str, Path], shims: dict[str, str]
) -> None:
    job = tree["slurm"] / "slurm_job.json"
    for value, why in (
        (
            json.dumps({"job_id": "4242", "world_size": "x"}),
            "world_size='x' is not a number of ranks",
        ),
        ("[1, 2]", "expected a JSON object, found list"),
        (json.dumps({"job_id": "--user=alice"}), "is not a SLURM job id"),
    ):
        job.write_text(value)
        proc = _tool("status", [str(tree["slurm"].parent)], shims)
        _no_traceback(proc)
        assert f"{tree['slurm']}: unreadable: " in proc.stdout and why in proc.stdout, proc.stdout
        assert f"{tree['ok']}: local run ended -> ok" in proc.stdout
    calls = Path(shims["PATH"].split(os.pathsep)[0]) / "calls"
    assert not calls.exists() or "scancel" not in calls.read_text()


def test_escape_sequences_a_run_wrote_never_reach_the_terminal(
    tree: dict[str, Path], shims: dict[str, str]
) -> None:
    run = tree["failed"]
    _edit(
        run / "result.json",
        task=f"tick{CLEAR}er",
        failure={
            "rank": 1,
            "cause": "exception",
            "type": "ValueError",
            "message": f"bad batch{ESC_TITLE}{CLEAR}\x9b31m 17",
            "log": f"x{ESC_TITLE}",
        },
    )
    with open(run / "logs" / "rank0.log", "a") as f:
        f.write(f"12:00:01 | INFO | [r0 tp0 cp0 pp0 dp0] x | hello{ESC_TITLE}{CLEAR}\r\n")
    outputs = {
        "status": _tool("status", [str(run)], shims),
        "status --tail": _tool("status", [str(run), "--tail", "2"], shims),
        "status --follow": _tool("status", [str(run), "--follow", "--tail", "2"], shims),
        "runs": _tool("runs", [str(run.parent)], shims),
    }
    for name, proc in outputs.items():
        _no_traceback(proc)
        text = proc.stdout + proc.stderr
        assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text, f"{name}: {text!r}"
    assert "bad batch\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m 17" in outputs["status"].stdout
    assert "hello\\x1b]0;pwned" in outputs["status --tail"].stdout
    assert "hello\\x1b]0;pwned" in outputs["status --follow"].stderr
    assert "tick\\x1b[2Jer" in outputs["runs"].stdout


@pytest.mark.timeout(60)
def test_a_fifo_or_device_in_place_of_a_run_file_never_blocks(
    tree: dict[str, Path], shims: dict[str, str]
) -> None:
    run = tree["ok"]
    (run / "result.json").unlink()
    os.mkfifo(run / "result.json")
    (run / "logs" / "rank0.log").unlink()
    os.mkfifo(run / "logs" / "rank0.log")
    (run / "metrics.jsonl").unlink()
    os.symlink("/dev/zero", run / "metrics.jsonl")
    status = _tool("status", [str(run)], shims, timeout=30)
    assert "not a regular file" in status.stdout, status.stdout
    for args in (["--tail", "3"], ["--follow", "--timeout", "0.5"]):
        _no_traceback(_tool("status", [str(run), *args], shims, timeout=30))
    plot = _tool("plot", [str(run)], shims, timeout=30)
    assert plot.returncode == 2 and "no metrics" in plot.stderr
