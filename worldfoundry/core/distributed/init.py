"""``dist_init``: from an engine config and the launch environment to live groups."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import runtime as _rt
from .backends import BACKENDS, resolve_backend
from .env import LaunchEnv, engine_from_environ, env_int, launch_attempt
from .groups import init_distributed_environment, initialize_model_parallel
from .pipeline import init_pp_scheduler
from .topology import Layout, engine_value

__all__ = [
    "BACKENDS",
    "LaunchEnv",
    "dist_init",
    "env_int",
    "launch_attempt",
    "resolve_backend",
    "start_default_group",
]


def _gloo_on_loopback() -> None:
    """A single process: gloo's listening socket (which no one needs to reach) on the loopback
    interface, unless ``GLOO_SOCKET_IFNAME`` already says where."""
    import socket

    names = (
        {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    )
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)


def start_default_group(
    requested_backend: str = "auto",
    timeout: timedelta | None = None,
    env: LaunchEnv | None = None,
    join_timeout: timedelta | None = None,
) -> tuple[torch.device, bool]:
    """Resolve the backend, bind this rank's device and start the default group unless it is up.

    The one start-up path of ``dist_init`` and ``distributed_run``:
    :func:`~.backends.resolve_backend` (so NCCL always starts as
    ``cpu:gloo,cuda:nccl``), ``torch.cuda.set_device(cuda:LOCAL_RANK)`` for NCCL,
    then :func:`~.runtime.init_default_group` with the launch's rank and world
    size (the launch's store, one per launch). A single process without
    MASTER_ADDR uses an in-process store (:data:`~.runtime.LOCAL_STORE`): nothing
    listens on any port. Returns ``(device, started)``;
    ``started`` is False when a default group was up already (it is left as is).
    Raises ValueError (from ``resolve_backend``) before anything is started.
    """
    env = LaunchEnv.from_environ() if env is None else env
    backend = resolve_backend(requested_backend, env.local_world_size, env.local_rank)
    device = torch.device("cpu")
    device_id = None
    if "nccl" in backend:
        device = device_id = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device, False
    init_method = "env://"
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        init_method = _rt.LOCAL_STORE
        _gloo_on_loopback()
    started = _rt.init_default_group(
        backend, env.world_size, env.rank, init_method, timeout, device_id, join_timeout
    )
    return device, started


def _join_timeout(seconds: Any) -> timedelta | None:
    """``init_timeout_s`` (how long ranks may take to join) as the store's join bound; None
    (the default bound) when it is not a positive number."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        return None
    return timedelta(seconds=value) if 0 < value < float("inf") else None


def dist_init(config: Any = None) -> torch.device:
    """Initialize torch.distributed and the model-parallel groups from ``config.engine_config``.

    Reads ``distributed_backend`` (default ``auto``), ``distributed_timeout_minutes``
    (fractional allowed; default 30), ``init_timeout_s`` (how long the launch's store waits
    for every rank; default 300), ``tp_size`` / ``cp_size`` / ``pp_size`` /
    ``dp_size`` / ``order``, and RANK / WORLD_SIZE / LOCAL_RANK from the
    environment (absent: a single process). Binds ``cuda:LOCAL_RANK`` for NCCL,
    the CPU for gloo; creates the PP scheduler when ``pp_size > 1``. Every
    configuration error is raised before any group is made. Returns the device.

    Without ``config`` (a script run by ``wf_launch task=script`` or ``torchrun``) the
    engine comes from the environment (:func:`~.env.engine_from_environ`: ``WF_TP_SIZE``,
    ``WF_CP_SIZE``, ``WF_PP_SIZE``, ``WF_DP_SIZE``, ``WF_ORDER``, the backend and
    timeout), and under plain torchrun, where none is set, every rank is data parallel.
    """
    if config is None:
        config = {"engine_config": engine_from_environ()}
    engine = engine_value(config, "engine_config", None)
    if engine is None:
        raise ValueError(
            "dist_init(config): config has no 'engine_config' (expected fields "
            "distributed_backend, distributed_timeout_minutes, tp_size, cp_size, pp_size)"
        )
    env = LaunchEnv.from_environ()
    if dist.is_initialized():
        env = LaunchEnv(
            dist.get_rank(), dist.get_world_size(), env.local_rank, env.local_world_size
        )
    timeout_min = engine_value(engine, "distributed_timeout_minutes", 30)
    try:
        timeout_min = float(timeout_min)
    except (TypeError, ValueError):
        timeout_min = -1.0
    if not timeout_min > 0:
        raise ValueError(
            f"engine_config.distributed_timeout_minutes="
            f"{engine_value(engine, 'distributed_timeout_minutes', None)!r}: must be a number > 0"
        )
    layout = Layout.from_engine(engine, env.world_size)
    device, started = start_default_group(
        engine_value(engine, "distributed_backend", "auto"),
        timedelta(minutes=timeout_min),
        env,
        _join_timeout(engine_value(engine, "init_timeout_s", None)),
    )
    if started:
        _rt.current().owns_world = True
    init_distributed_environment()
    initialize_model_parallel(
        layout.tp_size,
        layout.pp_size,
        layout.cp_size,
        engine_value(engine, "nccl_communicator_config_path", None),
        timeout_min,
        layout.order,
        layout.dp_size,
    )
    if layout.pp_size > 1:
        init_pp_scheduler()
    return device
