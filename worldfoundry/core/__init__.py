"""worldfoundry.core: the public face of the runtime; every name is imported lazily.

``import worldfoundry.core`` is cheap (no torch import); a name is imported from
its focused module the first time it is used.
"""

from __future__ import annotations

from typing import Any

from . import distributed as _distributed

__all__ = list(_distributed.__all__)


def __getattr__(name: str) -> Any:
    if name in _distributed._EXPORTS:
        return getattr(_distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "distributed"])
