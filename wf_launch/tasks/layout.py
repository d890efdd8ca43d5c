"""Task ``layout``: every rank's place in the parallel layout, each group proven with real
collectives.

Each rank checks every group it belongs to ('world', 'tp', 'cp', 'pp', 'dp',
'tp-cp', 'dp-cp', 'tp-pp') on the group's device group:

- ``all_reduce`` (sum) of the global rank must equal the sum of the members;
- ``all_gather`` of the global rank must list the members in group-rank order.

The rows go to every rank with ``all_gather_object`` on the world CPU group; rank 0
also checks that the rows agree with one another and with the layout
(``Layout.coords`` / ``Layout.group_of``), and returns the table plus a rendered
text table for the launcher to print.
"""

from __future__ import annotations

import itertools
import socket
from typing import Any

import torch
import torch.distributed as dist

from worldfoundry.core.distributed import get_layout
from worldfoundry.core.distributed.topology import COMBINED, DIMS

from ..rank.task_context import TaskContext
from ..rank.task_registry import register_task

__all__ = ["GROUPS", "check_group", "format_ranks", "layout", "render_table"]

GROUPS: tuple[str, ...] = (*DIMS, *COMBINED)
"""Groups shown in the table (and checked, with 'world')."""


def check_group(group: Any, device: Any) -> list[str]:
    """Run the two collectives on ``group``; return what went wrong (empty when all is well)."""
    me = torch.tensor([group.rank], dtype=torch.int64, device=device)
    total = me.clone()
    dist.all_reduce(total, group=group.device_group)
    gathered = [torch.empty_like(me) for _ in range(group.world_size)]
    dist.all_gather(gathered, me, group=group.device_group)
    errors = []
    if int(total.item()) != sum(group.ranks):
        errors.append(
            f"{group.name}: all_reduce of global ranks gave {int(total.item())}, "
            f"members {group.ranks} sum to {sum(group.ranks)}"
        )
    seen = [int(t.item()) for t in gathered]
    if seen != list(group.ranks):
        errors.append(
            f"{group.name}: all_gather of global ranks gave {seen}, expected {group.ranks}"
        )
    return errors


def format_ranks(ranks: list[int]) -> str:
    """Compact member list: '3', '0,4', '0-3' (consecutive), '0-12:4' (every 4th), else '0,1,5'."""
    if len(ranks) == 1:
        return str(ranks[0])
    if len(ranks) == 2:
        return f"{ranks[0]},{ranks[1]}"
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in itertools.pairwise(ranks)):
        return f"{ranks[0]}-{ranks[-1]}" + ("" if step == 1 else f":{step}")
    shown = ",".join(map(str, ranks[:8]))
    return shown if len(ranks) <= 8 else f"{shown},...(+{len(ranks) - 8})"


def render_table(rows: list[dict[str, Any]], title: str = "") -> str:
    """Text table, one line per rank: host, local rank, tp/cp/pp/dp coordinates, group members,
    check."""
    header = ["rank", "host", "local", *DIMS, *(f"{g} group" for g in GROUPS), "check"]
    body = [
        [
            str(r["rank"]),
            str(r["host"]),
            str(r["local_rank"]),
            *(str(r["coords"][d]) for d in DIMS),
            *(format_ranks(r["groups"][g]) for g in GROUPS),
            "ok" if r["ok"] else "FAIL",
        ]
        for r in rows
    ]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    numeric = {0, 2, 3, 4, 5, 6}
    lines = [
        "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))
        ).rstrip()
        for line in [header, *body]
    ]
    return "\n".join(([title] if title else []) + lines)


def _cross_check(rows: list[dict[str, Any]]) -> list[str]:
    """Rank 0: rows agree with the layout and every member of a group lists the same members."""

    layout = get_layout()
    errors = []
    if [r["rank"] for r in rows] != list(range(layout.world_size)):
        errors.append(
            f"rows are from ranks {[r['rank'] for r in rows]}, expected 0..{layout.world_size - 1}"
        )
        return errors
    for r in rows:
        if r["coords"] != layout.coords(r["rank"]):
            errors.append(
                f"rank {r['rank']}: coords {r['coords']} != layout's {layout.coords(r['rank'])}"
            )
        for g in GROUPS:
            members = r["groups"][g]
            if members != layout.group_of(r["rank"], g):
                errors.append(
                    f"rank {r['rank']}: {g} group {members} != layout's "
                    f"{layout.group_of(r['rank'], g)}"
                )
            if any(rows[m]["groups"][g] != members for m in members):
                errors.append(
                    f"rank {r['rank']}: members of its {g} group {members} do not all agree"
                )
    return errors


@register_task("layout")
def layout(ctx: TaskContext) -> dict[str, Any]:
    """Check every group on this rank; rank 0 returns the whole table, others their own row."""
    errors: list[str] = []
    for name in ("world", *GROUPS):
        errors += check_group(ctx.groups[name], ctx.device)
    row = {
        "rank": ctx.rank,
        "host": socket.gethostname(),
        "local_rank": ctx.local_rank,
        "device": str(ctx.device),
        "coords": dict(ctx.coords),
        "groups": {g: list(ctx.groups[g].ranks) for g in GROUPS},
        "ok": not errors,
        "errors": errors,
    }
    world = ctx.groups["world"]
    rows: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(rows, row, group=world.cpu_group)
    if not ctx.is_main:
        return {"rank": ctx.rank, "coords": row["coords"], "ok": all(r["ok"] for r in rows)}

    cross = _cross_check(rows)
    ok = all(r["ok"] for r in rows) and not cross
    table = render_table(rows, f"layout: {get_layout().describe()}")
    if cross:
        table += "\n" + "\n".join(f"! {e}" for e in cross)
    return {
        "ok": ok,
        "layout": get_layout().sizes,
        "order": "-".join(get_layout().dims),
        "rows": rows,
        "errors": [e for r in rows for e in r["errors"]] + cross,
        "table": table,
    }
