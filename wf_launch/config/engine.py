"""The ``engine`` section: how ranks are laid out and connected (read by ``dist_init``).

OmegaConf checks types when a value is set; each field declares what values it allows, and
:meth:`EngineConfig.validate` checks them and what spans fields (the way torchtitan's
``ParallelDims`` validates itself), raising :class:`~wf_launch.config.fields.ConfigError`
naming the field, the value and what is allowed, before any process starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from worldfoundry.core.distributed.backends import BACKENDS
from worldfoundry.core.distributed.topology import DIMS, Layout, parse_order

from .fields import check_fields, choice, config_error, integer, number, unknown_field

__all__ = [
    "BACKENDS",
    "MAX_TIMEOUT_MINUTES",
    "MAX_WORLD_SIZE",
    "MIN_TIMEOUT_MINUTES",
    "NCCL_BACKENDS",
    "EngineConfig",
    "normalize_backend",
]

NCCL_BACKENDS = tuple(b for b in BACKENDS if "nccl" in b)
MIN_TIMEOUT_MINUTES = 0.001 / 60
"""1 ms: torch rounds a timeout to whole milliseconds, and 0 ms means "fail at once"."""
MAX_TIMEOUT_MINUTES = 7 * 24 * 60
"""A week: longer (or ``inf``) overflows the timedelta torch hands to C++."""
MAX_WORLD_SIZE = 2**31 - 1
"""c10d ranks are 32-bit."""


def normalize_backend(backend: Any) -> str:
    """'cpu:gloo, cuda:nccl' -> 'cpu:gloo,cuda:nccl'; case and spaces do not matter."""
    return str(backend).replace(" ", "").lower()


@dataclass
class EngineConfig:
    """How ranks are laid out and connected (read by ``dist_init``)."""

    distributed_backend: str = choice("auto", BACKENDS, normalize=normalize_backend)
    distributed_timeout_minutes: float = number(
        30.0,
        MIN_TIMEOUT_MINUTES,
        MAX_TIMEOUT_MINUTES,
        allowed=f"expected minutes from {MIN_TIMEOUT_MINUTES:.6g} (1 ms) to "
        f"{MAX_TIMEOUT_MINUTES} (a week); fractions allowed, e.g. 0.5",
    )
    init_timeout_s: float = number(
        300.0,
        1,
        MAX_TIMEOUT_MINUTES * 60,
        unit="seconds",
        note="(how long ranks may take to join the process groups)",
    )
    tp_size: int = integer(1, low=1)
    cp_size: int = integer(1, low=1)
    pp_size: int = integer(1, low=1)
    dp_size: int = integer(1, low=1)
    order: str = "tp-cp-pp-dp"
    nccl_communicator_config_path: str | None = None

    @classmethod
    def from_dict(cls, engine: Mapping[str, Any]) -> EngineConfig:
        """The engine section as a validated dataclass (unknown keys are an error)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in engine if k not in known)
        if unknown:
            raise unknown_field(f"engine.{unknown[0]}", engine[unknown[0]], known)
        cfg = cls(**{k: engine[k] for k in known if k in engine})
        cfg.validate()
        return cfg

    @property
    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, f"{d}_size") for d in DIMS}

    @property
    def world_size(self) -> int:
        world = 1
        for v in self.sizes.values():
            world *= v
        return world

    @property
    def backend(self) -> str:
        return normalize_backend(self.distributed_backend)

    def validate(self) -> None:
        """Raise :class:`ConfigError` for the first value that is not allowed."""
        check_fields(self, "engine")
        if self.world_size > MAX_WORLD_SIZE:
            raise config_error(
                "engine.tp_size*cp_size*pp_size*dp_size",
                self.world_size,
                f"the world size must be at most {MAX_WORLD_SIZE} ranks (c10d ranks are 32-bit)",
            )
        try:
            parse_order(self.order, self.sizes, self.world_size)
        except ValueError as exc:
            raise config_error(
                "engine.order", self.order, f"a '-'-joined permutation of {'/'.join(DIMS)} ({exc})"
            ) from None

    def layout(self) -> Layout:
        """The layout these sizes describe (world size = their product)."""
        return Layout.from_engine(self)
