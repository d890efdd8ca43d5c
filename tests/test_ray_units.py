"""``launcher=ray`` without a cluster: its config checks, where ranks go (bundles, nodes,
LOCAL_RANK, GPUs), whether a run fits a cluster, the refusals before anything starts (Ray missing, a
relative run directory), the dry run, and that every Ray name we use still exists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import cli_env

from wf_launch.config import ConfigError, EngineConfig
from wf_launch.launchers.ray import RayLauncherConfig, validate_ray_launcher
from wf_launch.launchers.ray.cluster import Node, check_fits, parse_address
from wf_launch.launchers.ray.monitor import forwarded_env
from wf_launch.launchers.ray.placement import (
    Slot,
    assign,
    cuda_orders,
    local_ranks,
    rank_env,
    shape,
)


def _cfg(**fields: Any) -> RayLauncherConfig:
    return RayLauncherConfig(**fields)


@pytest.mark.parametrize(
    "fields, world, message",
    [
        (
            {"nodes": 3},
            4,
            "launcher.nodes=3 is not allowed: the layout's 4 rank(s) must split evenly",
        ),
        (
            {"nodes": 2},
            4,
            "launcher.nodes=2 is not allowed: launcher.address=null runs a private Ray instance",
        ),
        (
            {"nodes": 0, "address": "h:1"},
            4,
            "launcher.nodes=0 is not allowed: expected an integer >= 1",
        ),
        (
            {"cpus_per_rank": 0},
            2,
            "launcher.cpus_per_rank=0 is not allowed: expected CPUs in (0, 1024]",
        ),
        ({"gpus_per_rank": -1}, 2, "launcher.gpus_per_rank=-1 is not allowed"),
        ({"address": "ray://head:10001"}, 2, "Ray Client (ray://) is not supported"),
        (
            {"address": "head"},
            2,
            "launcher.address='head' is not allowed: null (a private Ray instance",
        ),
        ({"address": "head:70000"}, 2, "launcher.address='head:70000' is not allowed"),
        ({"wait": False}, 2, "launcher.wait=False is not allowed: a detached run needs a cluster"),
        ({"placement_timeout_s": 0}, 2, "launcher.placement_timeout_s=0 is not allowed"),
        (
            {"max_restarts": -1},
            2,
            "launcher.max_restarts=-1 is not allowed: expected an integer >= 0",
        ),
        (
            {"runtime_env": {"conda": "x"}},
            2,
            "launcher.runtime_env.conda='x' is not allowed: a mapping with any of",
        ),
        (
            {"runtime_env": {"env_vars": {"RANK": "3"}}},
            2,
            "launcher.runtime_env.env_vars.RANK='3' is not allowed: set by",
        ),
        (
            {"runtime_env": {"env_vars": {"A": 1}}},
            2,
            "launcher.runtime_env.env_vars={'A': 1} is not allowed",
        ),
        ({"runtime_env": {"pip": [1]}}, 2, "launcher.runtime_env.pip=[1] is not allowed"),
        (
            {"runtime_env": {"working_dir": "/nonexistent"}},
            2,
            "launcher.runtime_env.working_dir='/nonexistent' is not allowed: a directory that",
        ),
        (
            {"runtime_env": {"excludes": "*.ckpt"}},
            2,
            "launcher.runtime_env.excludes='*.ckpt' is not allowed: a list of",
        ),
    ],
)
def test_bad_launcher_values_name_the_field(
    fields: dict[str, Any], world: int, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        validate_ray_launcher(_cfg(**fields), EngineConfig(), world)
    assert message in str(err.value)


def test_nccl_needs_a_gpu_per_rank() -> None:
    with pytest.raises(
        ConfigError, match=r"launcher.gpus_per_rank=0.0 is not allowed: .*needs a GPU per rank"
    ):
        validate_ray_launcher(_cfg(), EngineConfig(distributed_backend="nccl"), 2)
    validate_ray_launcher(_cfg(gpus_per_rank=1), EngineConfig(distributed_backend="nccl"), 2)


def test_addresses() -> None:
    assert parse_address(None) is None and parse_address("auto") == "auto"
    assert parse_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert parse_address("raycluster-head-svc.default.svc:6379") == (
        "raycluster-head-svc.default.svc",
        6379,
    )


def test_ranks_split_evenly_over_nodes_consecutive_and_rank_0_first() -> None:
    spread = shape(8, 2, 1, 0)
    assert spread.strategy == "STRICT_SPREAD" and spread.bundles == [{"CPU": 4.0}] * 2
    slots = assign(8, spread, {0: "b", 1: "a"})
    assert [s.node for s in slots] == ["b"] * 4 + ["a"] * 4 and [s.bundle for s in slots] == [
        0
    ] * 4 + [1] * 4
    anywhere = shape(4, None, 2, 1)
    assert anywhere.strategy == "PACK" and anywhere.bundles == [{"CPU": 2.0, "GPU": 1.0}] * 4
    # bundles scattered by Ray: ranks are numbered node by node, bundle 0's node first
    slots = assign(4, anywhere, {0: "x", 1: "y", 2: "x", 3: "y"})
    assert [(s.rank, s.bundle, s.node) for s in slots] == [
        (0, 0, "x"),
        (1, 2, "x"),
        (2, 1, "y"),
        (3, 3, "y"),
    ]
    assert local_ranks(slots) == {0: (0, 2), 1: (1, 2), 2: (0, 2), 3: (1, 2)}


def test_each_rank_sees_its_own_gpu_at_local_rank() -> None:
    slots = [Slot(0, 0, "n1"), Slot(1, 1, "n1"), Slot(2, 2, "n2")]
    orders = cuda_orders(slots, {0: ["3"], 1: ["1"], 2: ["0"]})
    assert orders == {0: "3,1", 1: "3,1", 2: "0"}  # rank 1 (LOCAL_RANK 1) binds cuda:1 = GPU 1
    assert cuda_orders(slots, {0: [], 1: [], 2: []}) == {}
    env = rank_env(slots[1], 3, (1, 2), ("10.0.0.1", 29500), 2, orders[1])
    assert env == {
        "RANK": "1",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "WF_ATTEMPT": "2",
        "WF_NODE": "n1",
        "CUDA_VISIBLE_DEVICES": "3,1",
    }


NODES = [Node("aaaa", "10.0.0.1", 1, 4.0, 0.0, True), Node("bbbb", "10.0.0.2", 1, 2.0, 1.0, False)]


@pytest.mark.parametrize(
    "fields, world, message",
    [
        ({"nodes": 3}, 3, "launcher.nodes=3 is not allowed: the cluster at c has 2 alive node(s)"),
        (
            {"cpus_per_rank": 8},
            1,
            "launcher.cpus_per_rank=8 is not allowed: no node has 8 CPU(s) for one rank",
        ),
        (
            {"gpus_per_rank": 2},
            1,
            "launcher.gpus_per_rank=2 is not allowed: no node has 2 GPU(s) for one rank",
        ),
        (
            {"nodes": 2},
            6,
            "launcher.nodes=2 is not allowed: 2 node(s) of 3 rank(s) each need 3 CPU(s) per node",
        ),
        ({}, 7, "the layout has 7 rank(s) but the cluster holds at most 6 of 1 CPU(s) each"),
    ],
)
def test_what_the_cluster_cannot_hold_is_refused(
    fields: dict[str, Any], world: int, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_fits(NODES, _cfg(**fields), world, "c")
    assert message in str(err.value)
    assert "node aaaa (10.0.0.1: 4 CPU, head); node bbbb (10.0.0.2: 2 CPU, 1 GPU)" in str(err.value)


def test_what_fits_passes() -> None:
    check_fits(NODES, _cfg(nodes=2), 4, "c")
    check_fits(NODES, _cfg(gpus_per_rank=1), 1, "c")
    check_fits(NODES, _cfg(), 6, "c")


def test_the_launching_shell_forwards_task_paths_and_wf_variables() -> None:
    env, path = forwarded_env(
        {"PYTHONPATH": "/a:/b", "WF_PROGRESS_PUBLISH_S": "0", "WF_ATTEMPT": "4", "HOME": "/h"}
    )
    assert env == {"PYTHONPATH": "/a:/b", "WF_PROGRESS_PUBLISH_S": "0"} and path == ["/a", "/b"]


def test_every_ray_name_we_use_exists() -> None:
    pytest.importorskip("ray")
    from wf_launch.launchers.ray import ray_adapter

    assert ray_adapter.check_names() == []


def test_ray_is_imported_by_the_adapter_only() -> None:
    root = Path(__file__).resolve().parents[1]
    users = sorted(
        str(p.relative_to(root))
        for pkg in ("wf_launch", "hydra_plugins")
        for p in (root / pkg).rglob("*.py")
        if any(
            line.lstrip().startswith(("import ray", "from ray"))
            for line in p.read_text().splitlines()
        )
    )
    assert users == ["wf_launch/launchers/ray/ray_adapter.py"]


def test_without_ray_the_launcher_says_how_to_install_it(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ImportError('No module named ray (shadowed by the test)')\n"
    )
    env = cli_env()
    env["PYTHONPATH"] = f"{shadow.parent}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=ray",
            "task=noop",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "launcher=ray needs Ray" in proc.stderr
        and "pip install 'worldfoundry-launch[ray]'" in proc.stderr
    )


def test_a_missing_working_dir_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=ray",
            "task=noop",
            "+launcher.runtime_env.working_dir=/nonexistent",
            f"hydra.run.dir={run}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "wf_launch: config error: launcher.runtime_env.working_dir='/nonexistent' is not allowed"
    ), proc.stderr
    assert json.loads((run / "result.json").read_text())["status"] == "invalid"
    assert not (run / "logs").exists()


def test_a_relative_run_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wf_launch.launchers.launch_plan import LaunchPlan
    from wf_launch.launchers.ray.submit import launch
    from wf_launch.rundir.record import RunRecord, Status
    from worldfoundry.core.distributed.topology import Layout

    monkeypatch.chdir(tmp_path)
    config = {
        "engine": {"tp_size": 1, "cp_size": 1, "pp_size": 1, "dp_size": 1},
        "task": {"name": "noop"},
        "launcher": {"name": "ray"},
    }
    plan = LaunchPlan(config=config, layout=Layout(1), run_dir=Path("rel"))
    outcome = launch(plan)
    assert outcome.status is Status.INVALID
    record = RunRecord.read(tmp_path / "rel")
    assert (
        record is not None
        and "hydra.run.dir='rel' is not allowed: an absolute path" in record.failure["message"]
    )


def test_dry_run_shows_the_placement_plan(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=ray",
            "launcher.address=10.0.0.5:6379",
            "launcher.nodes=2",
            "engine.cp_size=2",
            "engine.dp_size=2",
            "launcher.dry_run=true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "launcher      ray, 4 rank(s) on the Ray cluster at 10.0.0.5:6379" in proc.stdout
    assert "2 bundle(s) of {CPU 2}, STRICT_SPREAD, 2 rank(s) each" in proc.stdout


def test_a_rank_error_without_a_record_is_named_by_its_exception_line() -> None:
    from wf_launch.launchers.ray.failure import _error_line

    ray_text = (
        '\x1b[36mray::WfRayRank.run()\x1b[39m (pid=1, ip=10.0.0.1, actor_id=ab)\n  File "x.py", '
        "line 3, in run\n"
        "    rank_main(spec)\nImportError: cannot import name 'thing'"
    )
    assert _error_line(ray_text) == "ImportError: cannot import name 'thing'"


def test_a_rank_whose_node_does_not_see_the_run_directory_refuses_to_start(tmp_path: Path) -> None:
    from wf_launch.launchers.ray.rank_entry import RunDirNotShared, WfRayRank
    from wf_launch.rank.entrypoint import RankSpec

    with pytest.raises(RunDirNotShared, match="is not visible on this node"):
        WfRayRank().run(RankSpec(config={}, run_dir=str(tmp_path / "elsewhere")), {"RANK": "0"}, [])
