"""What the ``ft=torchft`` tests on the Ray and SLURM test clusters share: the run, the drill of
two faults of one replica group, and a SIGTERM to a live run."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli_helpers import python_m, run_python_m

from wf_launch.rundir import files

FT = [
    "task=train",
    "ft=torchft",
    "ft.replicas=2",
    "task.steps=50",
    "task.step_sleep_s=0.4",
    "ft.timeout_s=5",
    "ft.hang_timeout_s=4",
    "ft.quorum_timeout_s=30",
    "launcher.console_ranks=[]",
]
"""Two replica groups of one rank (FSDP2 inside a group is the local tests'), 50 steps of 0.4 s:
time for both faults and their heals before the survivor ends (a group back after that has no
peer to heal from)."""
INJECT = "kill9:replica1@4,hang:replica1@14"
DRILL_TIMEOUT_S = 500
"""The drill's own limit. Beside 2 busy processes on 2 cores, each of group 1's restarts on Ray
takes about 100 s (unloaded 4 s) and the whole drill 389 to 398 s."""


def drill_two_faults(
    backend: str, overrides: list[str], env: dict[str, str], tmp_path: Path
) -> dict[str, Any]:
    """The drill of :data:`INJECT`, which must pass; the interrupted run's ``result.json``,
    checked for what every launcher must give: both faults recovered by a heal from group 0,
    no survivor restarted, equal weights, every step done. Without a reference run: the loss
    against one is the same arithmetic on every launcher, which tests/test_ft.py's drill
    checks."""
    directory = tmp_path / "drill"
    argv = [*FT, *overrides, "--backend", backend, "--inject", INJECT, "--dir", str(directory)]
    argv.append("--no-reference")
    proc = run_python_m(
        "wf_launch.drill",
        [*argv, "--timeout", str(DRILL_TIMEOUT_S)],
        capture_output=True,
        text=True,
        timeout=DRILL_TIMEOUT_S + 80,
        env=env,
        cwd=tmp_path,
    )
    log = (directory / "interrupted.log").read_text()[-4000:] if directory.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:] + log
    assert "ft drill: PASS" in proc.stdout
    assert "no reference run" in proc.stdout and not (directory / "reference").exists()
    record = json.loads((directory / "interrupted" / "result.json").read_text())
    assert record["status"] == "ok" and record["launcher"] == backend
    section = record["ft"]
    assert [(r["replica"], r["rank"]) for r in section["recoveries"]] == [(1, 0), (1, 0)]
    assert section["recoveries"][1]["cause"] == "hang"
    assert all(r["healed_from"] == 0 for r in section["recoveries"]), section["recoveries"]
    assert section["survivor_restarts"] == 0 and section["weights_equal"]
    assert section["steps_completed"] == {"0": 50, "1": 50}
    return record


def steps_of(run: Path, k: int) -> int:
    """How many steps replica group ``k`` reported so far (every attempt's)."""
    steps = files.metrics_file(files.ft_replica_dir(run, k))
    return steps.read_text().count("\n") if steps.exists() else 0


def sigterm_while_running(
    overrides: list[str],
    env: dict[str, str],
    tmp_path: Path,
    before_sigterm: Callable[[Path, subprocess.Popen[str]], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """A long run; ``status`` once replica group 1 stepped (it must show the group), then
    ``before_sigterm(run, launch)`` if given, then SIGTERM to the launch, which must record the
    run ``interrupted`` with the command that resumes it; (the run directory, its
    ``result.json``)."""
    run = tmp_path / "run"
    argv = [*FT, *overrides, "task.steps=400", "task.step_sleep_s=0.1", "task.checkpoint_every=4"]
    proc = python_m(
        "wf_launch",
        [*argv, f"hydra.run.dir={run}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and steps_of(run, 1) < 6:
            time.sleep(0.2)
        status = run_python_m(
            "wf_launch.status", [str(run)], capture_output=True, text=True, env=env, timeout=60
        )
        assert "replica group 1" in status.stdout, status.stdout + status.stderr
        if before_sigterm is not None:
            before_sigterm(run, proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    record = json.loads((run / "result.json").read_text())
    assert record["status"] == "interrupted", (record, out[-3000:])
    assert "launcher.resume=true" in record["failure"]["message"]
    assert set(record["ft"]["steps_completed"]) == {"0", "1"}
    return run, record
