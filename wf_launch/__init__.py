"""wf_launch: one command from a Hydra config to running ranks.

What task authors import: ``register_task``, ``TaskContext`` and ``TaskConfig``. What a
script or function run by wf_launch (``task=script``, ``task=call``, ``python -m
wf_launch.run``) imports: ``progress``, ``should_stop``, ``checkpoint`` and
``report_result`` (no-ops under plain torchrun or alone; docs/scripts.md).
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "register_task": "wf_launch.rank.task_registry",
    "TaskContext": "wf_launch.rank.task_context",
    "TaskConfig": "wf_launch.config",
    "progress": "wf_launch.rank.script_api",
    "should_stop": "wf_launch.rank.script_api",
    "report_result": "wf_launch.rank.script_api",
}
_MODULES = {"checkpoint": "wf_launch.checkpoint"}
"""Names that are submodules: ``from wf_launch import checkpoint`` is the module, whichever import came first."""
__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str) -> Any:
    import importlib

    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name not in _EXPORTS:
        raise AttributeError(f"module 'wf_launch' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
