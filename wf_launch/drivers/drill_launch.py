"""How a drill starts the CLI: one launch into a run directory, in its own session, its console
output in an owner-only log (the plain drill and the fault-tolerance drill alike)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..rank.progress import PUBLISH_ENV
from ..rundir.io import open_log

__all__ = ["launch_cli"]


def launch_cli(overrides: list[str], run_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    """``python -m wf_launch OVERRIDES`` into ``run_dir`` (its own session, output to ``log``);
    every rank publishes its progress at every step, so interruptions land at the step asked for."""
    env = {**os.environ, PUBLISH_ENV: "0"}
    with os.fdopen(open_log(log), "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "wf_launch", *overrides, f"hydra.run.dir={run_dir}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
