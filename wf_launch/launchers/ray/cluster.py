"""The cluster a run goes to: its address, connecting to it (bounded), and whether the run can fit.

``launcher.address`` null starts a private Ray instance on this machine for the run (sized to
hold it, stopped after: every process it started is gone when :class:`Connection` closes);
``auto`` or ``HOST:PORT`` joins an existing cluster. Joining is bounded by
``launcher.placement_timeout_s``: nothing listening is refused at once, a server that is not a
Ray GCS after the bound, each with exit code 2 and nothing started.

:func:`check_fits` asks the cluster's nodes (their total resources) whether the run can ever
be placed: ``launcher.nodes`` larger than the cluster, ``cpus_per_rank`` / ``gpus_per_rank``
that no node has, a layout larger than the cluster: a :class:`ConfigError` naming the field and
what the cluster has, before any actor starts. A cluster that could hold the run but is busy
makes the placement wait (up to ``placement_timeout_s``).
"""

from __future__ import annotations

import math
import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import Any

from ...config.fields import config_error
from . import ray_adapter as rt
from .private import PrivateInstance

__all__ = [
    "Connection",
    "Node",
    "alive_nodes",
    "check_fits",
    "connect",
    "describe_nodes",
    "node_reachable",
    "parse_address",
]

_ADDRESS = re.compile(r"(?P<host>[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(?P<port>[0-9]{1,5})")
ADDRESS_ALLOWED = (
    "null (a private Ray instance on this machine, for this run), 'auto' (the cluster this "
    "machine belongs to: RAY_ADDRESS or the last one started here), or the head's GCS address "
    "HOST:PORT (e.g. 10.0.0.5:6379; on Kubernetes the KubeRay head service, "
    "raycluster-head-svc:6379)"
)


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

    @property
    def short(self) -> str:
        return self.node_id[:12]

    def describe(self) -> str:
        gpus = f", {self.gpus:g} GPU" if self.gpus else ""
        name = f" [{self.name}]" if self.name else ""
        head = ", head" if self.head else ""
        return f"node {self.short}{name} ({self.ip}: {self.cpus:g} CPU{gpus}{head})"


def _node(info: dict[str, Any]) -> Node:
    res = info.get("Resources") or {}
    names = sorted(k for k in res if k.startswith("wf_node_"))
    return Node(
        str(info["NodeID"]),
        str(info.get("NodeManagerAddress") or ""),
        int(info.get("NodeManagerPort") or 0),
        float(res.get("CPU", 0)),
        float(res.get("GPU", 0)),
        "node:__internal_head__" in res,
        names[0] if names else "",
        str(info.get("NodeManagerHostname") or ""),
    )


def alive_nodes() -> list[Node]:
    """The cluster's alive nodes (head first)."""
    nodes = [_node(n) for n in rt.list_nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (not n.head, n.node_id))


def describe_nodes(nodes: list[Node]) -> str:
    return "; ".join(n.describe() for n in nodes) or "no alive node"


def _fit(node: Node, cpus: float, gpus: float) -> int:
    """How many ranks of ``cpus`` CPUs and ``gpus`` GPUs the node holds."""
    by_cpu = math.floor(node.cpus / cpus + 1e-9) if cpus else 1 << 30
    by_gpu = math.floor(node.gpus / gpus + 1e-9) if gpus else 1 << 30
    return min(by_cpu, by_gpu)


def _one_rank_fits(nodes: list[Node], lc: Any, have: str) -> None:
    cpus, gpus = float(lc.cpus_per_rank), float(lc.gpus_per_rank)
    if any(_fit(n, cpus, gpus) for n in nodes):
        return
    field, value, unit = (
        ("launcher.gpus_per_rank", lc.gpus_per_rank, "GPU")
        if gpus and not any(n.gpus >= gpus for n in nodes)
        else ("launcher.cpus_per_rank", lc.cpus_per_rank, "CPU")
    )
    raise config_error(field, value, f"no node has {value:g} {unit}(s) for one rank; {have}")


def _nodes_fit(nodes: list[Node], lc: Any, world_size: int, have: str) -> None:
    """``launcher.nodes`` set: that many nodes must each hold their share of the ranks."""
    cpus, gpus = float(lc.cpus_per_rank), float(lc.gpus_per_rank)
    per = world_size // lc.nodes
    able = [n for n in nodes if _fit(n, cpus, gpus) >= per]
    if len(able) >= lc.nodes:
        return
    raise config_error(
        "launcher.nodes",
        lc.nodes,
        f"{lc.nodes} node(s) of {per} rank(s) each need "
        f"{per * cpus:g} CPU(s){f' and {per * gpus:g} GPU(s)' if gpus else ''} per node "
        f"(launcher.cpus_per_rank={cpus:g}, gpus_per_rank={gpus:g}); only {len(able)} "
        f"node(s) have that: {have}",
    )


def _world_fits(nodes: list[Node], lc: Any, world_size: int, have: str) -> None:
    """``launcher.nodes`` null: the whole cluster must hold every rank."""
    cpus, gpus = float(lc.cpus_per_rank), float(lc.gpus_per_rank)
    room = sum(_fit(n, cpus, gpus) for n in nodes)
    if room >= world_size:
        return
    raise config_error(
        "launcher.cpus_per_rank",
        lc.cpus_per_rank,
        f"the layout has {world_size} rank(s) but the cluster holds at most {room} of "
        f"{cpus:g} CPU(s){f' and {gpus:g} GPU(s)' if gpus else ''} each; {have}",
    )


def check_fits(nodes: list[Node], lc: Any, world_size: int, where: str) -> None:
    """ConfigError when the run can never be placed on these nodes (their total resources)."""
    have = f"the cluster at {where} has {len(nodes)} alive node(s): {describe_nodes(nodes)}"
    if lc.nodes is not None and lc.nodes > len(nodes):
        raise config_error(
            "launcher.nodes", lc.nodes, f"{have}; choose at most {len(nodes)}, or null (anywhere)"
        )
    _one_rank_fits(nodes, lc, have)
    if lc.nodes is not None:
        _nodes_fit(nodes, lc, world_size, have)
    else:
        _world_fits(nodes, lc, world_size, have)


def node_reachable(node: Node, timeout_s: float = 1.0) -> bool:
    """Whether the node's raylet still answers a TCP connect (it refuses at once when the raylet
    died)."""
    if not node.ip or not node.manager_port:
        return True
    try:
        with socket.create_connection((node.ip, node.manager_port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _tcp_probe(host: str, port: int, timeout_s: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise config_error(
            "launcher.address",
            f"{host}:{port}",
            f"nothing answers there ({why}); start a "
            f"cluster (scripts/ray_cluster.sh start) or give its GCS address; "
            f"{ADDRESS_ALLOWED}",
        ) from None


def _bounded(fn: Any, timeout_s: float, what: str) -> Any:
    """Run ``fn()`` in a helper thread, at most ``timeout_s``: Ray's own connect retries for
    minutes.

    Only for joining a cluster: a private instance must start in a thread that outlives it.
    """
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
    """This process's connection to the run's cluster (a private instance is stopped on
    :meth:`close`)."""

    address: str
    instance: PrivateInstance | None = None

    @property
    def private(self) -> bool:
        return self.instance is not None

    @property
    def token_file(self) -> str:
        """A private instance's token (for this user's tools that join it: ``status --stacks``)."""
        return str(self.instance.token_file) if self.instance is not None else ""

    def close(self) -> None:
        """Leave the cluster; a private instance is stopped and any process of it left is killed."""
        if self.instance is not None:
            self.instance.close()
        else:
            rt.shutdown()


def connect(
    lc: Any, run_dir: str, world_size: int, namespace: str | None = None, cpus: float | None = None
) -> Connection:
    """Join ``launcher.address`` or start a private instance sized for the run (or ``cpus``, a
    sweep's points
    side by side); ConfigError when the cluster does not answer."""
    target = parse_address(lc.address)
    timeout = float(lc.placement_timeout_s)
    if target is None:
        cpus = max(float(os.cpu_count() or 1), cpus or world_size * float(lc.cpus_per_rank))
        instance = PrivateInstance(run_dir)
        try:
            address = instance.start(cpus, namespace)
        except BaseException:
            instance.close()
            raise
        _route_messages()
        return Connection(address, instance)
    if isinstance(target, tuple):
        _tcp_probe(target[0], target[1], min(timeout, 10.0))
        address = f"{target[0]}:{target[1]}"
    else:
        address = "auto"
    try:
        _bounded(
            lambda: rt.join_cluster(address, namespace), timeout, f"the Ray cluster at {lc.address}"
        )
    except (TimeoutError, ConnectionError) as exc:
        raise config_error(
            "launcher.address",
            lc.address,
            f"{exc} (a cluster with token authentication also needs "
            "its token here: ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN); "
            f"{ADDRESS_ALLOWED}",
        ) from None
    _route_messages()
    return Connection(rt.gcs_address())


def _route_messages() -> None:
    from loguru import logger

    rt.route_cluster_messages(lambda line: logger.debug(line))
