"""Session-scoped ``ray_cluster`` fixture: a real multi-node Ray cluster for the Ray tests.

Registered for every test module by ``tests/conftest.py`` (``pytest_plugins``). It starts
``scripts/ray_cluster.sh start`` with 3 nodes of 2 CPUs (a head and two more raylets, each
with its custom resource ``wf_node_<i>``) on free ports, in a temporary folder, and stops it
at the end of the session, or by ``tests/cluster_guard.py`` when the run is killed
(``stop`` ends exactly the processes the cluster started, by pid).
When Ray is not installed the tests are skipped, unless ``CI=true``: then they fail, because CI
must never skip the Ray tests silently (``.ci/run`` installs ``.[dev,ray]``).
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cluster_guard
import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ray_cluster.sh"
USER_TASKS = Path(__file__).parent / "user_tasks"
NODES, CPUS = 3, 2
START_TIMEOUT_S = 300
PORTS = (12000, 20000)
"""The cluster's whole port plan lies here: apart from the SLURM test cluster's daemons
(tests/slurm_fixture.py) and below the rendezvous ports the SLURM launcher gives jobs
(20000-32000, by job id), which a Ray worker's port would otherwise take now and then."""
RANK_TITLES = ("ray::WfRayRank", "ray::WfRaySupervisor")
"""Process titles of a run's actors: none may be left once a run ended."""


_ANSWERING_NODES = """
    import socket
    answering = 0
    for n in ray.nodes():
        if n["Alive"]:
            try:
                socket.create_connection((n["NodeManagerAddress"], n["NodeManagerPort"]), 2).close()
                answering += 1
            except OSError:
                pass
    print(answering)
"""
"""Nodes the GCS calls alive whose raylet also answers on its port."""


@dataclass(frozen=True)
class RayCluster:
    """A running cluster: its GCS ``address``, state folder, and an environment for subprocesses."""

    address: str
    dir: Path
    nodes: int
    env: dict[str, str]

    def script(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *args, "--dir", str(self.dir)],
            text=True,
            capture_output=True,
            timeout=timeout,
            env=self.env,
        )

    def restore(self, timeout_s: float = 180) -> None:
        """Start every node that is not alive again (after a drill killed one), and return once
        every node is alive and its raylet answers. The GCS notices a killed raylet only after its
        health checks fail, so until then it still counts the dead node alive (and ``start-node``
        leaves it be): a node counts here only if its raylet's port answers too."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.script("start-node")
            assert out.returncode == 0, out.stderr
            answering = int(self.ask(_ANSWERING_NODES).strip().splitlines()[-1])
            if answering == self.nodes:
                return
            assert time.monotonic() < deadline, f"{answering} of {self.nodes} nodes answer"
            time.sleep(2.0)

    def ask(self, code: str, timeout: float = 120) -> str:
        """Run ``code`` in a fresh driver connected to the cluster (``ray`` imported, ``address``
        set); its stdout."""
        program = (
            f"import ray\naddress = {self.address!r}\nray.init(address=address, "
            "logging_level='ERROR')\n" + textwrap.dedent(code)
        )
        out = subprocess.run(
            [sys.executable, "-c", program],
            text=True,
            capture_output=True,
            timeout=timeout,
            env={**self.env, **LOOPBACK},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    def leftovers(self, grace_s: float = 60.0) -> list[str]:
        """What a run left in the cluster (none expected): busy CPUs, live placement groups,
        supervisors, rank or supervisor processes; waited for up to ``grace_s`` (teardown is
        asynchronous)."""
        code = """
            from ray._private import state
            from ray.util import placement_group_table
            busy = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
            pgs = [k for k, v in placement_group_table().items() if v["state"] != "REMOVED"]
            named = ray.util.list_named_actors(all_namespaces=True)
            free = state.available_resources_per_node()
            held = {
                node[:8]: r.get("CPU", 0) - free.get(node, {}).get("CPU", 0)
                for node, r in state.total_resources_per_node().items()
            }
            held = {node: cpus for node, cpus in held.items() if cpus}
            live = sorted(
                f"{a['ActorClassName']} {a['State']} on {a['Address']['NodeID'][:8]}"
                for a in state.actors().values()
                if a["State"] != "DEAD"
            )
            print(repr((busy, pgs, named, f"by node {held}, live actors {live}")))
        """
        deadline = time.monotonic() + grace_s
        while True:
            busy, pgs, named, where = eval(self.ask(code).strip().splitlines()[-1])
            procs = [
                f"{p.pid}: {' '.join(p.cmdline())}"
                for p in psutil.process_iter()
                if _title(p).startswith(RANK_TITLES)
            ]
            found = (
                ([f"{busy:g} CPU(s) still held ({where})"] if busy else [])
                + [f"placement group {p}" for p in pgs]
                + [f"named actor {n}" for n in named]
                + procs
            )
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(1.0)


def _title(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _free_base(nodes: int) -> int:
    """A head port whose whole block (the script's port plan) is free, in :data:`PORTS`."""
    low, high = PORTS
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - 200 * (nodes + 1)) // 10 * 10
        fixed = [
            base,
            base + 1,
            base + 2,
            *(base + 10 * i + k for i in range(1, nodes + 1) for k in range(6)),
        ]
        workers = range(base + 200, base + 200 * (nodes + 1), 37)
        if all(_bindable(p) for p in [*fixed, *workers]):
            return base
    raise RuntimeError(f"no free block of ports for a Ray cluster in {low}-{high}")


def cluster_env() -> dict[str, str]:
    """This process's environment for subprocesses: the venv's ``ray`` first on PATH, the test tasks
    importable, token authentication on (the script's cluster uses it)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RAY_ADDRESS")
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    env["RAY"] = str(Path(sys.executable).parent / "ray")
    env.setdefault("RAY_AUTH_MODE", "token")
    return env


LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""For a plain ``ray.init`` driver: keep 127.0.0.1 (the cluster listens on loopback only)."""

HEALTH_CHECK = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "5000",
    "RAY_health_check_failure_threshold": "5",
}
"""For the test cluster's GCS only. A killed raylet refuses the check at once: its node is declared
dead after about 5 s (Ray's default: about 15 s), so the nodekill test restarts sooner. A raylet
that is only slow (a loaded host) has 5 s per check, 25 s in all: with a 1 s bound, a raylet
stalled 3 s by load was declared dead and took a run's ranks with it (``NodeDiedError`` in the
drill's reference run). The launcher does not depend on these values."""


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true, so the Ray tests may not be skipped, but: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A running 3-node Ray cluster, started for the session and stopped after it."""
    if (
        importlib.util.find_spec("ray") is None
        or not (Path(sys.executable).parent / "ray").exists()
    ):
        _skip_or_fail("Ray is not installed in this environment: pip install -e '.[dev,ray]'")
    cluster_guard.reap(Path(tempfile.gettempdir()))
    state = cluster_guard.state_dir("ray")
    guardian = cluster_guard.claim(state)
    env = {**cluster_env(), "RAY_AUTH_TOKEN_PATH": str(state / "auth_token")}
    port = _free_base(NODES)
    cmd = [
        "bash",
        str(SCRIPT),
        "start",
        "--nodes",
        str(NODES),
        "--cpus",
        str(CPUS),
        "--port",
        str(port),
        "--dir",
        str(state),
    ]
    try:
        out = subprocess.run(
            cmd,
            text=True,
            capture_output=True,
            timeout=START_TIMEOUT_S,
            env={**env, **HEALTH_CHECK},
        )
    except subprocess.TimeoutExpired as exc:
        _stop(state, guardian)
        pytest.fail(f"{' '.join(cmd)} took over {START_TIMEOUT_S}s:\n{exc.stderr}", pytrace=False)
    if out.returncode != 0:
        _stop(state, guardian)
        pytest.fail(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr}", pytrace=False)
    cluster = RayCluster(address=f"127.0.0.1:{port}", dir=state, nodes=NODES, env=env)
    try:
        yield cluster
    finally:
        _stop(state, guardian)


def _stop(state: Path, guardian: subprocess.Popen[bytes]) -> None:
    """Stop the cluster in ``state`` (if it still runs), then its guardian."""
    try:
        error = cluster_guard.stop(state)
    finally:
        guardian.kill()
        guardian.wait()
    if error:
        raise RuntimeError(error)
