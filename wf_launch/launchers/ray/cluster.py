"""The cluster a run goes to: its address, connecting (bounded), and whether the run can fit.

``auto`` or ``HOST:PORT`` joins a cluster, within ``launcher.placement_timeout_s``.
:func:`check_fits` refuses (exit 2, before any actor starts) a run the cluster's nodes can
never hold; one that fits but finds the cluster busy waits for its placement group.

``launcher.address`` null starts a :class:`PrivateInstance` sized for the run. Ray's defaults
open a local instance to every user of the machine (servers on every interface, a 0644 token
in ``~/.ray``): another user could join as a node and run code as ours. A private instance
binds loopback only, keeps its token (0600) and temp dir in a 0700 dir made for the run, and
on close kills every process carrying its marker.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from ...config.fields import config_error
from . import ray_adapter as rt

_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>[0-9]{1,5})")
ADDRESS_ALLOWED = (
    "null (a private Ray instance on this machine, for this run), 'auto' (the cluster this "
    "machine belongs to: RAY_ADDRESS or the last one started here), or the head's GCS address "
    "HOST:PORT (e.g. 10.0.0.5:6379; on Kubernetes the KubeRay head service, "
    "raycluster-head-svc:6379)"
)


MARKER_ENV = "WF_RAY_PRIVATE"
"""Set (to the run directory) in the environment of every process of a private instance."""


def private_marker(run_dir: str) -> str:
    return f"{MARKER_ENV}={run_dir}"


class PrivateInstance:
    """The run's own Ray instance on this machine: its temp dir, its token, its processes."""

    def __init__(self, run_dir: str) -> None:
        self.marker = private_marker(run_dir)
        self.home = Path(tempfile.mkdtemp(prefix="wfray-", dir="/tmp"))  # short: socket paths
        self.token_file = self.home / "auth_token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self._saved: dict[str, str | None] = {}

    def start(self, cpus: float) -> str:
        """Start the instance and connect this process to it; its GCS address."""
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": None}
        self._saved = rt.set_env({**auth, "RAY_AUTH_TOKEN_PATH": str(self.token_file)})
        rt.reset_auth_token()
        os.environ[MARKER_ENV] = self.marker.partition("=")[2]  # inherited by its processes
        try:
            # In this (the main) thread: its processes die with the thread that started them.
            with rt.loopback():
                rt.start_private(cpus, str(self.home / "ray"))
        finally:
            os.environ.pop(MARKER_ENV, None)
        return rt.gcs_address()

    def close(self) -> None:
        """Stop the instance: every process of it left is killed, its temp dir removed."""
        rt.shutdown()
        reap(self.marker)
        shutil.rmtree(self.home, ignore_errors=True)
        rt.set_env(self._saved)
        self._saved = {}
        rt.reset_auth_token()


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` ('NAME=VALUE')."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                zombie = f.read().rpartition(b")")[2].split()[0] == b"Z"
        except (OSError, IndexError):
            continue
        if marker.encode() in env and not zombie:
            found.append(int(entry.name))
    return found


def reap(marker: str, grace_s: float = 5.0) -> None:
    """Kill (TERM, then KILL) every process still carrying ``marker`` (``ray.shutdown`` left)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        pids = marked_pids(marker)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = marked_pids(marker)
        if not pids:
            return


def parse_address(address: Any) -> tuple[str, int] | str | None:
    """None, 'auto', or (host, port); ConfigError naming ``launcher.address`` otherwise."""
    if address is None:
        return None
    if not isinstance(address, str) or not address.strip():
        raise config_error("launcher.address", address, ADDRESS_ALLOWED)
    text = address.strip()
    if text == "auto":
        return "auto"
    if text.startswith("ray://"):
        raise config_error(
            "launcher.address",
            address,
            "Ray Client (ray://) is not supported: the launcher "
            "joins the cluster as a driver (run it on a node or a pod of the cluster) at the "
            "GCS address HOST:PORT (port 6379 by default)",
        )
    m = _ADDRESS.fullmatch(text)
    if m is None or not 0 < int(m["port"]) < 65536:
        raise config_error("launcher.address", address, ADDRESS_ALLOWED)
    return m["host"].strip("[]"), int(m["port"])


@dataclass(frozen=True)
class Node:
    """One alive node of the cluster, as the GCS reports it."""

    node_id: str
    ip: str
    manager_port: int
    cpus: float
    gpus: float
    head: bool
    name: str = ""
    host: str = ""

    def describe(self) -> str:
        gpus = f", {self.gpus:g} GPU" if self.gpus else ""
        name = f" [{self.name}]" if self.name else ""
        head = ", head" if self.head else ""
        return f"node {self.node_id[:12]}{name} ({self.ip}: {self.cpus:g} CPU{gpus}{head})"

    def fits(self, cpus: float, gpus: float) -> int:
        """How many ranks of ``cpus`` CPUs and ``gpus`` GPUs the node holds."""
        by_cpu = math.floor(self.cpus / cpus + 1e-9) if cpus else 1 << 30
        by_gpu = math.floor(self.gpus / gpus + 1e-9) if gpus else 1 << 30
        return min(by_cpu, by_gpu)

    def reachable(self, timeout_s: float = 1.0) -> bool:
        """Whether its raylet still answers a TCP connect (refused at once when it died)."""
        if not self.ip or not self.manager_port:
            return True
        try:
            _probe(self.ip, self.manager_port, timeout_s)
        except OSError:
            return False
        return True


def _probe(host: str, port: int, timeout_s: float) -> None:
    """OSError unless something accepts a TCP connection at ``host:port``."""
    with socket.create_connection((host, port), timeout=timeout_s):
        return


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes (head first)."""
    nodes = []
    for info in (n for n in rt.list_nodes() if n.get("Alive")):
        res = info.get("Resources") or {}
        names = sorted(k for k in res if k.startswith("wf_node_"))
        nodes.append(
            Node(
                str(info["NodeID"]),
                str(info.get("NodeManagerAddress") or ""),
                int(info.get("NodeManagerPort") or 0),
                float(res.get("CPU", 0)),
                float(res.get("GPU", 0)),
                "node:__internal_head__" in res,
                names[0] if names else "",
                str(info.get("NodeManagerHostname") or ""),
            )
        )
    return sorted(nodes, key=lambda n: (not n.head, n.node_id))


def describe_nodes(nodes: list[Node]) -> str:
    return "; ".join(n.describe() for n in nodes) or "no alive node"


def check_fits(nodes: list[Node], lc: Any, world_size: int, where: str) -> None:
    """ConfigError when the run can never be placed on these nodes (their total resources)."""
    have = f"the cluster at {where} has {len(nodes)} alive node(s): {describe_nodes(nodes)}"
    cpus, gpus = float(lc.cpus_per_rank), float(lc.gpus_per_rank)
    if lc.nodes is not None and lc.nodes > len(nodes):
        raise config_error(
            "launcher.nodes", lc.nodes, f"{have}; choose at most {len(nodes)}, or null (anywhere)"
        )
    if not any(n.fits(cpus, gpus) for n in nodes):
        field, value, unit = (
            ("launcher.gpus_per_rank", lc.gpus_per_rank, "GPU")
            if gpus and not any(n.gpus >= gpus for n in nodes)
            else ("launcher.cpus_per_rank", lc.cpus_per_rank, "CPU")
        )
        raise config_error(field, value, f"no node has {value:g} {unit}(s) for one rank; {have}")
    and_gpus = lambda n: f" and {n * gpus:g} GPU(s)" if gpus else ""  # noqa: E731
    if lc.nodes is not None:
        per = world_size // lc.nodes
        able = [n for n in nodes if n.fits(cpus, gpus) >= per]
        if len(able) < lc.nodes:
            raise config_error(
                "launcher.nodes",
                lc.nodes,
                f"{lc.nodes} node(s) of {per} rank(s) each need {per * cpus:g} CPU(s)"
                f"{and_gpus(per)} per node (launcher.cpus_per_rank={cpus:g}, gpus_per_rank="
                f"{gpus:g}); only {len(able)} node(s) have that: {have}",
            )
    elif (room := sum(n.fits(cpus, gpus) for n in nodes)) < world_size:
        raise config_error(
            "launcher.cpus_per_rank",
            lc.cpus_per_rank,
            f"the layout has {world_size} rank(s) but the cluster holds at most {room} of "
            f"{cpus:g} CPU(s){and_gpus(1)} each; {have}",
        )


def _bounded(fn: Any, timeout_s: float, what: str) -> Any:
    """``fn()`` in a daemon thread, at most ``timeout_s``: Ray's own connect retries for minutes
    (a private instance must start in a thread that outlives it instead)."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    worker = threading.Thread(target=call, name="wf-ray-connect", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(
            f"{what} did not answer within {timeout_s:g} s (launcher.placement_timeout_s)"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass
class Connection:
    """This process's connection to the run's cluster (a private instance ends on close)."""

    address: str
    instance: PrivateInstance | None = None

    def close(self) -> None:
        """Leave the cluster; a private instance is stopped and any process of it left killed."""
        if self.instance is not None:
            self.instance.close()
        else:
            rt.shutdown()


def connect(lc: Any, run_dir: str, world_size: int, cpus: float | None = None) -> Connection:
    """Join ``launcher.address``, or start a private instance sized for the run (or ``cpus``: a
    sweep's points side by side); ConfigError when the cluster does not answer."""
    target = parse_address(lc.address)
    timeout = float(lc.placement_timeout_s)
    instance = None
    if target is None:
        instance = PrivateInstance(run_dir)
        try:
            cpus = cpus or world_size * float(lc.cpus_per_rank)
            address = instance.start(max(float(os.cpu_count() or 1), cpus))
        except BaseException:
            instance.close()
            raise
    else:
        address = "auto" if target == "auto" else f"{target[0]}:{target[1]}"
        if isinstance(target, tuple):
            try:
                _probe(*target, min(timeout, 10.0))
            except OSError as exc:
                raise config_error(
                    "launcher.address",
                    address,
                    f"nothing answers there ({exc.strerror or type(exc).__name__}); start a "
                    f"cluster (scripts/ray_cluster.sh start) or give its GCS address; "
                    f"{ADDRESS_ALLOWED}",
                ) from None
        try:
            what = f"the Ray cluster at {lc.address}"
            _bounded(lambda: rt.join_cluster(address), timeout, what)
        except (TimeoutError, ConnectionError) as exc:
            raise config_error(
                "launcher.address",
                lc.address,
                f"{exc} (a cluster with token authentication also needs "
                "its token here: ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN); "
                f"{ADDRESS_ALLOWED}",
            ) from None
        address = rt.gcs_address()
    rt.route_cluster_messages(logger.debug)
    return Connection(address, instance)
