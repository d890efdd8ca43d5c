"""A task module whose import hangs on one rank (``WF_TEST_HANG_RANK``), before that rank joins any
group.

``task.modules`` are imported on every rank before ``dist_init``, so this models a rank that
never arrives at start-up (a stuck file system, a deadlocked import). Forked ranks would inherit
the launcher's copy of the module instead of importing it, so the launcher forgets it in each
child it forks: every rank imports it afresh within a moment of the fork. (Spawned ranks import
it afresh anyway, but only after a whole interpreter's start-up, which on a loaded machine can
outlast a short start-up bound: the test would race the load.)
"""

from __future__ import annotations

import os
import sys
import time

from wf_launch import TaskContext, register_task


def _hang_here() -> None:
    time.sleep(600)


def _forget_in_child() -> None:
    sys.modules.pop(__name__, None)


if "RANK" not in os.environ:  # the launcher
    os.register_at_fork(after_in_child=_forget_in_child)
elif os.environ["RANK"] == os.environ.get("WF_TEST_HANG_RANK"):
    _hang_here()


@register_task("after_hang")
def after_hang(ctx: TaskContext) -> dict:
    ctx.groups["world"].barrier()
    return {}
