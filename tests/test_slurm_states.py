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
