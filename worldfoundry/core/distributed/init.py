"""``dist_init``: from an engine config and the launch environment to live groups."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .groups import init_distributed_environment, initialize_model_parallel
from .topology import Layout

BACKENDS = ("auto", "nccl", "gloo", "cpu:gloo,cuda:nccl")


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


def _get(cfg: Any, name: str, default: Any) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    if hasattr(cfg, "get") and not hasattr(cfg, name):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def resolve_backend(requested: str, local_world_size: int, local_rank: int) -> str:
    """Turn ``auto|nccl|gloo|cpu:gloo,cuda:nccl`` into the backend string to initialize.

    ``auto`` picks NCCL only when there is a GPU for every local rank. NCCL is
    initialized as ``cpu:gloo,cuda:nccl`` so that CPU tensors and objects have a
    gloo path in every group. Raises ValueError for an unknown backend, NCCL without
    CUDA, or more local ranks than GPUs.
    """
    req = str(requested).strip().lower().replace(" ", "")
    if req not in BACKENDS:
        raise ValueError(f"engine_config.distributed_backend={requested!r} is not allowed; "
                         f"choose one of {list(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if req == "auto":
        return "cpu:gloo,cuda:nccl" if gpus >= max(local_world_size, 1) else "gloo"
    if req == "gloo":
        return "gloo"
    if gpus == 0:
        raise ValueError(f"engine_config.distributed_backend={requested!r} needs CUDA, but this machine "
                         "has no usable GPU; use 'gloo' (or 'auto') to run on CPU")
    if local_world_size > gpus or local_rank >= gpus:
        raise ValueError(f"engine_config.distributed_backend={requested!r}: {local_world_size} local ranks "
                         f"(LOCAL_RANK={local_rank}) but only {gpus} GPU(s) on this node; start at most "
                         f"{gpus} ranks per node or use 'gloo'")
    return "cpu:gloo,cuda:nccl"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_init(config: Any) -> torch.device:
    """Initialize torch.distributed and the model-parallel groups from ``config.engine_config``.

    Reads ``distributed_backend`` (default ``auto``), ``distributed_timeout_minutes``
    (fractional allowed; default 30), ``tp_size`` / ``cp_size`` / ``pp_size`` /
    ``dp_size`` / ``order``, and RANK / WORLD_SIZE / LOCAL_RANK from the
    environment (absent: a single process). Binds ``cuda:LOCAL_RANK`` for NCCL,
    the CPU for gloo; creates the PP scheduler when ``pp_size > 1``. Every
    configuration error is raised before any group is made. Returns the device.
    """
    engine = _get(config, "engine_config", None)
    if engine is None:
        raise ValueError("dist_init(config): config has no 'engine_config' (expected fields "
                         "distributed_backend, distributed_timeout_minutes, tp_size, cp_size, pp_size)")
    env = LaunchEnv.from_environ()
    if dist.is_initialized():
        env = LaunchEnv(dist.get_rank(), dist.get_world_size(), env.local_rank, env.local_world_size)
    timeout_min = _get(engine, "distributed_timeout_minutes", 30)
    try:
        timeout_min = float(timeout_min)
    except (TypeError, ValueError):
        timeout_min = -1.0
    if not timeout_min > 0:
        raise ValueError(f"engine_config.distributed_timeout_minutes="
                         f"{_get(engine, 'distributed_timeout_minutes', None)!r}: must be a number > 0")
    dp = _get(engine, "dp_size", None)
    layout = Layout(
        env.world_size,
        tp_size=_get(engine, "tp_size", 1), cp_size=_get(engine, "cp_size", 1),
        pp_size=_get(engine, "pp_size", 1), dp_size=None if dp in (None, -1, 0) else dp,
        order=_get(engine, "order", "tp-cp-pp-dp"),
    )
    backend = resolve_backend(_get(engine, "distributed_backend", "auto"),
                              env.local_world_size, env.local_rank)
    device = torch.device("cpu")
    device_id = None
    if "nccl" in backend:
        device = device_id = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    from datetime import timedelta

    timeout = timedelta(minutes=timeout_min)
    if not dist.is_initialized():
        init_method = "env://"
        if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        init_distributed_environment(env.world_size, env.rank, init_method, env.local_rank,
                                     backend, timeout, device_id)
    else:
        init_distributed_environment()
    initialize_model_parallel(layout.tp_size, layout.pp_size, layout.cp_size,
                              _get(engine, "nccl_communicator_config_path", None), timeout_min,
                              layout.order, layout.dp_size)
    if layout.pp_size > 1:
        from .pipeline import init_pp_scheduler

        init_pp_scheduler()
    return device
