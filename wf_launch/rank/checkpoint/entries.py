"""What a task checkpoints: its entries, their kinds and scopes, and the RNG states saved with them.

Modules and optimizers are sharded (DCP reshards them on load). Every other entry
(generators, objects with ``state_dict`` / ``load_state_dict``, plain values) is per-rank
state with a **scope**, chosen when the task saves it:

- ``replicated``: one copy (rank 0's), loaded on every rank, at any layout;
- ``dp``: one copy per data-parallel replica (the replica's first rank's), loaded by the
  ranks of the same dp index; on a dp-size change the task maps the saved copies
  (``remap``) or, by default, keeps the value it built for the new layout (re-derived);
- ``rank`` (the default): one copy per rank, loaded only on the layout that saved it.
"""

from __future__ import annotations

import hashlib
import random
import sys
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

__all__ = [
    "PER_RANK_KINDS",
    "Plan",
    "Scope",
    "classify",
    "derive_rng",
    "rng_states",
    "set_rng_states",
]

_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)


class Scope(str, Enum):
    """How a per-rank entry is saved and which ranks load it (see the module doc)."""

    REPLICATED = "replicated"
    DP = "dp"
    RANK = "rank"

    def __str__(self) -> str:
        return self.value


PER_RANK_KINDS = ("generator", "stateful", "plain")


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    if depth > 32:
        raise ValueError(f"{where} is nested too deeply to be plain task state")
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, nn.Parameter):
            raise ValueError(
                f"{where} is of type {type(value).__name__}; only plain tensors are saved as "
                "per-rank state (put sharded tensors in a module)"
            )
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, _PLAIN_SCALARS):
                raise ValueError(
                    f"{where} has a key of type {type(k).__name__}; keys must be plain"
                )
            _check_plain(v, f"{where}[{k!r}]", depth + 1)
        return
    raise ValueError(
        f"{where} is of type {type(value).__name__}, which Checkpointer cannot save: entries must "
        "be "
        "nn.Module, torch.optim.Optimizer, torch.Generator, an object with "
        "state_dict()/load_state_dict(), "
        "or plain values (None, bool, int, float, str, bytes, CPU tensors, and lists/tuples/dicts "
        "of them)"
    )


@dataclass
class Plan:
    """A state dict sorted by kind: modules, optimizers (with the module owning their parameters),
    per-rank entries."""

    modules: dict[str, nn.Module] = field(default_factory=dict)
    optimizers: dict[str, tuple[torch.optim.Optimizer, nn.Module]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    scopes: dict[str, Scope] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)

    def entries(self) -> dict[str, dict[str, str]]:
        """Every entry's kind and scope, as ``COMMIT`` records them."""
        out = {n: {"kind": "module", "scope": "sharded"} for n in self.modules}
        out.update({n: {"kind": "optimizer", "scope": "sharded"} for n in self.optimizers})
        out.update({n: {"kind": self.kinds[n], "scope": str(self.scopes[n])} for n in self.kinds})
        return out

    def signature(self) -> int:
        """A 62-bit digest of the per-rank entries' names, kinds and scopes (ranks must agree on
        them)."""
        text = repr(sorted((n, self.kinds[n], str(self.scopes[n])) for n in self.kinds))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _kind(name: str, value: Any) -> str:
    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(value, torch.Generator):
        return "generator"
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return "stateful"
    _check_plain(value, f"state[{name!r}]")
    return "plain"


def _scopes(plan: Plan, scopes: Any) -> None:
    if scopes is None:
        scopes = {}
    if not isinstance(scopes, dict):
        raise ValueError(f"scopes={scopes!r} must be a dict of entry name -> scope")
    allowed = [s.value for s in Scope]
    for name, scope in scopes.items():
        if name in plan.modules or name in plan.optimizers:
            raise ValueError(
                f"scopes[{name!r}]: {name!r} is a module or optimizer: DCP shards it and reshards "
                "it on "
                "load; scopes apply to per-rank entries (generators, stateful objects, plain "
                "values)"
            )
        if name not in plan.kinds:
            raise ValueError(
                f"scopes[{name!r}]: no entry {name!r} in state (entries: {sorted(plan.kinds)})"
            )
        if str(scope) not in allowed:
            raise ValueError(f"scopes[{name!r}]={scope!r} is not allowed: choose one of {allowed}")
    for name in plan.kinds:
        plan.scopes[name] = Scope(str(scopes.get(name, Scope.RANK)))


def classify(state: Any, scopes: Any = None) -> Plan:
    """Sort ``state`` by kind and give each per-rank entry its scope; ``ValueError`` naming a bad
    entry."""
    if not isinstance(state, dict):
        raise ValueError(
            f"state must be a dict of name -> object to checkpoint, got {type(state).__name__}"
        )
    plan = Plan()
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name or name.startswith("_"):
            raise ValueError(f"state key {name!r} must be a non-empty str not starting with '_'")
        kind = _kind(name, value)
        if kind == "module":
            plan.modules[name] = value
        elif kind == "optimizer":
            optimizers[name] = value
        else:
            plan.kinds[name], plan.values[name] = kind, value
    for name, opt in optimizers.items():
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        owner = next(
            (m for m in plan.modules.values() if ids <= {id(p) for p in m.parameters()}), None
        )
        if owner is None:
            raise ValueError(
                f"state[{name!r}] is an optimizer whose parameters belong to no nn.Module in "
                "state; "
                "add the model it optimizes to the same state dict"
            )
        plan.optimizers[name] = (opt, owner)
    _scopes(plan, scopes)
    return plan


def rng_states() -> dict[str, Any]:
    """This process's RNG states: torch CPU, CUDA (when initialized), Python ``random``, NumPy (when
    imported)."""
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        rng["numpy"] = (
            kind,
            torch.from_numpy(keys.astype("int64")),
            int(pos),
            int(has_gauss),
            float(gauss),
        )
    return rng


def set_rng_states(rng: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` saved."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


def derive_rng(seed: int, step: int, rank: int) -> int:
    """Seed every RNG from ``(seed, step, rank)`` (a layout change: the saved states belong to other
    roles)."""
    digest = hashlib.sha256(f"wf_launch.checkpoint.rng/{seed}/{step}/{rank}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") >> 1
    torch.manual_seed(value)
    random.seed(value)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(value % 2**32)
    return value
