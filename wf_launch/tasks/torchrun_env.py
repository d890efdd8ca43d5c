"""torchrun's environment contract, for code that starts its own process group (``task=script``,
``task=call``).

Every rank of such a task sees what ``torchrun`` gives its workers: ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node),
``GROUP_WORLD_SIZE``, ``ROLE_NAME``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT`` and
``TORCHELASTIC_MAX_RESTARTS``, plus the run's layout (``WF_TP_SIZE``, ``WF_CP_SIZE``,
``WF_PP_SIZE``, ``WF_DP_SIZE``, ``WF_ORDER``, the backend and timeout, read back by
``worldfoundry.core.distributed.dist_init()``) and ``WF_RUN_DIR``.

A launcher sets what its scheduler knows (the local launcher: torch's elastic agent
sets torchrun's own variables; SLURM: the job's); :func:`torchrun_environ` keeps those
and fills in the rest from the rank's place and the run, so the contract holds under
any launcher. Used in the rank (:func:`export`) and by the dry run, which shows the
command every rank runs.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import socket
import sys
import types
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.env import ATTEMPT_ENV, LaunchEnv, engine_environ

from ..config.engine import EngineConfig
from ..config.fields import is_number
from ..config.layout import layout_of

__all__ = ["RUN_DIR_ENV", "TORCHRUN_VARS", "export", "group_timeout", "torchrun_environ"]

RUN_DIR_ENV = "WF_RUN_DIR"
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)
"""torchrun's variables, in the order the dry run shows them."""


def _free_port() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _max_restarts(config: Mapping[str, Any]) -> int:
    launcher = config.get("launcher") or {}
    value = launcher.get("max_restarts", launcher.get("max_requeues", 0))
    return int(value) if isinstance(value, int) else 0


def torchrun_environ(
    config: Mapping[str, Any], run_dir: Path | str, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables a rank of ``config`` sees, given what its launcher set in ``environ`` (default:
    ours).

    A launcher's own values win; the rest follow torchrun: ``GROUP_RANK`` is the node
    (``RANK // LOCAL_WORLD_SIZE``), ``ROLE_*`` the rank and world, the run id the run
    directory's name, the restart count the launch attempt. A single rank without a
    ``MASTER_PORT`` gets a free one on loopback.
    """
    env = os.environ if environ is None else environ
    here = LaunchEnv.from_environ(dict(env))
    nodes = -(-here.world_size // here.local_world_size)
    defaults = {
        "RANK": str(here.rank),
        "LOCAL_RANK": str(here.local_rank),
        "WORLD_SIZE": str(here.world_size),
        "LOCAL_WORLD_SIZE": str(here.local_world_size),
        "GROUP_RANK": str(here.rank // here.local_world_size),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(here.rank),
        "ROLE_WORLD_SIZE": str(here.world_size),
        "MASTER_ADDR": "127.0.0.1",
        "TORCHELASTIC_RUN_ID": Path(run_dir).name,
        "TORCHELASTIC_RESTART_COUNT": env.get(ATTEMPT_ENV) or "0",
        "TORCHELASTIC_MAX_RESTARTS": str(_max_restarts(config)),
    }
    out = {k: env.get(k) or v for k, v in defaults.items()}
    if env.get("MASTER_PORT"):
        out["MASTER_PORT"] = env["MASTER_PORT"]
    elif here.world_size == 1:
        out["MASTER_PORT"] = _free_port()
    layout = layout_of(config)
    engine = {
        **config["engine"],
        **{f"{d}_size": n for d, n in layout.sizes.items()},
        "order": "-".join(layout.dims),
    }
    out.update(engine_environ(engine))
    out[RUN_DIR_ENV] = str(Path(run_dir).absolute())
    return out


def group_timeout(config: Mapping[str, Any]) -> float | None:
    """``engine.distributed_timeout_minutes`` when the user set it (it differs from the default),
    else None: torch's own default then stays (30 minutes; NCCL: 10)."""
    value = (config.get("engine") or {}).get("distributed_timeout_minutes")
    if not is_number(value) or float(value) == EngineConfig.distributed_timeout_minutes:
        return None
    return float(value)


def export(config: Mapping[str, Any], run_dir: Path | str) -> dict[str, str]:
    """Set :func:`torchrun_environ` in this rank's environment; returns what was set.

    When the user set ``engine.distributed_timeout_minutes``, it also becomes the default
    timeout of the process groups the code makes (:func:`group_timeout`).
    """
    env = torchrun_environ(config, run_dir)
    os.environ.update(env)
    minutes = group_timeout(config)
    if minutes is not None and _C10D in sys.modules:
        _set_group_timeout(minutes)
    elif minutes is not None:  # a fresh interpreter: torch stays unimported until the script
        sys.meta_path.insert(0, _AfterC10D(minutes))
    return env


_C10D = "torch.distributed.distributed_c10d"


def _set_group_timeout(minutes: float) -> None:
    from worldfoundry.core.torch_private import set_default_group_timeout  # imports torch

    set_default_group_timeout(minutes)


class _AfterC10D(importlib.abc.MetaPathFinder):
    """Sets the default group timeout once the script's own import of torch.distributed ran."""

    def __init__(self, minutes: float) -> None:
        self.minutes = minutes

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module, minutes = spec.loader.exec_module, self.minutes

        def exec_then_set(module: types.ModuleType) -> None:
            exec_module(module)
            # torch may still be importing here: set the globals set_default_group_timeout sets
            module.default_pg_timeout = module.default_pg_nccl_timeout = timedelta(minutes=minutes)

        spec.loader.exec_module = exec_then_set  # type: ignore[method-assign]
        return spec
