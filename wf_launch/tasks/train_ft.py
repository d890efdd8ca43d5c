"""``train`` under ``ft=torchft``: what a replica group hands a healing peer, and the gradient
average across replica groups.

Every replica group runs the same layout, so group rank ``r`` of one holds the same FSDP2 shards
as group rank ``r`` of another: the state a peer sends and the gradients torchft averages are this
rank's local shards (plain tensors: no DTensor crosses torchft's transport). The optimizer's
state is created eagerly (zeros, step 0, as AdamW creates it at its first step), so a replica that
heals before its first step has tensors to copy the peer's state into.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = ["average_gradients", "init_optim_state", "load_replica_state", "replica_state"]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor), sharing its storage."""
    from torch.distributed.tensor import DTensor  # 0.4 s; preloaded before ranks fork (train)

    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*module.named_parameters(), *module.named_buffers()])


def init_optim_state(opt: torch.optim.Optimizer) -> None:
    """AdamW's per-parameter state as its first step creates it, for parameters that have none."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _optim_tensors(stage: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    return {name: opt.state[p] for name, p in stage.named_parameters() if p in opt.state}


def replica_state(
    stage: nn.Module, ema: nn.Module, opt: torch.optim.Optimizer, progress: dict[str, Any]
) -> dict[str, Any]:
    """What this rank sends a healing peer: its model, EMA and optimizer shards and the progress."""
    with torch.no_grad():
        return {
            "model": {k: _local(v).detach().clone() for k, v in _tensors(stage).items()},
            "ema": {k: _local(v).detach().clone() for k, v in _tensors(ema).items()},
            "optim": {
                name: {k: _local(v).detach().clone() for k, v in st.items()}
                for name, st in _optim_tensors(stage, opt).items()
            },
            "progress": copy.deepcopy(progress),
        }


def load_replica_state(
    stage: nn.Module,
    ema: nn.Module,
    opt: torch.optim.Optimizer,
    progress: dict[str, Any],
    state: dict[str, Any],
) -> None:
    """Copy a peer's state (:func:`replica_state`) into this rank's shards, in place."""
    with torch.no_grad():
        for mine, theirs in ((_tensors(stage), state["model"]), (_tensors(ema), state["ema"])):
            for k, v in mine.items():
                _local(v).copy_(theirs[k])
        for name, st in _optim_tensors(stage, opt).items():
            for k, v in st.items():
                _local(v).copy_(state["optim"][name][k])
    progress.clear()
    progress.update(copy.deepcopy(state["progress"]))


def average_gradients(manager: Any, stage: nn.Module) -> None:
    """Average this rank's gradient shards over the replica groups of the step's quorum (one
    torchft all-reduce of them all, flattened)."""
    grads = [_local(p.grad) for p in stage.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    with torch.no_grad():
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
