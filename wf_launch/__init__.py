"""wf_launch: one command from a Hydra config to running ranks.

What task authors import: ``register_task``, ``TaskContext`` and ``TaskConfig``. What a
script or function run by wf_launch (``task=script``, ``task=call``, ``python -m
wf_launch.run``) imports: ``progress``, ``should_stop``, ``checkpoint`` and
``report_result`` (no-ops under plain torchrun or alone; docs/scripts.md).
``from wf_launch import checkpoint`` is the module :mod:`wf_launch.checkpoint` (imported on
that line: it brings torch's DCP, which nothing else here needs).
"""

from __future__ import annotations

from .config import TaskConfig
from .rank.script_api import progress, report_result, should_stop
from .rank.task_context import TaskContext
from .rank.task_registry import register_task

__all__ = [
    "TaskConfig",
    "TaskContext",
    "progress",
    "register_task",
    "report_result",
    "should_stop",
]
