"""A torchrun script's hang is explained (issue 30, section 2): the engine's timeout, when the user
sets it, is the default timeout of the groups the script makes, and ranks that do not stop after
a SIGTERM are shown where they are before they are killed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from cli_helpers import leftover_processes, result, run_cli, start_cli, wait_for_log

pytestmark = pytest.mark.slow

HANG = Path(__file__).parent / "scripts" / "hang_on_rank.py"


def test_the_engine_timeout_is_the_default_of_the_groups_a_script_makes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_cli(
        [
            "task=script",
            f"task.path={HANG}",
            "task.args=[--rank,1,--timeout-s,0,--sleep-s,150]",  # init_process_group("gloo")
            "engine.dp_size=2",
            "engine.distributed_timeout_minutes=0.05",
        ],
        run_dir,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 140  # explained before the stuck rank woke up
    failure = result(run_dir)["failure"]
    assert failure["cause"] == "stuck" and failure["missing_ranks"] == [1], failure
    assert failure["stuck"]["1"]["function"] == "slow_data_loader", failure
    assert "collective timed out: rank 1 (r1 tp0 cp0 pp0 dp1) never arrived" in proc.stderr


def test_ranks_that_do_not_stop_after_a_sigterm_are_shown_where_they_are_before_the_kill(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    proc = start_cli(
        [
            "task=slow_steps",
            "task.modules=[wf_identity_tasks]",
            "task.step_sleep_s=60",  # polls the stop flag once a minute
            "engine.dp_size=2",
            "launcher.shutdown_timeout_s=15",
        ],
        run_dir,
    )
    try:
        for rank in (0, 1):
            wait_for_log(run_dir / "logs" / f"rank{rank}.progress.json", "step", timeout=180)
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "2 rank(s) still running 5 s after the SIGTERM; where they are" in err, err[-3000:]
    assert "ranks 0,1 are at wf_identity_tasks.py:" in err and "in slow_steps" in err, err[-3000:]
    assert result(run_dir)["status"] == "interrupted"
    assert leftover_processes(str(run_dir)) == []
