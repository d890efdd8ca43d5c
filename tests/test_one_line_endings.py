"""The tools end with a line, never a traceback or a raw control byte (issue 29 item 11):
a closed pipe, a run directory whose name holds a non-UTF-8 byte, another user's run dir."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import run_cli

from wf_launch.rundir import files

REPO = Path(__file__).resolve().parents[1]
CSI_NAME = b"run\x9b31m"


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def test_checkpoint_list_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """``checkpoint list --json RUN | head -1``: the reader is gone before the first write."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = subprocess.run(
        [sys.executable, "-m", "wf_launch.checkpoint", "list", "--json", str(tmp_path)],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env=_env(),
    )
    os.close(write_end)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == -signal.SIGPIPE


@pytest.mark.parametrize("locale", ["C", "C.UTF-8"])
@pytest.mark.parametrize("tool", ["runs", "status", "plot"])
def test_a_non_utf8_run_name_is_escaped(tmp_path: Path, tool: str, locale: str) -> None:
    run = os.path.join(os.fsencode(tmp_path), CSI_NAME)
    os.mkdir(run)
    (Path(os.fsdecode(run)) / "metrics.jsonl").write_text(
        json.dumps({"rank": 0, "step": 1, "loss": 0.5}) + "\n"
    )
    config = files.config_path(os.fsdecode(run))
    config.parent.mkdir(exist_ok=True)
    config.write_text("launcher:\n  name: local\ntask:\n  target: demo\n")
    target = os.fsencode(tmp_path) if tool == "runs" else run
    proc = subprocess.run(
        [sys.executable.encode(), b"-m", f"wf_launch.{tool}".encode(), target],
        capture_output=True,
        timeout=120,
        env=_env(LC_ALL=locale),
    )
    out = proc.stdout + proc.stderr
    assert b"Traceback" not in out and proc.returncode in (0, 3), out
    assert b"\x9b" not in out and b"\xc2\x9b" not in out, out
    assert b"run\\x9b31m" in out, out


@pytest.fixture
def other_user() -> Iterator[int]:
    """A second Unix user (created with useradd, removed after); skipped unless root."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to create a second user")
    name = f"wfh2{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def test_a_launch_into_another_users_open_dir_is_one_line(tmp_path: Path, other_user: int) -> None:
    """A 0777 run directory pre-created by another user: refused in one line, nothing written."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.chown(run_dir, other_user, other_user)
    os.chmod(run_dir, 0o777)
    proc = run_cli(["task=noop"], run_dir)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert (
        f"run directory {run_dir} belongs to" in proc.stderr and "not to this user" in proc.stderr
    )
    assert not (run_dir / files.LOCK).exists() and not (run_dir / files.RESULT).exists()
