"""The launch environment as the library reads it, without importing torch.

RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (:class:`LaunchEnv`) and the one
neutral variable that tells launch attempts apart (:data:`ATTEMPT_ENV`,
:func:`launch_attempt`), which every launcher sets.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ATTEMPT_ENV", "LaunchEnv", "env_int", "launch_attempt"]

ATTEMPT_ENV = "WF_ATTEMPT"
"""The one environment variable the library reads to tell launch attempts apart."""


def launch_attempt() -> int:
    """This process's launch attempt number: ``WF_ATTEMPT`` (set by launchers; absent or empty = 0).

    Raises ValueError, naming the variable, when it is not an integer >= 0.
    """
    raw = os.environ.get(ATTEMPT_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"environment variable {ATTEMPT_ENV}={raw!r} must be an integer >= 0 "
                         "(the launch attempt number: 0 for the first)")
    return value


def env_int(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """Integer environment variable ``name`` (``default`` when unset or empty); ValueError names it."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process: its rank, the world and its local slot."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> LaunchEnv:
        """Read RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (all absent: rank 0 of 1)."""
        env = os.environ if environ is None else environ

        def read(name: str, default: int) -> int:
            return env_int(name, default, env)

        world = read("WORLD_SIZE", 1)
        rank = read("RANK", 0)
        local_rank = read("LOCAL_RANK", rank if world == 1 else 0 if "RANK" not in env else rank)
        local_world = read("LOCAL_WORLD_SIZE", world if "LOCAL_RANK" not in env else local_rank + 1)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"RANK={rank} / WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE")
        return cls(rank, world, local_rank, max(local_world, local_rank + 1))
