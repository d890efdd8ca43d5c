"""A task whose launcher-side preload swallows a Ctrl-C (``task.modules=[wf_swallow_tasks]``;
see ``wf_swallow_preload``)."""

from __future__ import annotations

import time
from typing import Any

from wf_launch import TaskContext, register_task


@register_task("swallowed", preload=("wf_swallow_preload",))
def swallowed(ctx: TaskContext) -> dict[str, Any]:
    """A run of about 10 s that a Ctrl-C should never let start."""
    for step in range(1, 21):
        time.sleep(0.5)
        ctx.progress(step, 20)
    return {"steps": 20}
