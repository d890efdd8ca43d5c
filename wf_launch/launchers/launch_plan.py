"""LaunchPlan: what will run, computed once in the launcher as plain data, and the dry run's
layout table."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import DIMS, Layout

from ..config.layout import rank_label
from .registry import get_launcher

__all__ = ["TABLE_MAX_RANKS", "LaunchPlan"]


TABLE_MAX_RANKS = 256
"""Above this many ranks the dry run's layout table shows only its first and last rows."""
TABLE_EDGE_ROWS = 8


@dataclass(frozen=True)
class LaunchPlan:
    """The resolved config, its layout and where the run writes."""

    config: dict[str, Any]
    layout: Layout
    run_dir: Path
    overrides: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def launcher(self) -> str:
        return str(self.config["launcher"]["name"])

    @property
    def task(self) -> str:
        return str(self.config["task"]["name"])

    @cached_property
    def launcher_config(self) -> Any:
        """The ``launcher`` section as the chosen launcher's typed config (its ``config_class``)."""
        return get_launcher(self.launcher).config_class.build(self.config["launcher"])

    def run_info(self) -> dict[str, Any]:
        """What every launcher's ``result.json`` says of the launch: launcher, task, overrides,
        run directory."""
        return {
            "launcher": self.launcher,
            "task": self.task,
            "overrides": self.overrides,
            "run_dir": str(self.run_dir),
        }

    def label(self, rank: int) -> str:
        """'r5 tp0 cp1 pp1 dp0' for log prefixes and failure reports."""
        return rank_label(rank, self.layout.coords(rank))

    def layout_table(self, max_rows: int = TABLE_MAX_RANKS) -> str:
        """Every rank's coordinates and group members, as a fixed-width text table.

        Above ``max_rows`` ranks only the first and last few are shown (with a
        count of those left out), so a dry run of any world size stays small.
        """
        L = self.layout
        shown = list(range(L.world_size))
        if L.world_size > max_rows:
            edge = TABLE_EDGE_ROWS
            shown = [*range(edge), *range(L.world_size - edge, L.world_size)]
        head = ["rank", *DIMS, *(f"{d} group" for d in DIMS)]
        rows = [
            [str(r), *(str(L.coords(r)[d]) for d in DIMS), *(_members(L, r, d) for d in DIMS)]
            for r in shown
        ]
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [
            fmt.format(*head),
            fmt.format(*("-" * w for w in widths)),
            *(fmt.format(*row) for row in rows),
        ]
        if len(shown) < L.world_size:
            lines.insert(
                2 + TABLE_EDGE_ROWS,
                f"... {L.world_size - len(shown)} more ranks, not shown "
                f"(the table lists every rank up to {max_rows})",
            )
        return "\n".join(lines)


def _members(layout: Layout, rank: int, dim: str) -> str:
    """``rank``'s group along ``dim``: '0,1,2', or '0..65532 step 4 (16384 ranks)' when long.

    A group along one dimension is an arithmetic progression (its stride), so a
    long one is described without listing its members.
    """
    size, stride = layout.sizes[dim], layout.strides[dim]
    first = rank - layout.coords(rank)[dim] * stride
    if size <= 8:
        return ",".join(str(first + k * stride) for k in range(size))
    return f"{first}..{first + (size - 1) * stride} step {stride} ({size} ranks)"
