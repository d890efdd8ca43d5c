"""DCP async-save staging into CPU buffers allocated once and reused by every save."""

from __future__ import annotations

from typing import Any

import torch

from worldfoundry.core.torch_private import copy_state_dict, create_cpu_state_dict

__all__ = ["CachedStager"]


class CachedStager:
    """DCP async stager that copies the state dict into CPU buffers allocated once and reused.

    Reuse is safe because a save waits for the previous one before staging again.
    Pinned when CUDA is available (faster device-to-host copies).
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._signature: Any = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = _signature(state_dict)
        if self._cache is None or signature != self._signature:
            self._cache = create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._signature = signature
        return copy_state_dict(state_dict, self._cache)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _signature(obj: Any) -> Any:
    """Structure, shapes and dtypes of a nested state dict (when it changes, new buffers are
    made)."""
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return ("T", tuple(local.shape), local.dtype)
    return type(obj).__name__
