"""EMA of model weights on DTensor shards and plain tensors alike, plus DTensor helpers.

The updater works on each parameter's local shard with foreach ops, so an FSDP2 model's
EMA costs one fused pass over the shards this rank holds and no communication.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..torch_private import (
    foreach_add_,
    foreach_copy_,
    foreach_lerp_,
    foreach_mul_,
    wait_async_collective,
)
from ..validation import is_number

__all__ = [
    "DTensorFastEmaModelUpdater",
    "broadcast_dtensor_model_states",
    "get_local_tensor_if_dtensor",
]

Params = nn.Module | torch.Tensor | Iterable[torch.Tensor]


def get_local_tensor_if_dtensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (waiting on an async one); any other tensor unchanged."""
    tensor_mod = sys.modules.get("torch.distributed.tensor")
    if tensor_mod is None or not isinstance(t, tensor_mod.DTensor):
        return t
    return wait_async_collective(t.to_local())


def _named(params: Params, role: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    if isinstance(params, torch.Tensor):
        return [("0", params)]
    items = list(params)
    for i, p in enumerate(items):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{role}: item {i} is a {type(p).__name__}, not a tensor")
    return [(str(i), p) for i, p in enumerate(items)]


def _paired_locals(
    src: Params, tgt: Params, where: str
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """Local shards of ``src`` and ``tgt``, checked to pair one to one by count and shape."""
    src_named, tgt_named = _named(src, f"{where} src"), _named(tgt, f"{where} tgt")
    if len(src_named) != len(tgt_named):
        raise ValueError(
            f"{where}: src has {len(src_named)} parameters but tgt has {len(tgt_named)}; "
            "they must pair one to one (the same architecture, in the same order)"
        )
    srcs, tgts, names = [], [], []
    for (s_name, s), (t_name, t) in zip(src_named, tgt_named):
        s_local, t_local = (
            get_local_tensor_if_dtensor(s).detach(),
            get_local_tensor_if_dtensor(t).detach(),
        )
        if s_local.shape != t_local.shape:
            raise ValueError(
                f"{where}: src {s_name!r} has local shape {tuple(s_local.shape)} but tgt "
                f"{t_name!r} has "
                f"{tuple(t_local.shape)}; they must match"
            )
        srcs.append(s_local)
        tgts.append(t_local)
        names.append(t_name)
    return srcs, tgts, names


class DTensorFastEmaModelUpdater:
    """Exponential moving average of model weights, on DTensor shards and plain tensors.

    ``copy_to`` and ``update_average`` pair ``src`` and ``tgt`` parameters in order and
    work on local shards with foreach ops; ``cache`` / ``restore`` stash a model's
    weights (e.g. to evaluate with the EMA weights swapped in) on each parameter's own
    device, or on the CPU.
    """

    def __init__(self) -> None:
        self.is_cached = False
        self.collected_params: list[torch.Tensor] = []

    @torch.no_grad()
    def copy_to(self, src: Params, tgt: Params) -> None:
        """Copy every ``src`` parameter's local shard into the matching ``tgt`` one."""
        srcs, tgts, _ = _paired_locals(src, tgt, "copy_to")
        if tgts:
            foreach_copy_(tgts, srcs)

    @torch.no_grad()
    def update_average(self, src: Params, tgt: Params, beta: float = 0.9999) -> None:
        """``tgt = beta * tgt + (1 - beta) * src`` on local shards; ``tgt`` must be float32."""
        if not is_number(beta) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"update_average: beta={beta!r} must be a number in [0, 1]")
        srcs, tgts, names = _paired_locals(src, tgt, "update_average")
        for name, t in zip(names, tgts):
            if t.dtype != torch.float32:
                raise TypeError(
                    f"update_average: EMA target {name!r} is {t.dtype}; EMA weights must be "
                    "torch.float32 "
                    "(low-precision EMA loses the small updates)"
                )
        same: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        mixed: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for s, t in zip(srcs, tgts):
            bucket = same if s.dtype == t.dtype and s.device == t.device else mixed
            bucket[0].append(t)
            bucket[1].append(s)
        weight = 1.0 - float(beta)
        if same[0]:
            foreach_lerp_(same[0], same[1], weight)
        if mixed[0]:
            foreach_mul_(mixed[0], float(beta))
            cast = [s.to(t.device, torch.float32) for t, s in zip(*mixed)]
            foreach_add_(mixed[0], cast, alpha=weight)

    @torch.no_grad()
    def cache(self, parameters: Params, is_cpu: bool = False) -> None:
        """Stash a copy of ``parameters``' local shards, on each one's device (or the CPU)."""
        if self.is_cached:
            raise RuntimeError(
                "cache: parameters are already cached; restore() them before caching again"
            )
        named = _named(parameters, "cache")
        locals_ = [get_local_tensor_if_dtensor(p).detach() for _, p in named]
        self.collected_params = [t.to("cpu", copy=True) if is_cpu else t.clone() for t in locals_]
        self.is_cached = True

    @torch.no_grad()
    def restore(self, parameters: Params) -> None:
        """Copy the cached shards back into ``parameters`` and drop the cache."""
        if not self.is_cached:
            raise RuntimeError("restore: nothing is cached; call cache(parameters) first")
        named = _named(parameters, "restore")
        if len(named) != len(self.collected_params):
            raise ValueError(
                f"restore: {len(named)} parameters given but {len(self.collected_params)} were "
                "cached; "
                "restore the same parameters that were cached"
            )
        targets = []
        for (name, p), cached in zip(named, self.collected_params):
            local = get_local_tensor_if_dtensor(p).detach()
            if local.shape != cached.shape:
                raise ValueError(
                    f"restore: parameter {name!r} has local shape {tuple(local.shape)} but its "
                    "cached copy "
                    f"has {tuple(cached.shape)}"
                )
            targets.append(local)
        if targets:
            foreach_copy_(targets, self.collected_params)
        self.collected_params = []
        self.is_cached = False


def broadcast_dtensor_model_states(model: nn.Module, mesh: Any) -> None:
    """Broadcast every parameter and buffer from the first rank of ``mesh``'s "replicate" dimension.

    Each rank sends or receives its local shard, so ranks that hold the same shard along
    the other mesh dimensions end up identical (e.g. HSDP replicas after a seeded init).
    """
    import torch.distributed as dist

    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "replicate" not in names:
        raise ValueError(
            f"broadcast_dtensor_model_states: the mesh has dimensions {tuple(names)}; "
            "it needs one named 'replicate' to broadcast over"
        )
    group = mesh.get_group("replicate")
    ranks = dist.get_process_group_ranks(group)
    if len(ranks) == 1:
        return
    with torch.no_grad():
        for _, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            local = get_local_tensor_if_dtensor(tensor).detach()
            if local.is_contiguous():
                dist.broadcast(local, src=ranks[0], group=group)
            else:
                buf = local.contiguous()
                dist.broadcast(buf, src=ranks[0], group=group)
                local.copy_(buf)
