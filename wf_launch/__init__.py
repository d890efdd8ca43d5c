"""wf_launch: one command from a Hydra config to running ranks.

What task authors import: ``register_task``, ``TaskContext`` and ``TaskConfig``.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "register_task": "wf_launch.tasks.registry",
    "TaskContext": "wf_launch.tasks.context",
    "TaskConfig": "wf_launch.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'wf_launch' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
