"""Backends: the one list of allowed backend names, the one resolver, the one device rule.

Importing this module does not import torch (the launcher validates configs with
``BACKENDS`` before anything heavy loads).

``BACKENDS`` is what ``engine_config.distributed_backend`` accepts;
:func:`resolve_backend` turns a request into the string the default group is
initialized with (NCCL always as ``cpu:gloo,cuda:nccl``); :func:`group_device`
answers "which device does this group's traffic use", for every helper that
allocates communication buffers (CP, PP, gather, FSDP2's mesh).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "NCCL_BACKEND", "group_device", "local_gpu_count", "resolve_backend"]

BACKENDS: tuple[str, ...] = ("auto", "nccl", "gloo", "cpu:gloo,cuda:nccl")
"""Values ``engine_config.distributed_backend`` may take."""

NCCL_BACKEND = "cpu:gloo,cuda:nccl"
"""How NCCL is initialized: CPU tensors and objects keep a gloo path in every group."""

_DEVICE_BACKENDS = (("nccl", "cuda"), ("xccl", "xpu"))


def local_gpu_count() -> int:
    """CUDA devices this process sees, asked without spoiling a later fork.

    ``torch.cuda.is_available()`` asks the CUDA runtime, and a launcher that asked it can no longer
    fork ranks that use CUDA ("Cannot re-initialize CUDA in forked subprocess", seen on an H200).
    ``device_count()`` asks NVML, which is fork-safe; torch falls back to the runtime only where
    NVML is missing.
    """
    import torch

    return torch.cuda.device_count()


def resolve_backend(requested: str, local_world_size: int, local_rank: int) -> str:
    """Turn ``auto|nccl|gloo|cpu:gloo,cuda:nccl`` into the backend string to initialize.

    ``auto`` picks NCCL only when there is a GPU for every local rank. NCCL is
    initialized as ``cpu:gloo,cuda:nccl`` so that CPU tensors and objects have a
    gloo path in every group. Raises ValueError for an unknown backend, NCCL without
    CUDA, or more local ranks than GPUs.
    """
    req = str(requested).strip().lower().replace(" ", "")
    if req not in BACKENDS:
        raise ValueError(
            f"engine_config.distributed_backend={requested!r} is not allowed; "
            f"choose one of {list(BACKENDS)}"
        )
    gpus = local_gpu_count()
    if req == "auto":
        return NCCL_BACKEND if gpus >= max(local_world_size, 1) else "gloo"
    if req == "gloo":
        return "gloo"
    if gpus == 0:
        raise ValueError(
            f"engine_config.distributed_backend={requested!r} needs CUDA, but this machine "
            "has no usable GPU; use 'gloo' (or 'auto') to run on CPU"
        )
    if local_world_size > gpus or local_rank >= gpus:
        raise ValueError(
            f"engine_config.distributed_backend={requested!r}: {local_world_size} local ranks "
            f"(LOCAL_RANK={local_rank}) but only {gpus} GPU(s) on this node; start at most "
            f"{gpus} ranks per node or use 'gloo'"
        )
    return NCCL_BACKEND


def group_device(group: Any = None, *, control: bool = False) -> torch.device:
    """The device whose tensors ``group``'s collectives carry.

    ``group`` is a torch ``ProcessGroup``, anything with a ``device_group``
    attribute (a ``GroupCoordinator``), or ``None`` for the default group. CUDA's
    current device when the group's backend runs NCCL for CUDA tensors (plain
    ``nccl`` and the combined ``cpu:gloo,cuda:nccl`` alike), XPU's current device
    for XCCL, else the CPU (gloo, mpi, ...).

    ``control=True`` asks where small control tensors (headers, sizes) should
    go: the CPU whenever the group has a CPU backend (gloo or mpi, so also the
    gloo half of ``cpu:gloo,cuda:nccl``), else the answer above.
    """
    import torch
    import torch.distributed as dist

    pg = getattr(group, "device_group", group)
    backend = str(dist.get_backend(pg)).lower()
    if control and ("gloo" in backend or "mpi" in backend):
        return torch.device("cpu")
    for name, device_type in _DEVICE_BACKENDS:
        if name in backend:
            return torch.device(device_type, torch.get_device_module(device_type).current_device())
    return torch.device("cpu")
