"""``launcher=ray`` through the real CLI on a real 3-node Ray cluster (tests/ray_fixture.py): a run
across two
nodes and the tools that read it, a failing rank and a hung rank named with their node, the drill's
kill -9 and
dead node ending identical, preemption by SIGTERM, a detached run (status, runs, --stacks, --follow,
--cancel),
a sweep side by side, bad inputs refused before any actor starts, a private instance; nothing left
behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import run_python_m
from ray_fixture import RayCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TEST_TASKS = "task.modules=[wf_test_tasks]"


def _cli(
    cluster: RayCluster,
    args: list[str],
    run_dir: Path,
    timeout: float = 240,
    multirun: bool = False,
    ray: bool = True,
) -> subprocess.CompletedProcess[str]:
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    base = ["launcher=ray", f"launcher.address={cluster.address}"] if ray else []
    return run_python_m(
        "wf_launch",
        [*(["-m"] if multirun else []), *base, *args, where],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cluster.env,
        cwd=run_dir.parent,
    )


def _tool(
    cluster: RayCluster, name: str, *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"wf_launch.{name}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cluster.env,
    )


def _record(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def _wait_step(run_dir: Path, rank: int, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "logs" / f"rank{rank}.progress.json"
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"rank {rank} of {run_dir} never reached step {step}")


def test_two_nodes_run_with_placement_console_and_tools(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    proc = _cli(
        ray_cluster,
        [
            "launcher.nodes=2",
            "engine.cp_size=2",
            "engine.dp_size=2",
            "task=echo",
            TEST_TASKS,
            "launcher.console_ranks=[0,3]",
        ],
        run,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (
        "[r0 tp0 cp0 pp0 dp0] hello from rank 0" in proc.stderr
        and "hello from rank 3" in proc.stderr
    )
    assert "hello from rank 1" not in proc.stderr  # only the console ranks are streamed
    placed = next(line for line in proc.stderr.splitlines() if "rank(s) placed:" in line)
    assert placed.count("(host ") == 2, placed  # every node's host is named
    assert "run ok in" in proc.stderr and str(run / "result.json") in proc.stderr
    record = _record(run)
    assert (
        record["status"] == "ok"
        and record["launcher"] == "ray"
        and sorted(record["results"]) == ["0", "1", "2", "3"]
    )
    placement = record["placement"]
    nodes = [placement[str(r)]["node"] for r in range(4)]
    assert (
        nodes[0] == nodes[1] != nodes[2] == nodes[3]
    )  # consecutive ranks together, exactly 2 nodes
    assert all(placement[str(r)]["pid"] and placement[str(r)]["host"] for r in range(4))
    assert sorted(record["ray"]["nodes"]) == sorted(set(nodes))
    assert all((run / "logs" / f"rank{r}.log").exists() for r in range(4))
    status = _tool(ray_cluster, "status", str(run))
    assert status.returncode == 0 and "-> ok (exit 0)" in status.stdout, status.stdout
    assert f"ranks 0,1 on node {nodes[0][:12]}" in status.stdout
    runs = _tool(ray_cluster, "runs", str(tmp_path))
    assert f"ray {record['ray']['address']}" in runs.stdout and " ok " in runs.stdout
    assert ray_cluster.leftovers() == []


def test_a_rank_that_raises_is_named_with_its_node(ray_cluster: RayCluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _cli(
        ray_cluster,
        [
            "launcher.nodes=2",
            "engine.dp_size=4",
            "task=misbehave",
            "task.rank=3",
            TEST_TASKS,
            "launcher.console_ranks=[]",
        ],
        run,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    failure = _record(run)["failure"]
    node = _record(run)["placement"]["3"]["node"]
    assert failure["rank"] == 3 and failure["type"] == "ValueError" and failure["node"] == node
    assert failure["coords"] == {"tp": 0, "cp": 0, "pp": 0, "dp": 3}
    assert f"rank 3 (r3 tp0 cp0 pp0 dp3 on node {node[:12]}, host " in proc.stderr
    assert "failed first: ValueError: rank 3 refuses: bad batch 17" in proc.stderr
    # shown once, in the summary: never streamed live from the rank's log as well
    assert proc.stderr.count("Traceback (most recent call last)") <= 1, proc.stderr
    assert not any("[r3 " in line and "Traceback" in line for line in proc.stderr.splitlines())
    assert ray_cluster.leftovers() == []


def test_a_hung_rank_on_another_node_is_found_by_the_autopsy(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    proc = _cli(
        ray_cluster,
        [
            "launcher.nodes=2",
            "engine.dp_size=4",
            "engine.distributed_timeout_minutes=0.15",
            "task=misbehave",
            "task.rank=3",
            "task.how=stuck",
            "task.sleep_s=60",
            TEST_TASKS,
            "launcher.console_ranks=[]",
        ],
        run,
    )
    assert proc.returncode == 1 and (run / "result.json").exists(), proc.stderr[-3000:]
    record = _record(run)
    failure = record["failure"]
    assert failure["cause"] == "stuck" and failure["missing_ranks"] == [3], failure
    assert (
        failure["stuck"]["3"]["frame"].startswith("wf_test_tasks.py")
        and "sleep" in failure["stuck"]["3"]["source"]
    )
    assert "collective timed out: rank 3 (r3 tp0 cp0 pp0 dp3 on node" in proc.stderr
    assert "ranks 0-2 wait in barrier" in proc.stderr
    # rank 3's node is not rank 0's: its stacks were dumped through Ray, on its own node
    assert record["placement"]["3"]["node"] != record["placement"]["0"]["node"]
    assert (run / "logs" / "rank3.stacks").stat().st_size > 0
    assert ray_cluster.leftovers() == []


@pytest.mark.timeout(600)  # two drill runs, four starts of 2 rank actors: a minute alone
def test_drill_kill9_and_a_dead_node_end_identical(ray_cluster: RayCluster, tmp_path: Path) -> None:
    directory = tmp_path / "drill"
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "wf_launch.drill",
                "task=train",
                f"launcher.address={ray_cluster.address}",
                "launcher.nodes=2",  # one rank on each: the nodekill takes one, kill9 the other
                "engine.dp_size=2",
                "task.steps=12",
                "task.checkpoint_every=2",
                # steps of 0.5 s: after the nodekill the run has seconds of work left, so the
                # ranks on the dead node end before it could finish without them
                "task.step_sleep_s=0.5",
                "launcher.console_ranks=[]",
                "--backend",
                "ray",
                "--inject",
                "kill9@3,nodekill@6",
                "--dir",
                str(directory),
                "--timeout",
                "400",
            ],
            capture_output=True,
            text=True,
            timeout=540,
            env=ray_cluster.env,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        summary = json.loads((directory / "drill.json").read_text())
        assert summary["identical"], summary
        first, restarted, resumed = summary["attempts"]
        assert first["ended_by"].startswith("rank 1 died on node")
        assert restarted["cause"] == first["ended_by"] and restarted["resumed_from"] is not None
        assert resumed["cause"].startswith("node ") and resumed["cause"].endswith(" died")
        record = _record(directory / "interrupted")
        assert (
            len({p["node"] for p in record["placement"].values()}) == 2
        )  # the last attempt: on the nodes left
        assert ray_cluster.leftovers() == []
    finally:
        ray_cluster.restore()


def test_sigterm_to_a_rank_saves_and_restarts(ray_cluster: RayCluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=ray",
            f"launcher.address={ray_cluster.address}",
            "launcher.max_restarts=1",
            "engine.dp_size=2",
            "task=train",
            "task.steps=14",
            "task.step_sleep_s=0.2",
            "task.checkpoint_every=4",
            "launcher.console_ranks=[]",
            f"hydra.run.dir={run}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ray_cluster.env,
        cwd=tmp_path,
    )
    try:
        _wait_step(run, 1, 5)
        os.kill(
            json.loads((run / "logs" / "rank1.pid").read_text())["pid"], signal.SIGTERM
        )  # a node draining
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    first, second = _record(run)["attempts"]
    assert first["ended_by"] == "preempted: TERM (stop flag)"
    assert second["cause"] == first["ended_by"] and second["resumed_from"] == first["last_step"]
    assert second["steps_lost"] == 0 and second["last_step"] == 14
    assert ray_cluster.leftovers() == []


def test_detached_run_status_runs_stacks_follow_and_cancel(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """The tools that need a live run ask a long one (it outlives them whatever the load), then
    cancel it; ``--follow`` follows a short one to its end (or finds it ended: the same lines)."""
    short, long = tmp_path / "short", tmp_path / "long"
    ticker = [
        "launcher.wait=false",
        "engine.dp_size=2",
        "task=ticker",
        TEST_TASKS,
        "task.step_sleep_s=0.3",
    ]
    started = _cli(ray_cluster, [*ticker, "task.steps=100000"], long)
    assert started.returncode == 0 and "status: python -m wf_launch.status" in started.stdout, (
        started.stderr[-3000:]
    )
    ended = _cli(ray_cluster, [*ticker, "task.steps=20"], short)  # runs beside the tools' calls
    assert ended.returncode == 0, ended.stderr[-3000:]
    try:
        _ask_the_live_run(ray_cluster, long, tmp_path)
        cancel = _tool(ray_cluster, "status", "--cancel", str(long))
        assert cancel.returncode == 143 and "cancelled (exit 143)" in cancel.stdout, (
            cancel.stdout + cancel.stderr
        )
    finally:  # a failed check must not leave the long run holding the cluster's CPUs
        if (run_record := _record_or_none(long)) is None or run_record.get("status") != "cancelled":
            _tool(ray_cluster, "status", "--cancel", str(long))
    assert _record(long)["status"] == "cancelled"

    follow = _tool(ray_cluster, "status", "--follow", str(short), timeout=300)
    assert follow.returncode == 0 and "run ok in" in follow.stderr, follow.stderr[-3000:]
    assert _record(short)["status"] == "ok"
    assert ray_cluster.leftovers() == []


def _ask_the_live_run(ray_cluster: RayCluster, long: Path, tmp_path: Path) -> None:
    """``status``, ``runs`` and ``status --stacks`` of a live detached run of two ranks."""
    _wait_step(long, 0, 2)
    status = _tool(ray_cluster, "status", str(long))
    assert status.returncode == 0 and "RUNNING attempt 0" in status.stdout, (
        status.stdout + status.stderr
    )
    listing = _tool(ray_cluster, "runs", str(tmp_path))
    assert "running" in listing.stdout and "detached" in listing.stdout, listing.stdout
    for _ in range(5):  # a dump may catch a rank between its sleeps (publishing its progress)
        stacks = _tool(ray_cluster, "status", "--stacks", str(long))
        assert stacks.returncode == 0 and "in ticker" in stacks.stdout, (
            stacks.stdout + stacks.stderr
        )
        if "ranks 0,1 are at " in stacks.stdout:
            break
    assert "ranks 0,1 are at " in stacks.stdout, stacks.stdout  # ranks at one line: one line


def _record_or_none(run: Path) -> dict | None:
    path = run / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_sweep_points_run_side_by_side(ray_cluster: RayCluster, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = _cli(
        ray_cluster,
        ["engine.dp_size=1,2", "task=ticker", TEST_TASKS, "task.steps=15", "task.step_sleep_s=0.3"],
        sweep,
        multirun=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [_record(sweep / str(p)) for p in (0, 1)]
    assert [r["status"] for r in records] == ["ok", "ok"]
    spans = [(r["finished_at"] - r["timings"]["wall_s"], r["finished_at"]) for r in records]
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans  # they overlapped in time
    assert (sweep / "sweep_summary.md").exists() and "2 ok" in proc.stderr
    assert ray_cluster.leftovers() == []


@pytest.mark.parametrize(
    "args, field, has",
    [
        # the messages name the cluster as it is: a node a drill killed may be coming back
        (["launcher.nodes=4", "engine.dp_size=4"], "launcher.nodes=4", r"has [23] alive node"),
        (["launcher.cpus_per_rank=3"], "launcher.cpus_per_rank=3.0", "no node has 3 CPU"),
        (["launcher.gpus_per_rank=1"], "launcher.gpus_per_rank=1.0", "no node has 1 GPU"),
        (["engine.dp_size=8"], "launcher.cpus_per_rank=1.0", r"holds at most [46] of 1 CPU"),
        (
            ["launcher.address=127.0.0.1:1"],
            "launcher.address='127.0.0.1:1'",
            "nothing answers there",
        ),
    ],
    ids=["nodes", "cpus", "gpus", "world", "address"],
)
def test_bad_inputs_are_refused_before_any_actor_starts(
    ray_cluster: RayCluster, tmp_path: Path, args: list[str], field: str, has: str
) -> None:
    run = tmp_path / "run"
    address = (
        []
        if any(a.startswith("launcher.address=") for a in args)
        else [f"launcher.address={ray_cluster.address}"]
    )
    proc = _cli(
        ray_cluster,
        ["launcher=ray", *address, *args, "task=noop", "launcher.placement_timeout_s=20"],
        run,
        timeout=120,
        ray=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"wf_launch: config error: {field} is not allowed" in proc.stderr, proc.stderr
    assert re.search(has, proc.stderr), proc.stderr
    assert _record(run)["status"] == "invalid" and not (run / "logs").exists()


def test_a_private_instance_runs_and_leaves_nothing(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    from wf_launch.launchers.ray.cluster import marked_pids, private_marker

    run = tmp_path / "run"
    proc = _cli(ray_cluster, ["launcher=ray", "engine.dp_size=2", "task=noop"], run, ray=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = _record(run)
    assert record["status"] == "ok" and record["ray"]["private"] is True
    assert marked_pids(private_marker(str(run))) == []


def test_tune_on_the_cluster_measures_every_trial_on_ray(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    """``python -m wf_launch.tune launcher=ray``: a round's trials run as Ray points side by side
    (the cluster holds them all), the known-best layout of ``task=clockwork`` wins, and nothing is
    left in the cluster."""
    sys.path.insert(0, str(Path(__file__).parent / "user_tasks"))
    from wf_tune_tasks import layout_key

    d = tmp_path / "tune"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch.tune",
            "task=clockwork",
            "task.modules=[wf_tune_tasks]",
            "world_size=2",
            "task.steps=12",
            "launcher=ray",
            f"launcher.address={ray_cluster.address}",
            "--warmup",
            "1",
            "--min-steps",
            "3",
            "--cutoff",
            "0",
            "--dir",
            str(d),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ray_cluster.env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    state = json.loads((d / "tune.json").read_text())
    assert state["status"] == "done" and state["launcher"] == "ray"
    first = [m for m in state["measurements"] if m["round"] == 0]
    assert len(first) == 3 and all(m["status"] == "ok" for m in first), (
        first
    )  # tp2, cp2, dp2 (pp2 needs 2 micro-batches)
    winner = next(p for p in state["space"] if p["id"] == state["winner"])
    assert (
        layout_key(*(winner["sizes"][k] for k in ("tp", "cp", "pp", "dp")), 1)
        == "tp1-cp1-pp1-dp2-mb1"
    )
    records = [json.loads(p.read_text()) for p in d.glob("rounds/r*/*/result.json")]
    assert records and all(r["launcher"] == "ray" and r["status"] == "ok" for r in records)
    assert ray_cluster.leftovers() == []
