"""The launch environment as the library reads it, without importing torch.

RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (:class:`LaunchEnv`), the one
neutral variable that tells launch attempts apart (:data:`ATTEMPT_ENV`,
:func:`launch_attempt`), which every launcher sets, and the layout a launcher hands
code that starts its own process group (:data:`ENGINE_ENV`: ``WF_TP_SIZE`` ...,
written by :func:`engine_environ`, read back by :func:`engine_from_environ`, which
``dist_init()`` without a config uses).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ATTEMPT_ENV",
    "ENGINE_ENV",
    "LAUNCH_PORTS",
    "LaunchEnv",
    "engine_environ",
    "engine_from_environ",
    "env_int",
    "launch_attempt",
]

ATTEMPT_ENV = "WF_ATTEMPT"
"""The one environment variable the library reads to tell launch attempts apart."""

LAUNCH_PORTS = (20000, 32000)
"""Where a launcher picks a ``MASTER_PORT`` that rank 0 binds later: below Linux's ephemeral
range (32768-60999), so no connection opened meanwhile can be handed the port, and above Ray's
worker ports (10002-19999)."""


ENGINE_ENV: dict[str, str] = {
    "tp_size": "WF_TP_SIZE",
    "cp_size": "WF_CP_SIZE",
    "pp_size": "WF_PP_SIZE",
    "dp_size": "WF_DP_SIZE",
    "order": "WF_ORDER",
    "distributed_backend": "WF_DISTRIBUTED_BACKEND",
    "distributed_timeout_minutes": "WF_DISTRIBUTED_TIMEOUT_MINUTES",
}
"""Engine field -> the environment variable that carries it to code that starts its own group."""


def engine_environ(engine: Mapping[str, object]) -> dict[str, str]:
    """The :data:`ENGINE_ENV` variables for ``engine`` (a resolved ``engine`` section; absent fields
    are left out)."""
    return {var: str(engine[key]) for key, var in ENGINE_ENV.items() if engine.get(key) is not None}


def engine_from_environ(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """An engine config from the :data:`ENGINE_ENV` variables (what a launcher set), for
    ``dist_init()``.

    Sizes that are absent are 1, except ``dp_size``, which then takes what the world
    size leaves (plain torchrun: every rank data parallel). ValueError names a variable
    that is not an integer.
    """
    env = os.environ if environ is None else environ
    engine: dict[str, object] = {}
    for key, var in ENGINE_ENV.items():
        raw = env.get(var, "").strip()
        if not raw:
            continue
        if key.endswith("_size"):
            engine[key] = env_int(var, 1, env)
        elif key == "distributed_timeout_minutes":
            try:
                engine[key] = float(raw)
            except ValueError:
                raise ValueError(
                    f"environment variable {var}={raw!r} is not a number (minutes)"
                ) from None
        else:
            engine[key] = raw
    engine.setdefault("dp_size", None)
    return engine


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
        raise ValueError(
            f"environment variable {ATTEMPT_ENV}={raw!r} must be an integer >= 0 "
            "(the launch attempt number: 0 for the first)"
        )
    return value


def env_int(name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    """Integer environment variable ``name`` (``default`` when unset or empty); ValueError names
    it."""
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
