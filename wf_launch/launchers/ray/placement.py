"""Where ranks go: the placement group's bundles, each rank's node, and its environment.

``launcher.nodes`` null: one bundle per rank, PACK, ranks numbered node by node from the node
of bundle 0; N: N bundles of ``world / N`` ranks, STRICT_SPREAD. With GPUs every rank on a node
sees its GPUs in one order, its own first at its ``LOCAL_RANK`` (``dist_init`` binds it).
"""

from __future__ import annotations

from dataclasses import dataclass

from worldfoundry.core.distributed.env import ATTEMPT_ENV

from ...observe.stacks import rank_ranges

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
LAUNCHER_VARS += ("MASTER_PORT", ATTEMPT_ENV, "CUDA_VISIBLE_DEVICES", "WF_NODE")
"""What the launcher sets in every rank (``launcher.runtime_env.env_vars`` may not)."""


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


def shape(world_size: int, nodes: int | None, cpus_per_rank: float, gpus_per_rank: float) -> Shape:
    """The placement group for ``world_size`` ranks (``nodes``: exactly that many, None: any)."""
    per = 1 if nodes is None else world_size // nodes
    bundle = {"CPU": float(cpus_per_rank) * per}
    if gpus_per_rank:
        bundle["GPU"] = float(gpus_per_rank) * per
    if nodes is None:
        return Shape([bundle] * world_size, "PACK", 1)
    return Shape([bundle] * nodes, "STRICT_PACK" if nodes == 1 else "STRICT_SPREAD", per)


def assign(world_size: int, plan_shape: Shape, bundle_nodes: dict[int, str]) -> list[Slot]:
    """Each rank's bundle and node: consecutive ranks on one node, the node of bundle 0 first."""
    if plan_shape.ranks_per_bundle > 1 or len(plan_shape.bundles) != world_size:
        per = plan_shape.ranks_per_bundle
        return [Slot(r, r // per, bundle_nodes[r // per]) for r in range(world_size)]
    order = list(dict.fromkeys(bundle_nodes[i] for i in sorted(bundle_nodes)))
    bundles = sorted(bundle_nodes, key=lambda i: (order.index(bundle_nodes[i]), i))
    return [Slot(r, b, bundle_nodes[b]) for r, b in enumerate(bundles)]


def by_node(slots: list[Slot]) -> dict[str, list[int]]:
    """node -> its ranks, in rank order, nodes in the order of their first rank."""
    out: dict[str, list[int]] = {}
    for slot in sorted(slots, key=lambda s: s.rank):
        out.setdefault(slot.node, []).append(slot.rank)
    return out


def local_ranks(slots: list[Slot]) -> dict[int, tuple[int, int]]:
    """rank -> (LOCAL_RANK, LOCAL_WORLD_SIZE) among the ranks on its node."""
    return {r: (i, len(rs)) for rs in by_node(slots).values() for i, r in enumerate(rs)}


def cuda_orders(slots: list[Slot], granted: dict[int, list[str]]) -> dict[int, str]:
    """rank -> CUDA_VISIBLE_DEVICES: on each node one list, each rank's first GPU at its
    LOCAL_RANK (the node's other GPUs after them); empty without GPUs."""
    if not any(granted.values()):
        return {}
    out: dict[int, str] = {}
    for ranks in by_node(slots).values():
        firsts = [granted[r][0] for r in ranks if granted.get(r)]
        rest = [g for r in ranks for g in granted.get(r, [])[1:]]
        out.update(dict.fromkeys(ranks, ",".join(dict.fromkeys([*firsts, *rest]))))
    return out


def rank_env(
    slot: Slot,
    world_size: int,
    local: tuple[int, int],
    master: tuple[str, int],
    attempt: int,
    cuda: str | None = None,
) -> dict[str, str]:
    """The environment rank ``slot.rank`` gets (set in the rank before ``rank_main``)."""
    values = (slot.rank, world_size, *local, *master, attempt, cuda, slot.node)
    return {k: str(v) for k, v in zip(LAUNCHER_VARS, values) if v or k != "CUDA_VISIBLE_DEVICES"}


def describe_slots(slots: list[Slot], hosts: dict[str, str]) -> list[str]:
    """'ranks 0-3 on node 5bc47700 (host vm)', one per node (``hosts``: by node id)."""
    lines = []
    for node, ranks in by_node(slots).items():
        where = f"node {node[:12]}" + (f" (host {hosts[node]})" if hosts.get(node) else "")
        lines.append(f"rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)} on {where}")
    return lines
