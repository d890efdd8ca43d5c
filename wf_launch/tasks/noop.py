"""Task ``noop``: init, one barrier, teardown; measures the launcher's own overhead."""

from __future__ import annotations

from typing import Any

from ..rank.task_context import TaskContext
from ..rank.task_registry import register_task

__all__ = ["noop"]


@register_task("noop")
def noop(ctx: TaskContext) -> dict[str, Any]:
    """Barrier on the world group, report the one step, and return nothing."""
    ctx.groups["world"].barrier()
    ctx.progress(1, 1)
    return {}
