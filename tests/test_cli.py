"""The product, through its real CLI: runs, failures, interrupts, configs, concurrency."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from cli_helpers import (
    cli_env,
    leftover_processes,
    result,
    run_cli,
    run_python_m,
    start_cli,
    wait_for_log,
)

pytestmark = pytest.mark.slow
TASKS = "task.modules=[wf_test_tasks]"


def _no_leftovers(run_dir: Path) -> None:
    assert leftover_processes(str(run_dir)) == []


def test_default_run_is_the_demo_and_records_everything(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli([], run_dir)
    assert proc.returncode == 0, proc.stderr
    res = result(run_dir)
    assert res["status"] == "ok" and res["task"] == "demo" and res["exit_code"] == 0
    assert res["layout"]["world_size"] == 1
    assert res["results"]["0"]["ok"] is True
    assert res["environment"]["torch"] and res["environment"]["python"]
    assert (run_dir / "config.yaml").read_text().startswith("engine:")
    assert (run_dir / ".hydra" / "overrides.yaml").exists()
    assert (run_dir / "launcher.log").exists() and (run_dir / "logs" / "rank0.log").exists()
    _no_leftovers(run_dir)


def test_eight_rank_demo_cp4_pp2_matches_reference(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(["engine.cp_size=4", "engine.pp_size=2"], run_dir)
    assert proc.returncode == 0, proc.stderr
    res = result(run_dir)
    assert res["layout"] == {
        "tp": 1,
        "cp": 4,
        "pp": 2,
        "dp": 1,
        "order": "tp-cp-pp-dp",
        "world_size": 8,
    }
    holders = [r for r in res["results"].values() if "max_abs_err" in r]
    assert holders and all(r["max_abs_err"] < 1e-4 and r["ok"] for r in holders)
    assert sorted(res["timings"]["ranks"]) == [str(r) for r in range(8)]
    logs = sorted(p.name for p in (run_dir / "logs").glob("rank*.log"))
    assert logs == [f"rank{r}.log" for r in range(8)]
    assert "[r5 tp0 cp1 pp1 dp0]" in (run_dir / "logs" / "rank5.log").read_text()
    _no_leftovers(run_dir)


def test_layout_task_prints_table_and_checks_every_group(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["task=layout", "engine.tp_size=2", "engine.pp_size=2", "engine.order=tp-pp-dp"], run_dir
    )
    assert proc.returncode == 0, proc.stderr
    res = result(run_dir)
    assert res["results"]["0"]["ok"] is True
    assert "rank" in proc.stdout and "tp" in proc.stdout


def test_user_task_from_a_module_outside_the_package(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["task=echo", TASKS, "engine.cp_size=2", "engine.dp_size=2", "launcher.console_ranks=[0]"],
        run_dir,
    )
    assert proc.returncode == 0, proc.stderr
    res = result(run_dir)
    assert {r["rank"] for r in res["results"].values()} == {0, 1, 2, 3}
    assert res["results"]["3"]["cp_ranks"] == [2, 3] and res["results"]["3"]["coords"]["dp"] == 1
    assert "[r0 " in proc.stderr and "[r1 " not in proc.stderr  # console_ranks filters the console
    assert (
        "hello from rank 1" in (run_dir / "logs" / "rank1.log").read_text()
    )  # files get everything


def test_spawn_start_method_runs_the_same_entrypoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(["task=echo", TASKS, "engine.cp_size=2", "launcher.start_method=spawn"], run_dir)
    assert proc.returncode == 0, proc.stderr
    assert result(run_dir)["results"]["1"]["cp_ranks"] == [0, 1]


def test_failing_rank_ends_the_job_and_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_cli(
        [
            "task=misbehave",
            TASKS,
            "task.how=raise",
            "task.rank=2",
            "engine.cp_size=2",
            "engine.pp_size=2",
        ],
        run_dir,
    )
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 1
    assert (
        "rank 2 (r2 tp0 cp0 pp1 dp0) failed first: ValueError: rank 2 refuses: bad batch 17"
        in proc.stderr
    )
    assert str(run_dir / "logs" / "rank2.log") in proc.stderr
    res = result(run_dir)
    assert res["status"] == "failed" and res["exit_code"] == 1
    final = f"run failed in {res['timings']['wall_s']:.2f}s: {run_dir / 'result.json'}"
    assert final in proc.stderr and proc.stderr.index(final) < proc.stderr.index(
        "failed first: ValueError"
    )
    assert res["failure"]["rank"] == 2 and res["failure"]["type"] == "ValueError"
    assert res["failure"]["coords"] == {"tp": 0, "cp": 0, "pp": 1, "dp": 0}
    assert "bad batch 17" in (run_dir / "logs" / "rank2.log").read_text()
    _no_leftovers(run_dir)
    status = run_python_m(
        "wf_launch.status",
        [str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert status.returncode == 1, status.stderr
    assert status.stdout.startswith(f"{run_dir}: local run ended -> failed (exit 1)")
    assert (
        "rank 2 refuses: bad batch 17" in status.stdout
        and f"log: {run_dir / 'logs' / 'rank2.log'}" in status.stdout
    )


def test_a_user_error_that_mentions_timeout_blames_its_rank_not_healthy_peers(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["task=misbehave", TASKS, "task.how=raise_timeout_word", "task.rank=1", "engine.dp_size=4"],
        run_dir,
    )
    assert proc.returncode == 1
    failure = result(run_dir)["failure"]
    assert (
        failure["rank"] == 1 and failure["type"] == "ValueError" and failure["cause"] == "exception"
    )
    assert "missing_ranks" not in failure and "never arrived" not in proc.stderr
    assert (
        "rank 1 (r1 tp0 cp0 pp0 dp1) failed first: ValueError: rank 1: bad timeout value 0"
        in proc.stderr
    )
    _no_leftovers(run_dir)


def test_max_restarts_reruns_the_ranks_then_reports_the_last_attempt(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "task=misbehave",
            TASKS,
            "task.how=raise",
            "task.rank=1",
            "engine.cp_size=2",
            "launcher.max_restarts=1",
        ],
        run_dir,
    )
    assert proc.returncode == 1, proc.stderr
    assert result(run_dir)["failure"]["attempt"] == 1, result(run_dir)["failure"]
    assert (run_dir / "logs" / "rank1.log").read_text().count(
        "bad batch 17"
    ) >= 2  # both attempts kept
    _no_leftovers(run_dir)


def test_max_restarts_recovers_from_a_failed_attempt(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "task=misbehave",
            TASKS,
            "task.how=raise_first_attempt",
            "task.rank=1",
            "engine.cp_size=2",
            "launcher.max_restarts=1",
        ],
        run_dir,
    )
    assert proc.returncode == 0, proc.stderr
    assert result(run_dir)["status"] == "ok"
    assert "fails its first attempt" in (run_dir / "logs" / "rank1.log").read_text()
    _no_leftovers(run_dir)


def test_rank_killed_by_signal_is_named_with_the_signal(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["task=misbehave", TASKS, "task.how=kill", "task.rank=1", "engine.cp_size=4"], run_dir
    )
    assert proc.returncode == 1
    assert "rank 1 (r1 tp0 cp1 pp0 dp0) was killed by SIGKILL" in proc.stderr
    res = result(run_dir)
    assert res["failure"]["rank"] == 1 and res["failure"]["signal"] == "SIGKILL"
    placement = res[
        "placement"
    ]  # where each rank ran, recorded for a failed run too (the host is the node)
    assert (
        sorted(placement) == ["0", "1", "2", "3"]
        and placement["1"]["node"] == placement["1"]["host"]
    )
    assert all(isinstance(p["pid"], int) for p in placement.values())
    _no_leftovers(run_dir)


def test_stuck_rank_is_reported_at_the_distributed_timeout(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "task=misbehave",
            TASKS,
            "task.how=stuck",
            "task.rank=3",
            "task.sleep_s=120",
            "engine.cp_size=4",
            "engine.distributed_timeout_minutes=0.05",
        ],
        run_dir,
    )
    assert proc.returncode == 1
    assert "rank 3 (r3 tp0 cp3 pp0 dp0) never arrived" in proc.stderr
    res = result(run_dir)
    assert res["failure"]["cause"] == "stuck" and res["failure"]["missing_ranks"] == [3]
    _no_leftovers(run_dir)


def test_system_exit_in_a_rank_fails_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        ["task=misbehave", TASKS, "task.how=exit", "task.rank=0", "engine.cp_size=2"], run_dir
    )
    assert proc.returncode == 1
    assert result(run_dir)["failure"]["type"] == "SystemExit"


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_sigterm_or_ctrl_c_stops_every_rank_within_10s(tmp_path: Path, sig: int, code: int) -> None:
    run_dir = tmp_path / "run"
    proc = start_cli(
        ["task=misbehave", TASKS, "task.how=sleep_all", "task.sleep_s=300", "engine.cp_size=4"],
        run_dir,
    )
    try:
        for r in range(4):
            wait_for_log(run_dir / "logs" / f"rank{r}.log", "sleeping")
        t0 = time.monotonic()
        if sig == signal.SIGINT:
            import os

            os.killpg(proc.pid, sig)  # Ctrl-C reaches the whole foreground process group
        else:
            proc.send_signal(sig)
        proc.wait(timeout=15)
        assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code
    res = result(run_dir)
    assert res["status"] == "interrupted" and res["failure"]["signal"] == signal.Signals(sig).name
    _no_leftovers(run_dir)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("engine.cp_size=0", "engine.cp_size=0 is not allowed: expected an integer >= 1"),
        ("engine.distributed_backend=mpi", "engine.distributed_backend='mpi' is not allowed"),
        ("engine.order=tp-cp-xx", "engine.order='tp-cp-xx' is not allowed"),
        ("launcher.console_ranks=[5]", "launcher.console_ranks=[5] is not allowed"),
        (
            "task=nope",
            "task=nope is not allowed: choose one of ['call', 'demo', 'layout', 'noop', 'script', "
            "'train']",
        ),
        ("engine.pp_size=two", "engine.pp_size"),
        ("engine.cp_size=5", "engine.cp_size=5 cannot split the demo latent on patch boundaries"),
    ],
)
def test_bad_config_is_rejected_before_any_process_starts(
    tmp_path: Path, override: str, needle: str
) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli([override], run_dir, timeout=60)
    assert proc.returncode != 0
    assert needle in proc.stderr
    assert not (run_dir / "logs").exists()


def test_two_concurrent_launches_both_work(tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = [start_cli(["task=noop", "engine.cp_size=2", "engine.pp_size=2"], d) for d in dirs]
    for p in procs:
        p.wait(timeout=120)
    for p, d in zip(procs, dirs):
        assert p.returncode == 0, p.stderr.read() if p.stderr else ""
        assert result(d)["status"] == "ok"


def test_dry_run_prints_layout_and_plan_and_starts_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(["launcher.dry_run=true", "engine.cp_size=4", "engine.pp_size=2"], run_dir)
    assert proc.returncode == 0, proc.stderr
    assert "tp=1 cp=4 pp=2 dp=1 (order tp-cp-pp-dp, 8 ranks)" in proc.stdout
    assert "rendezvous    c10d at 127.0.0.1" in proc.stdout
    assert "0,1,2,3" in proc.stdout  # cp group members in the layout table
    assert not (run_dir / "logs").exists() and not (run_dir / "result.json").exists()


def test_hydra_cfg_job_and_help_work() -> None:

    from cli_helpers import cli_env

    cfg = run_python_m(
        "wf_launch",
        ["--cfg", "job", "engine.cp_size=4"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert (
        cfg.returncode == 0
        and "cp_size: 4" in cfg.stdout
        and "distributed_backend: auto" in cfg.stdout
    )
    helptext = run_python_m(
        "wf_launch",
        ["--help"],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert helptext.returncode == 0 and "== wf_launch ==" in helptext.stdout
    tasks = re.search(r"^task: (.*)$", helptext.stdout, re.M)
    assert tasks and {"call", "demo", "layout", "noop", "script", "train"} <= set(
        tasks.group(1).split(", ")
    )
