"""A task module whose import hangs on one rank (``WF_TEST_HANG_RANK``), before that rank joins any group.

``task.modules`` are imported on every rank before ``dist_init`` (spawned ranks import
them afresh), so this models a rank that never arrives at start-up (a stuck file
system, a deadlocked import).
"""

from __future__ import annotations

import os
import time

from wf_launch import TaskContext, register_task


def _hang_here() -> None:
    time.sleep(600)


if os.environ.get("RANK") == os.environ.get("WF_TEST_HANG_RANK"):
    _hang_here()


@register_task("after_hang")
def after_hang(ctx: TaskContext) -> dict:
    ctx.groups["world"].barrier()
    return {}
