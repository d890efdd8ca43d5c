"""The local launcher against hostile or unlucky input: loopback only, owned ports, bad values
refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import listening as listening_on
from cli_helpers import result, run_cli, start_cli, wait_for_log

TASKS = "task.modules=[wf_test_tasks]"


@pytest.mark.slow
def test_no_rank_or_launcher_socket_listens_beyond_loopback(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_cli(
        ["task=misbehave", TASKS, "task.how=sleep_all", "task.sleep_s=120", "engine.dp_size=4"],
        run_dir,
    )
    try:
        for r in range(4):
            wait_for_log(run_dir / "logs" / f"rank{r}.log", "sleeping")
        listening = listening_on(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=120)
    assert len(listening) >= 5, (
        listening
    )  # the rendezvous store, the ranks' store, every rank's gloo
    assert [a for a in listening if not a.startswith("127.")] == []


@pytest.mark.slow
def test_a_busy_rendezvous_port_is_refused_not_joined(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        proc = run_cli(
            ["task=noop", "engine.dp_size=2", f"launcher.rdzv_port={port}"], tmp_path / "run"
        )
    assert proc.returncode == 2, proc.stderr
    assert f"launcher.rdzv_port={port}: port {port} is in use on 127.0.0.1" in proc.stderr
    assert result(tmp_path / "run")["status"] == "invalid"
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.slow
def test_forkserver_ranks_run(tmp_path: Path) -> None:
    proc = run_cli(
        ["task=echo", TASKS, "engine.dp_size=2", "launcher.start_method=forkserver"],
        tmp_path / "run",
    )
    assert proc.returncode == 0, proc.stderr
    res = result(tmp_path / "run")
    assert res["status"] == "ok" and sorted(res["results"]) == ["0", "1"]


@pytest.mark.parametrize(
    "override, fragment",
    [
        (
            "engine.distributed_timeout_minutes=inf",
            "engine.distributed_timeout_minutes=inf is not allowed",
        ),
        ("engine.distributed_timeout_minutes=1e-9", "from 1.66667e-05 (1 ms)"),
        (
            "engine.distributed_timeout_minutes=-1",
            "engine.distributed_timeout_minutes=-1.0 is not allowed",
        ),
        ("engine.dp_size=1000000", "the layout has 1000000 ranks, more than 64 per core"),
        (
            "launcher.monitor_interval_s=1e12",
            "launcher.monitor_interval_s=1000000000000.0 is not allowed",
        ),
        ("launcher.max_log_mb=inf", "launcher.max_log_mb=inf is not allowed"),
        ("launcher.run_dir_mode='0077'", "launcher.run_dir_mode='0077' is not allowed"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(
    tmp_path: Path, override: str, fragment: str
) -> None:
    proc = run_cli(["task=noop", override], tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_oversubscribe_lets_a_large_local_layout_through(tmp_path: Path) -> None:
    proc = run_cli(
        [
            "task=noop",
            "engine.dp_size=1000000",
            "launcher.oversubscribe=true",
            "launcher.dry_run=true",
        ],
        tmp_path / "run",
    )
    assert proc.returncode == 0, proc.stderr


DEAF_SURVIVOR = """
import json, os, signal, sys, time
from torch.distributed.launcher.api import LaunchConfig
from wf_launch.launchers.local.agent import RanksFailed, run_agent

def rank(_):
    if int(os.environ["LOCAL_RANK"]) == 1:
        time.sleep(0.5)
        os._exit(3)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank blocked in native code
    time.sleep(300)

if os.environ.get("WF_TEST_MISS_FAILURE"):  # the agent's first look misses rank 1's exit
    from wf_launch.launchers.local import agent
    agent._ExitCodeAgent.before_monitor = lambda self, worker_group: None

config = LaunchConfig(
    min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="deaf", rdzv_backend="c10d",
    rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1, start_method="fork",
    local_addr="127.0.0.1",
)
t0 = time.monotonic()
try:
    run_agent(config, rank, 0, kill_survivors=True)
except RanksFailed as exc:
    print(json.dumps({"codes": exc.exit_codes, "seconds": time.monotonic() - t0}))
"""


@pytest.mark.parametrize("missed", [False, True], ids=["seen", "missed-by-first-look"])
def test_a_replica_groups_survivors_are_killed_at_once_when_a_rank_fails(
    tmp_path: Path, missed: bool
) -> None:
    """``kill_survivors`` (an ft replica group's agent): a rank that cannot take SIGTERM (blocked
    in a gloo collective or torchft's quorum call) is killed at once when its peer fails, not
    after torch's 30 s grace; only the rank that failed on its own is named, also when the
    agent's first look missed the failure and torch's check found it (and killed the peer)."""
    script = tmp_path / "deaf.py"
    script.write_text(DEAF_SURVIVOR)
    env = {**os.environ, **({"WF_TEST_MISS_FAILURE": "1"} if missed else {})}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["codes"] == {"1": 3}
    assert out["seconds"] < 20, out  # torch's own shutdown would wait 30 s for rank 0
