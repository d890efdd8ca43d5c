"""FSDP2 wrapping of causal-LM-style models, without depending on transformers."""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch import nn

from .backends import group_device

__all__ = ["fsdp2_wrap", "is_fsdp2_model"]


def is_fsdp2_model(model: nn.Module) -> bool:
    """Return True if any submodule of ``model`` has been wrapped with FSDP2 ``fully_shard``."""
    if (
        "torch.distributed.fsdp" not in sys.modules
    ):  # nothing can be wrapped before FSDP is imported
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's repeated decoder layers: a ModuleList of blocks of one class.

    Blocks named by HF's ``_no_split_modules`` win; otherwise the list holding the most
    parameters (so an MoE's per-layer expert lists lose to the layer list holding them).
    """
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    candidates: list[tuple[bool, int, int, str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        kinds = {type(child) for child in module}
        if len(kinds) != 1:
            continue
        named = next(iter(kinds)).__name__ in no_split
        candidates.append((named, _param_count(module), -name.count("."), name, module))
    if not candidates:
        raise ValueError(
            f"fsdp2_wrap: {type(model).__name__} has no decoder layers to shard: "
            "no nn.ModuleList of "
            "blocks of one class was found (a causal LM keeps them in e.g. model.layers)"
        )
    best = max(candidates, key=lambda c: c[:3])
    if best[1] == 0:
        raise ValueError(f"fsdp2_wrap: the decoder layers found at {best[3]!r} hold no parameters")
    return best[4]


def _dominant_dtype(model: nn.Module) -> torch.dtype:
    counts: Counter[torch.dtype] = Counter()
    for p in model.parameters():
        counts[p.dtype] += p.numel()
    if not counts:
        raise ValueError(f"fsdp2_wrap: {type(model).__name__} has no parameters to shard")
    return counts.most_common(1)[0][0]


def _off_dtype_params(model: nn.Module) -> set[nn.Parameter]:
    """Parameters whose dtype is not the model's dominant one: FSDP2 rejects mixed-dtype groups."""
    dominant = _dominant_dtype(model)
    return {p for p in model.parameters() if p.dtype != dominant}


def _shard_device(mesh: Any) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _check_arguments(model: Any, mp_policy: Any, cpu_offload: Any) -> None:
    """TypeError, RuntimeError or ValueError for what ``fsdp2_wrap`` cannot shard."""
    import torch.distributed as dist  # the distributed parts load only when a model is sharded
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(model, nn.Module):
        raise TypeError(f"fsdp2_wrap: model must be an nn.Module, got {type(model).__name__}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fsdp2_wrap: mp_policy must be a MixedPrecisionPolicy or None, got {mp_policy!r}"
        )
    if not isinstance(cpu_offload, bool):
        raise TypeError(f"fsdp2_wrap: cpu_offload must be a bool, got {cpu_offload!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fsdp2_wrap: the process group is not initialized; call it inside distributed_run()"
        )
    if is_fsdp2_model(model):
        raise ValueError(f"fsdp2_wrap: {type(model).__name__} is already FSDP2-sharded")


def fsdp2_wrap(
    model: nn.Module,
    shard_root: bool = True,
    mp_policy: Any = None,
    cpu_offload: bool = False,
    mesh: Any = None,
) -> nn.ModuleList:
    """Auto-detect a causal-LM's decoder layers and FSDP2 ``fully_shard`` each one.

    With ``shard_root`` (the default) the root is wrapped too, so embeddings, norm and
    head are sharded rather than replicated per rank. Parameters of a dtype other than
    the model's dominant one stay replicated (FSDP2 rejects a shard group mixing dtypes)
    and are moved onto the shards' device, which ``fully_shard`` does not do for them.
    ``mp_policy`` is a ``MixedPrecisionPolicy`` (None: FSDP2's default); ``cpu_offload``
    keeps shards, gradients and optimizer state on the CPU. ``mesh`` is a 1-D
    ``DeviceMesh`` to shard over (None: the whole world), e.g. the data- and
    context-parallel ranks of one pipeline stage (``DeviceMesh.from_group``).
    Returns the decoder layers. Needs an initialized process group.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    _check_arguments(model, mp_policy, cpu_offload)
    layers = _decoder_layers(model)
    ignored = _off_dtype_params(model)
    if mesh is None:
        mesh = init_device_mesh(group_device().type, (dist.get_world_size(),))
    elif getattr(mesh, "ndim", None) != 1:
        raise ValueError(f"fsdp2_wrap: mesh must be a 1-D DeviceMesh or None, got {mesh!r}")
    device = _shard_device(mesh)
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if cpu_offload
            else OffloadPolicy()
        ),
        "ignored_params": ignored or None,
    }
    for layer in layers:
        fully_shard(layer, **kwargs)
    if shard_root:
        fully_shard(model, **kwargs)
    with torch.no_grad():
        for p in ignored:
            if p.device != device:
                p.data = p.data.to(device)
    return layers
