"""How a model is placed over the ranks of a run, recorded on the model itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

from ..validation import is_int
from .fsdp import is_fsdp2_model
from .run_control import is_distributed_run, size

__all__ = ["DistributionPlan", "distribution_plan", "set_distribution_plan"]

_ATTR = "_wf_distribution_plan"
_DENSE = ("replicate", "fsdp")


def _positive_int(name: str, value: object) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"DistributionPlan: {name}={value!r} must be an int >= 1")
    return value


@dataclass(frozen=True)
class DistributionPlan:
    """How a model is distributed over the ranks of a run.

    ``world_size``: the ranks that hold the model (1 for a single process).
    ``ep_size``: the expert-parallel degree; routed experts are sharded over groups of
    ``ep_size`` ranks (1 shards none). ``dense``: how the rest is placed, ``"replicate"``
    (a whole copy per rank) or ``"fsdp"`` (FSDP2-sharded). Data parallelism spans the
    whole world, so each expert shard is replicated ``edp = world_size / ep_size`` times.
    """

    world_size: int = 1
    ep_size: int = 1
    dense: Literal["replicate", "fsdp"] = "replicate"

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("ep_size", self.ep_size)
        if self.world_size % self.ep_size:
            raise ValueError(
                f"DistributionPlan: ep_size={self.ep_size} must divide world_size={self.world_size}"
            )
        if self.dense not in _DENSE:
            raise ValueError(
                f"DistributionPlan: dense={self.dense!r} is not allowed; allowed: {_DENSE}"
            )

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: how many ranks hold a replica of each expert shard."""
        return self.world_size // self.ep_size

    @property
    def is_expert_parallel(self) -> bool:
        """Whether routed experts are sharded across ranks."""
        return self.ep_size > 1

    @property
    def is_fsdp_dense(self) -> bool:
        """Whether the dense part is FSDP2-sharded rather than replicated."""
        return self.dense == "fsdp"


def set_distribution_plan(model: nn.Module, plan: DistributionPlan) -> None:
    """Record that ``model`` is distributed as ``plan``, on it and on every submodule it has now.

    Code handed a submodule then reads the same plan as code handed the whole model. A
    model is distributed once: if it or any submodule already records a plan (the same
    one included) this raises and leaves the model as it was.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"set_distribution_plan: model must be an nn.Module, got {type(model).__name__}"
        )
    if not isinstance(plan, DistributionPlan):
        raise TypeError(
            f"set_distribution_plan: plan must be a DistributionPlan, got {type(plan).__name__}"
        )
    modules = list(model.named_modules())
    for name, module in modules:
        existing = module.__dict__.get(_ATTR)
        if existing is not None:
            where = f"submodule {name!r}" if name else "the model"
            raise RuntimeError(
                f"set_distribution_plan: {where} ({type(module).__name__}) already records "
                f"{existing}; "
                "a model is distributed, and its plan recorded, once"
            )
    for _, module in modules:
        module.__dict__[_ATTR] = plan


def distribution_plan(model: nn.Module) -> DistributionPlan:
    """How ``model`` is distributed: the plan recorded on it (``set_distribution_plan()``).

    A model with no plan is a single process's, unless it shows otherwise: one that is
    FSDP2-sharded, or held in a run of several ranks, raises rather than be taken for
    one. A module added after the plan was recorded has none: read it off the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"distribution_plan: model must be an nn.Module, got {type(model).__name__}"
        )
    plan = model.__dict__.get(_ATTR)
    if plan is not None:
        return plan

    if is_fsdp2_model(model):
        reason = "it is FSDP2-sharded"
    elif is_distributed_run():
        reason = f"it is held in a run of {size()} ranks"
    else:
        return DistributionPlan()
    raise RuntimeError(
        f"distribution_plan: {type(model).__name__} records no plan, but {reason}, so it is not a "
        "single process's; record one with set_distribution_plan(model, plan) (a module added to a "
        "model after its plan was recorded has none: read the plan off that model)"
    )
