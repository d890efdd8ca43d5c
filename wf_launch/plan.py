"""LaunchPlan: what will run, computed once in the launcher as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import DIMS, Layout

from .ranklog import rank_label

__all__ = ["LaunchPlan"]


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

    def label(self, rank: int) -> str:
        """'r5 tp0 cp1 pp1 dp0' for log prefixes and failure reports."""
        return rank_label(rank, self.layout.coords(rank))

    def layout_table(self) -> str:
        """Every rank's coordinates and group members, as a fixed-width text table."""
        L = self.layout
        head = ["rank", *DIMS, *(f"{d} group" for d in DIMS)]
        rows = [[str(r), *(str(L.coords(r)[d]) for d in DIMS),
                 *(",".join(map(str, L.group_of(r, d))) for d in DIMS)] for r in range(L.world_size)]
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)),
                          *(fmt.format(*row) for row in rows)])
