"""Modules and optimizers through DCP, under global names, so a checkpoint loads on another layout.

DCP reshards a DTensor (FSDP2) state on load by itself: each rank reads the slices of the
saved shards that overlap what it now owns. What it cannot do is match names that differ
between layouts. So:

- a module that holds a slice of a bigger model (a pipeline stage) names its parameters
  as the full model does: it defines ``global_name(name: str) -> str`` (the full model's
  name of one of its own parameter names; e.g. ``blocks.0.w`` on the second stage ->
  ``blocks.3.w``), and the checkpoint keys use those names;
- optimizer state is saved flat (``state.<param>.<stat>``, ``param_groups.<param>.<key>``,
  ``StateDictOptions(flatten_optimizer_state_dict=True)``), keyed by the same global
  parameter names, so a stage holding other parameters finds its own.

Before DCP runs, every key and shape a rank needs is checked against the checkpoint's
metadata, so a mismatch is one clear error instead of DCP's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from ...rundir.checkpoints import CheckpointUnreadable
from .entries import Plan
from .safe_read import CheckpointRefused, SafeLoadPlanner, SafeReader

__all__ = ["global_state_dicts", "load_sharded", "optimizer_key"]


def _namer(module: nn.Module) -> Callable[[str], str]:
    fn = getattr(module, "global_name", None)
    return fn if callable(fn) else (lambda name: name)


def optimizer_key(key: str, rename: Callable[[str], str]) -> str:
    """A flat optimizer key (``state.<fqn>.<stat>`` / ``param_groups.<fqn>.<key>``) with ``<fqn>``
    renamed."""
    head, _, rest = key.partition(".")
    fqn, _, stat = rest.rpartition(".")
    return f"{head}.{rename(fqn)}.{stat}" if fqn else key


def _renamed(
    name: str, local: dict[str, Any], rename: Callable[[str], str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    pairs = [(k, rename(k)) for k in local]
    targets = [g for _, g in pairs]
    if len(set(targets)) != len(targets):
        doubled = sorted({g for g in targets if targets.count(g) > 1})
        raise ValueError(
            f"state[{name!r}]: global_name() gives several parameters the same name: {doubled[:5]}"
        )
    return {g: local[k] for k, g in pairs}, pairs


def _local_dicts(
    plan: Plan, legacy: bool
) -> dict[str, tuple[dict[str, Any], Callable[[str], str]]]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    out: dict[str, tuple[dict[str, Any], Callable[[str], str]]] = {}
    identity: Callable[[str], str] = lambda name: name  # noqa: E731
    for name, m in plan.modules.items():
        out[name] = (get_model_state_dict(m), identity if legacy else _namer(m))
    options = None if legacy else StateDictOptions(flatten_optimizer_state_dict=True)
    for name, (opt, model) in plan.optimizers.items():
        rename = _namer(model)
        out[name] = (
            get_optimizer_state_dict(model, opt, options=options),
            identity if legacy else (lambda key, r=rename: optimizer_key(key, r)),
        )
    return out


def global_state_dicts(plan: Plan) -> dict[str, Any]:
    """What DCP saves: each module's and optimizer's state dict, keyed by global names (this rank's
    shards)."""
    return {
        name: _renamed(name, local, rename)[0]
        for name, (local, rename) in _local_dicts(plan, False).items()
    }


def _drop_stateless(metadata: Any, name: str, flat: dict[str, Any]) -> None:
    """Drop the optimizer state of parameters that had none when saved (never updated): they keep
    the fresh, zero state ``get_optimizer_state_dict`` gave them, which is what a first update
    starts from anyway."""
    saved = metadata.state_dict_metadata
    params: dict[str, list[str]] = {}
    for key in flat:
        if key.startswith("state."):
            params.setdefault(key.rpartition(".")[0], []).append(key)
    for keys in params.values():
        if not any(f"{name}.{k}" in saved for k in keys):
            for k in keys:
                del flat[k]


def _check_against(metadata: Any, view: dict[str, dict[str, Any]], directory: Path) -> None:
    """Every key this rank needs is in the checkpoint, with the same global shape; else
    :class:`CheckpointRefused`."""
    saved = metadata.state_dict_metadata
    missing, shapes = [], []
    for name, sd in view.items():
        for key, value in sd.items():
            full = f"{name}.{key}"
            if full not in saved:
                missing.append(full)
            elif (
                hasattr(value, "shape")
                and hasattr(saved[full], "size")
                and tuple(saved[full].size) != tuple(value.shape)
            ):
                shapes.append(
                    f"{full}: {tuple(saved[full].size)} in the checkpoint, {tuple(value.shape)} "
                    "here"
                )
    if missing:
        raise CheckpointRefused(
            f"checkpoint {directory} has no "
            f"{missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, "
            "which this state needs: it was saved from another model or state (a module holding a "
            "slice of a "
            "model must name its parameters as the full model does: global_name())"
        )
    if shapes:
        raise CheckpointRefused(
            f"checkpoint {directory} holds other shapes: {'; '.join(shapes[:3])}"
        )


def _dcp_reason(exc: BaseException) -> str:
    """The root cause in a DCP exception (it wraps each rank's traceback): its last line."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"


def load_sharded(
    plan: Plan,
    directory: Path,
    metadata: Any,
    process_group: Any,
    distributed: bool,
    legacy: bool = False,
) -> None:
    """Load every module and optimizer of ``plan`` in place from ``directory`` (collective over the
    group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    local = _local_dicts(plan, legacy)
    view: dict[str, dict[str, Any]] = {}
    pairs: dict[str, list[tuple[str, str]]] = {}
    for name, (sd, rename) in local.items():
        view[name], pairs[name] = _renamed(name, sd, rename)
    if not legacy:
        for name in plan.optimizers:
            _drop_stateless(metadata, name, view[name])
        _check_against(metadata, view, directory)
    if view:
        planner = SafeLoadPlanner(directory)
        try:
            dcp.load(
                view,
                storage_reader=SafeReader(directory, metadata),
                planner=planner,
                process_group=process_group,
                no_dist=not distributed,
            )
        except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException
            if planner.refused:  # DCP wraps what the planner raised: say it as it is
                raise CheckpointRefused(planner.refused) from None
            raise CheckpointUnreadable(f"{directory}: {_dcp_reason(exc)}") from None
    restored = {
        name: {k: view[name].get(g, local[name][0][k]) for k, g in pairs[name]} for name in view
    }
    for name, m in plan.modules.items():
        set_model_state_dict(m, restored[name])
    options = None if legacy else StateDictOptions(flatten_optimizer_state_dict=True)
    for name, (opt, model) in plan.optimizers.items():
        set_optimizer_state_dict(model, opt, restored[name], options=options)
