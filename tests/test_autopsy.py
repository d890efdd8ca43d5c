"""Every hang comes with stacks: a stuck rank at a collective timeout, and a rank that never
joins."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cli_helpers import cli_env, leftover_processes, result, run_cli, run_python_m, status

pytestmark = pytest.mark.slow
TASKS = "task.modules=[wf_test_tasks]"


def test_a_collective_timeout_names_the_stuck_rank_and_where_it_is(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "task=misbehave",
            TASKS,
            "task.how=stuck",
            "task.rank=5",
            "task.sleep_s=120",
            "engine.cp_size=4",
            "engine.pp_size=2",
            "engine.distributed_timeout_minutes=0.1",
        ],
        run_dir,
    )
    assert proc.returncode == 1
    err = proc.stderr
    assert "collective timed out: rank 5 (r5 tp0 cp1 pp1 dp0) never arrived" in err
    assert "ranks 0-4,6,7 wait in barrier at " in err and "(misbehave)" in err
    assert (
        "rank 5 (tp0 cp1 pp1 dp0) is at " in err
        and 'in misbehave: time.sleep(cfg["sleep_s"])' in err
    )
    failure = result(run_dir)["failure"]
    assert failure["cause"] == "stuck" and failure["missing_ranks"] == [5]
    stuck = failure["stuck"]["5"]
    assert stuck["function"] == "misbehave" and stuck["frame"].startswith("wf_test_tasks.py:")
    assert Path(stuck["dump"]).is_file() and "time.sleep" not in stuck["dump"]
    assert "in misbehave" in Path(stuck["dump"]).read_text()
    assert leftover_processes(str(run_dir)) == []


def test_a_rank_that_never_joins_fails_start_up_with_its_stack(tmp_path: Path) -> None:
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    env = {**cli_env(), "WF_TEST_HANG_RANK": "3"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "task=after_hang",
            "task.modules=[wf_hang_at_import]",
            "engine.dp_size=4",
            "engine.init_timeout_s=15",
            "launcher.start_method=fork",  # ranks 0-2 arrive at once (see wf_hang_at_import)
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "3/4 ranks arrived; waiting for rank 3 (tp0 cp0 pp0 dp3)" in err
    assert (
        "start-up timed out after 15 s (engine.init_timeout_s): 3/4 ranks arrived; rank 3 never did"
        in err
    )
    assert "ranks 0-2 wait in init_process_group at " in err
    assert "rank 3 (tp0 cp0 pp0 dp3) is at " in err and "in _hang_here: time.sleep(600)" in err
    failure = result(run_dir)["failure"]
    assert failure["cause"] == "init_timeout" and failure["missing_ranks"] == [3]
    assert failure["stuck"]["3"]["function"] == "_hang_here"
    assert leftover_processes(str(run_dir)) == []


def test_status_stacks_groups_a_live_local_run(tmp_path: Path) -> None:
    import os
    import signal

    from cli_helpers import start_cli, wait_for_log

    run_dir = tmp_path / "run"
    proc = start_cli(
        [
            "task=misbehave",
            TASKS,
            "task.how=stuck",
            "task.rank=1",
            "task.sleep_s=120",
            "engine.dp_size=4",
        ],
        run_dir,
    )
    try:
        wait_for_log(run_dir / "logs" / "rank1.log", "ready")
        for r in range(4):
            wait_for_log(run_dir / "logs" / f"rank{r}.log", "ready")
        for _ in range(10):  # "ready" comes before the barriers: a dump may catch a rank between
            out = status("--stacks", str(run_dir))
            if out.returncode != 0 or (
                "ranks 0,2,3 wait in barrier at " in out.stdout and "time.sleep" in out.stdout
            ):
                break
            time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"stacks of 4/4 ranks of {run_dir}:" in out.stdout
    assert "ranks 0,2,3 wait in barrier at " in out.stdout
    assert (
        "rank 1 (tp0 cp0 pp0 dp1) is at " in out.stdout and "in misbehave: time.sleep" in out.stdout
    )


def test_status_follow_and_tail_on_a_local_run(tmp_path: Path) -> None:

    from cli_helpers import start_cli, wait_for_log

    run_dir = tmp_path / "run"
    proc = start_cli(
        [
            "task=misbehave",
            TASKS,
            "task.how=sleep_all",
            "task.sleep_s=4",
            "engine.dp_size=2",
            "launcher.console_ranks=[1]",
        ],
        run_dir,
    )
    wait_for_log(run_dir / "logs" / "rank1.log", "ready")
    follow = status("--follow", str(run_dir), timeout=120)
    proc.communicate(timeout=120)
    assert follow.returncode == 0, follow.stderr
    assert "[r1 tp0 cp0 pp0 dp1] sleeping" in follow.stderr and "[r0 " not in follow.stderr
    assert "run ok in " in follow.stderr and str(run_dir / "result.json") in follow.stderr
    tail = run_python_m(
        "wf_launch.status",
        ["--tail", "3", str(run_dir)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert tail.returncode == 0 and f"==> {run_dir / 'logs' / 'rank1.log'} <==" in tail.stdout
    assert len(tail.stdout.strip().splitlines()) == 4
