"""How the SLURM launcher asks for job states: one sacct call for every job a wait watches
(submitit's watcher), and SLURM's other commands when accounting is missing.

SLURM's commands are small scripts on PATH that log each call and print what SLURM prints;
the launcher's code runs unchanged. The real cluster runs the same code in
test_slurm_launcher.py and test_slurm_hardening.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from wf_launch.launchers.slurm.poll import JobStates

SACCT_OUTPUT = "JobID|State|NodeList\n11|RUNNING|n1\n11.0|RUNNING|n1\n12|CANCELLED by 0|n2\n"


def _commands(tmp_path: Path, sacct: str, squeue: str = "") -> Path:
    """Scripts for sacct, squeue and scontrol that log each call to ``calls``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    scripts = {
        "sacct": sacct,
        "squeue": f"printf '{squeue}'" if squeue else "exit 0",
        "scontrol": "exit 1",
    }
    for name, body in scripts.items():
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{body}\n')
        path.chmod(0o755)
    return log


@pytest.fixture
def slurm_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def _calls(log: Path, name: str) -> list[str]:
    return [c for c in log.read_text().splitlines() if c.startswith(name)] if log.exists() else []


def test_one_sacct_call_answers_for_every_job(slurm_commands: Path) -> None:
    log = _commands(slurm_commands, f"printf '{SACCT_OUTPUT}'")
    states = JobStates()
    states.refresh(["11", "12"])
    assert states.state("11") == "RUNNING"
    assert states.state("12") == "CANCELLED by 0"
    (call,) = _calls(log, "sacct")
    assert "-j 11" in call and "-j 12" in call
    assert _calls(log, "squeue") == []


def test_without_accounting_squeue_answers_and_sacct_is_not_asked_every_poll(
    slurm_commands: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    log = _commands(
        slurm_commands,
        "echo 'sacct: error: Slurm accounting storage is disabled' >&2; exit 1",
        squeue="PENDING\\n",
    )
    states = JobStates()
    for _ in range(3):
        states.refresh(["11"])
        assert states.state("11") == "PENDING"
    assert len(_calls(log, "sacct")) == 1
    assert "Bypassing sacct error" not in capfd.readouterr().err


def test_a_job_whose_rank_0_died_before_recording_its_attempt_still_records_one(
    tmp_path: Path,
) -> None:
    """Rank 0 writes its attempt's marker once its groups are up; a peer killed at that moment
    takes the job step (and rank 0) down first. The ranks ran (they recorded where), so the final
    record has the attempt, closed by the launcher, not an empty ``attempts``."""
    import json
    import socket

    from wf_launch.launchers.slurm.poll import JOB_FILE, finalize
    from wf_launch.rundir import files

    (tmp_path / "logs").mkdir()
    job = {"job_id": "42", "world_size": 2, "submitted_at": 1.0, "folder": str(tmp_path)}
    (tmp_path / JOB_FILE).write_text(json.dumps(job))
    for rank in (0, 1):
        place = {"pid": 1000 + rank, "host": socket.gethostname(), "start": 1}
        files.rank_pid(tmp_path, rank).write_text(json.dumps(place))
    record = finalize(tmp_path, "CANCELLED by 0").record
    (attempt,) = record.attempts
    assert (attempt["attempt"], attempt["cause"]) == (0, "launch")
    assert attempt["ended_by"] == "SLURM CANCELLED by 0"
