"""A waiting SLURM launcher shows its run live: queue state, the console ranks' lines, progress, a final line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import USER_TASKS
from slurm_fixture import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_slurm_wait_shows_state_rank_lines_and_the_final_line(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    env = dict(slurm_cluster.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "wf_launch", "launcher=slurm", "engine.cp_size=2",
                           "launcher.console_ranks=[0]", "launcher.progress_interval_s=0.1",
                           "launcher.poll_interval_s=0.2", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    job = (run_dir / "slurm_job.json").read_text()
    assert "SLURM job " in err and ": RUNNING on " in err, err
    assert "[r0 tp0 cp0 pp0 dp0] demo: " in err, err
    assert "[r1 tp0 cp1 pp0 dp0]" not in err
    assert "run ok in " in err and f"{run_dir / 'result.json'}" in err and job
