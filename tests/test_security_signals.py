"""Pids and job ids read from a run's files are checked before any signal is sent (issue 19, item
5)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import status

from wf_launch.observe.stacks import local_pids, trigger
from wf_launch.rundir.pids import live_rank_pid, pid_record, process_start

LOCAL_CONFIG = (
    "launcher: {name: local}\nengine: {tp_size: 1, cp_size: 1, pp_size: 1, dp_size: 4, "
    "order: tp-cp-pp-dp}\ntask: {name: noop}\n"
)


def _pid_file(run_dir: Path, rank: int, **fields: object) -> Path:
    path = run_dir / "logs" / f"rank{rank}.pid"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": socket.gethostname(), "main_thread": 1, **fields}))
    return path


@pytest.fixture
def sleeper() -> subprocess.Popen:
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def test_group_and_broadcast_pids_are_never_signalled(tmp_path: Path) -> None:
    for rank, pid in enumerate((0, -1, 1, os.getpid())):
        _pid_file(tmp_path, rank, pid=pid)
    assert local_pids(tmp_path, 4) == {}
    sent: list[tuple[int, int]] = []
    assert trigger({0: 0, 1: -1, 2: 1}, sender=lambda pid, sig: sent.append((pid, sig))) == set()
    assert sent == []


def test_a_stale_or_reused_pid_is_not_the_rank(tmp_path: Path, sleeper: subprocess.Popen) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    _pid_file(tmp_path, 0, pid=dead.pid, start=1)
    _pid_file(
        tmp_path, 1, pid=sleeper.pid, start=(process_start(sleeper.pid) or 0) + 7
    )  # reused: another start
    old = _pid_file(
        tmp_path, 2, pid=sleeper.pid
    )  # no start recorded, and written before the process began
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    _pid_file(tmp_path, 3, pid=sleeper.pid, host="another-host", start=process_start(sleeper.pid))
    assert [live_rank_pid(tmp_path, r) for r in range(4)] == [None, None, None, None]
    assert local_pids(tmp_path, 4) == {}


def test_the_ranks_own_record_is_its_live_process(
    tmp_path: Path, sleeper: subprocess.Popen
) -> None:
    _pid_file(
        tmp_path, 0, **{**pid_record(), "pid": sleeper.pid, "start": process_start(sleeper.pid)}
    )
    _pid_file(
        tmp_path, 1, pid=sleeper.pid
    )  # an older file without a start time, written after it began
    assert local_pids(tmp_path, 4) == {0: sleeper.pid, 1: sleeper.pid}
    assert pid_record()["start"] == process_start(os.getpid())


def test_status_stacks_never_signals_a_pid_from_a_bad_pid_file(
    tmp_path: Path, sleeper: subprocess.Popen
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(LOCAL_CONFIG)
    for rank, pid in enumerate((0, -1, sleeper.pid)):
        _pid_file(run_dir, rank, pid=pid, start=1)
    proc = status("--stacks", str(run_dir))
    assert proc.returncode == 1 and "no running rank of" in proc.stdout, proc.stdout + proc.stderr
    assert sleeper.poll() is None


def test_slurm_signals_go_only_to_a_checked_job_id(tmp_path: Path) -> None:
    from wf_launch.launchers import get_launcher

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(LOCAL_CONFIG.replace("local", "slurm"))
    (run_dir / "slurm_job.json").write_text(json.dumps({"job_id": "--user=alice", "world_size": 4}))
    shims = tmp_path / "bin"
    shims.mkdir()
    for tool in ("scancel", "sacct", "squeue", "scontrol"):
        (shims / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {tmp_path / "calls"}\n')
        (shims / tool).chmod(0o755)
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{shims}{os.pathsep}{path}"
    try:
        with pytest.raises(ValueError, match="'--user=alice' is not a SLURM job id"):
            get_launcher("slurm").signal_ranks(run_dir, signal.SIGUSR2)
    finally:
        os.environ["PATH"] = path
    assert not (tmp_path / "calls").exists()
