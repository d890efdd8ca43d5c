"""wf_launch: one command from a Hydra config to running ranks.

What task authors import: ``register_task``, ``TaskContext`` and ``TaskConfig``. What a
script or function run by wf_launch (``task=script``, ``task=call``, ``python -m
wf_launch.run``) imports: ``progress``, ``should_stop``, ``checkpoint`` and
``report_result`` (no-ops under plain torchrun or alone; docs/scripts.md).

The names resolve on first use, not here: ``python -m wf_launch`` (and every
``python -m wf_launch.NAME``) imports this package before its ``__main__`` can install the
Ctrl-C guard (:mod:`wf_launch.observe.interrupt`); importing Hydra and yaml here would let a
Ctrl-C during those imports print a traceback (tests/test_cli_promises.py).
"""

from __future__ import annotations

from importlib import import_module
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
__all__ = sorted([*_EXPORTS, *_MODULES])


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return import_module(_MODULES[name])
    if name not in _EXPORTS:
        raise AttributeError(f"module 'wf_launch' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
