"""``ft=torchft`` on ``launcher=ray``: replica groups in placement groups of their own on the
test cluster, a kill -9 and a hang of one group, the others stepping on (real Ray, real torchft).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import python_m, run_python_m
from ray_fixture import RayCluster

from wf_launch.launchers.ft_record import compose_ft
from wf_launch.rank.ft import append_event
from wf_launch.rundir import files

FT = [
    "task=train",
    "ft=torchft",
    "ft.replicas=2",
    "engine.dp_size=2",
    "task.steps=50",
    "task.step_sleep_s=0.4",
    "task.checkpoint_every=4",
    "ft.timeout_s=5",
    "ft.hang_timeout_s=4",
    "ft.quorum_timeout_s=30",
    "launcher.console_ranks=[]",
]


def test_a_ray_failure_without_exit_codes_is_a_recovery_of_its_rank_never_a_cascade(tmp_path):
    """Ray knows no exit codes: the failed event names the rank and the cause; a rank that died
    (killed from outside) is not counted as a survivor's restart even right after another's."""
    from wf_launch.config.ft import FtConfig

    for k in (0, 1):
        where = files.ft_replica_dir(tmp_path, k)
        where.mkdir(parents=True)
        append_event(where, event="failed", attempt=1, rank=1, cause="died", failed_at_step=8)
        append_event(where, event="rejoined", step=9)
    ft = FtConfig.from_dict({"name": "torchft", "replicas": 2})
    section, _ = compose_ft(tmp_path, ft, 2, {0: 0, 1: 0})
    assert [
        (r["replica"], r["rank"], r["global_rank"], r["cause"]) for r in section["recoveries"]
    ] == [
        (0, 1, 1, "died"),
        (1, 1, 3, "died"),
    ]
    assert section["survivor_restarts"] == 0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ray_drill_kills_then_hangs_one_group_and_the_other_steps_on(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    directory = tmp_path / "drill"
    argv = [*FT, f"launcher.address={ray_cluster.address}", "--backend", "ray"]
    argv += ["--inject", "kill9:replica1@4,hang:replica1@14", "--dir", str(directory)]
    proc = run_python_m(
        "wf_launch.drill",
        [*argv, "--timeout", "400"],
        capture_output=True,
        text=True,
        timeout=540,
        env=ray_cluster.env,
        cwd=tmp_path,
    )
    log = (directory / "interrupted.log").read_text()[-4000:] if directory.exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:] + log
    assert "ft drill: PASS" in proc.stdout
    record = json.loads((directory / "interrupted" / "result.json").read_text())
    assert record["status"] == "ok" and record["launcher"] == "ray"
    section = record["ft"]
    assert [(r["replica"], r["rank"], r["cause"]) for r in section["recoveries"]] == [
        (1, 1, "died"),
        (1, 1, "hang"),
    ]
    assert all(r["healed_from"] == 0 for r in section["recoveries"]), section["recoveries"]
    assert section["survivor_restarts"] == 0 and section["weights_equal"]
    assert section["steps_completed"] == {"0": 50, "1": 50}
    # each replica group was its own Ray run: replica group 0 never needed a second attempt
    attempts = [
        json.loads((directory / "interrupted" / "replicas" / str(k) / "result.json").read_text())[
            "attempts"
        ]
        for k in (0, 1)
    ]
    assert len(attempts[0]) == 1 and len(attempts[1]) == 3
    assert ray_cluster.leftovers() == []


@pytest.mark.ray
@pytest.mark.slow
def test_a_lighthouse_on_the_clusters_address_and_sigterm_stops_every_group(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """The run answers ``status`` while it runs; SIGTERM stops every replica group (the ranks
    save), the run is recorded interrupted with the command that resumes it, nothing is left."""
    import signal
    import time

    run = tmp_path / "run"
    argv = [
        *FT,
        "launcher=ray",
        f"launcher.address={ray_cluster.address}",
        "task.steps=400",
        "task.step_sleep_s=0.1",
    ]
    proc = python_m(
        "wf_launch",
        [*argv, f"hydra.run.dir={run}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ray_cluster.env,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 240
        steps = files.ft_replica_dir(run, 1) / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if steps.exists() and steps.read_text().count("\n") >= 6:
                break
            time.sleep(0.2)
        status = run_python_m(
            "wf_launch.status",
            [str(run)],
            capture_output=True,
            text=True,
            env=ray_cluster.env,
            timeout=60,
        )
        assert "replica group 1" in status.stdout, status.stdout + status.stderr
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out[-3000:]
    record = json.loads((run / "result.json").read_text())
    assert record["status"] == "interrupted", record
    assert "launcher.resume=true" in record["failure"]["message"]
    lighthouse = (run / files.ft_lighthouse_log(run).name).read_text()
    assert "panicked" not in lighthouse
    assert ray_cluster.leftovers() == []
