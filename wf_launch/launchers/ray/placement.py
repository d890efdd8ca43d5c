"""Where ranks go: the placement group's bundles, each rank's bundle and node, and its environment.

Pure functions of the plan and what the cluster answered, so they are tested without a cluster.

* ``launcher.nodes`` null: one bundle per rank (``cpus_per_rank`` CPUs, ``gpus_per_rank`` GPUs),
  strategy PACK (as few nodes as Ray can). Ranks are then numbered node by node: the node of
  bundle 0 first, so rank 0 is on the first node and consecutive ranks share a node.
* ``launcher.nodes`` N: N bundles of ``world / N`` ranks each, STRICT_SPREAD (exactly N distinct
  nodes; STRICT_PACK for one), rank ``r`` in bundle ``r // (world / N)``.

A rank's ``LOCAL_RANK`` is its place among the ranks on its node. With GPUs, every rank on a node
sees the node's granted GPUs in one order in which its own first GPU sits at ``LOCAL_RANK``
(``dist_init`` binds ``cuda:LOCAL_RANK``); NCCL tells devices apart by bus id, not by index.
"""

from __future__ import annotations

from dataclasses import dataclass

from worldfoundry.core.distributed.env import ATTEMPT_ENV

from ...observe.stacks import rank_ranges

__all__ = [
    "LAUNCHER_VARS",
    "Shape",
    "Slot",
    "assign",
    "cuda_orders",
    "local_ranks",
    "rank_env",
    "shape",
]

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    ATTEMPT_ENV,
    "CUDA_VISIBLE_DEVICES",
    "WF_NODE",
)
"""Variables the launcher sets in every rank (``launcher.runtime_env.env_vars`` may not set
them)."""


@dataclass(frozen=True)
class Shape:
    """The placement group of a run: its bundles, Ray's strategy, and ranks per bundle."""

    bundles: list[dict[str, float]]
    strategy: str
    ranks_per_bundle: int

    def describe(self) -> str:
        first = ", ".join(f"{k} {v:g}" for k, v in self.bundles[0].items())
        return (
            f"{len(self.bundles)} bundle(s) of {{{first}}}, {self.strategy}, "
            f"{self.ranks_per_bundle} rank(s) each"
        )


@dataclass(frozen=True)
class Slot:
    """One rank's place: its bundle and the node that holds it."""

    rank: int
    bundle: int
    node: str


def _bundle(cpus: float, gpus: float, ranks: int) -> dict[str, float]:
    bundle = {"CPU": float(cpus) * ranks}
    if gpus:
        bundle["GPU"] = float(gpus) * ranks
    return bundle


def shape(world_size: int, nodes: int | None, cpus_per_rank: float, gpus_per_rank: float) -> Shape:
    """The placement group for ``world_size`` ranks (``nodes``: exactly that many nodes, or None:
    anywhere)."""
    if nodes is None:
        return Shape([_bundle(cpus_per_rank, gpus_per_rank, 1)] * world_size, "PACK", 1)
    per = world_size // nodes
    return Shape(
        [_bundle(cpus_per_rank, gpus_per_rank, per)] * nodes,
        "STRICT_PACK" if nodes == 1 else "STRICT_SPREAD",
        per,
    )


def assign(world_size: int, plan_shape: Shape, bundle_nodes: dict[int, str]) -> list[Slot]:
    """Each rank's bundle and node: consecutive ranks on one node, the node of bundle 0 first."""
    if plan_shape.ranks_per_bundle > 1 or len(plan_shape.bundles) != world_size:
        per = plan_shape.ranks_per_bundle
        return [Slot(r, r // per, bundle_nodes[r // per]) for r in range(world_size)]
    order: list[str] = []
    for index in sorted(bundle_nodes):
        if bundle_nodes[index] not in order:
            order.append(bundle_nodes[index])
    bundles = sorted(bundle_nodes, key=lambda i: (order.index(bundle_nodes[i]), i))
    return [Slot(r, b, bundle_nodes[b]) for r, b in enumerate(bundles)]


def local_ranks(slots: list[Slot]) -> dict[int, tuple[int, int]]:
    """rank -> (LOCAL_RANK, LOCAL_WORLD_SIZE) among the ranks on its node."""
    on_node: dict[str, list[int]] = {}
    for slot in slots:
        on_node.setdefault(slot.node, []).append(slot.rank)
    return {rank: (ranks.index(rank), len(ranks)) for ranks in on_node.values() for rank in ranks}


def cuda_orders(slots: list[Slot], granted: dict[int, list[str]]) -> dict[int, str]:
    """rank -> CUDA_VISIBLE_DEVICES for the ranks granted GPUs: on each node the same list, each
    rank's
    first GPU at its LOCAL_RANK (the rest of the node's GPUs after them); empty without GPUs."""
    if not any(granted.values()):
        return {}
    local = local_ranks(slots)
    out: dict[int, str] = {}
    by_node: dict[str, list[int]] = {}
    for slot in slots:
        by_node.setdefault(slot.node, []).append(slot.rank)
    for ranks in by_node.values():
        ranks = sorted(ranks, key=lambda r: local[r][0])
        firsts = [granted[r][0] for r in ranks if granted.get(r)]
        rest = [g for r in ranks for g in granted.get(r, [])[1:]]
        order = ",".join(dict.fromkeys([*firsts, *rest]))
        out.update({r: order for r in ranks})
    return out


def rank_env(
    slot: Slot,
    world_size: int,
    local: tuple[int, int],
    master: tuple[str, int],
    attempt: int,
    cuda: str | None = None,
) -> dict[str, str]:
    """The environment the launcher gives rank ``slot.rank`` (set in the rank before
    ``rank_main``)."""
    env = {
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local[0]),
        "LOCAL_WORLD_SIZE": str(local[1]),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        ATTEMPT_ENV: str(attempt),
        "WF_NODE": slot.node,
    }
    if cuda:
        env["CUDA_VISIBLE_DEVICES"] = cuda
    return env


def describe_slots(slots: list[Slot], hosts: dict[str, str]) -> list[str]:
    """'ranks 0-3 on node 5bc47700 (host vm)' lines, one per node, in rank order (``hosts``: the
    nodes' host names, by node id)."""

    lines: list[str] = []
    by_node: dict[str, list[int]] = {}
    for slot in slots:
        by_node.setdefault(slot.node, []).append(slot.rank)
    for node, ranks in by_node.items():
        host = hosts.get(node)
        where = f"node {node[:12]}" + (f" (host {host})" if host else "")
        lines.append(f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)} on {where}")
    return lines
