"""Per-rank entries on disk: who writes which copy, and which copy each rank of a (maybe new) layout
loads.

Every rank writes ``rank_NNNNN.pt`` (fsynced before ``COMMIT``): its RNG states, its
``rank``-scoped entries; the first rank of each data-parallel replica (tp = cp = pp = 0)
adds the ``dp``-scoped entries; rank 0 adds the ``replicated`` ones. On load,
:func:`resolve` decides, from ``COMMIT`` and the two layouts, where each entry comes from,
and refuses (on every rank alike: all read the same ``COMMIT``) an entry the new layout
cannot serve, naming it and both layouts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worldfoundry.core.distributed.topology import Layout

from ...rundir.checkpoints import (
    CheckpointUnreadable,
    Commit,
    describe_layout,
    fsync_path,
    layout_dict,
    layout_of,
    rank_file,
)
from .entries import Plan, Scope, rng_states
from .safe_read import CheckpointRefused

__all__ = [
    "Resolution",
    "check_present",
    "read_payloads",
    "resolve",
    "restore",
    "value_of",
    "write_rank_file",
]


def _is_replica_leader(layout: Layout, rank: int) -> bool:
    coords = layout.coords(rank)
    return all(coords[d] == 0 for d in ("tp", "cp", "pp"))


def value_of(kind: str, obj: Any) -> Any:
    """What is saved of one per-rank entry."""
    if kind == "generator":
        return obj.get_state()
    if kind == "stateful":
        return obj.state_dict()
    return obj


def write_rank_file(directory: Path, rank: int, layout: Layout, plan: Plan) -> None:
    """This rank's file: RNG states and the entries this rank owns (by scope); fsynced, then renamed
    into place."""
    owned = {}
    for name, kind in plan.kinds.items():
        scope = plan.scopes[name]
        if (
            scope is Scope.RANK
            or (scope is Scope.DP and _is_replica_leader(layout, rank))
            or (scope is Scope.REPLICATED and rank == 0)
        ):
            owned[name] = {
                "kind": kind,
                "scope": str(scope),
                "value": value_of(kind, plan.values[name]),
            }
    payload = {
        "format": 2,
        "rank": rank,
        "world_size": layout.world_size,
        "layout": layout_dict(layout),
        "rng": rng_states(),
        "entries": owned,
    }
    path = rank_file(directory, rank)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    fsync_path(directory)


@dataclass
class Resolution:
    """Where each per-rank entry of the state comes from at this layout.

    ``sources``: entry -> saved rank whose copy loads here; ``remapped``: entry -> saved ranks of
    every replica (oldest dp index first) for the task's ``remap``; ``rederived``: entries the task
    re-derives (kept as built). ``rng_from``: the saved rank whose RNG states load here (None:
    re-derived from seed, step and rank).
    """

    changed: bool
    saved: dict[str, Any] | None
    current: dict[str, Any]
    sources: dict[str, int] = field(default_factory=dict)
    remapped: dict[str, list[int]] = field(default_factory=dict)
    rederived: list[str] = field(default_factory=list)
    rng_from: int | None = None

    def ranks_to_read(self) -> set[int]:
        ranks = set(self.sources.values()) | {r for rs in self.remapped.values() for r in rs}
        return ranks | ({self.rng_from} if self.rng_from is not None else set())


def _entry_scopes(commit: Commit) -> dict[str, tuple[str, str]]:
    return {
        n: (str(e.get("kind")), str(e.get("scope")))
        for n, e in commit.entries.items()
        if isinstance(e, dict)
    }


def _refusal(
    directory: Path, name: str, why: str, commit: Commit, current: Layout
) -> CheckpointRefused:
    return CheckpointRefused(
        f"cannot load checkpoint {directory} at this layout: entry {name!r} {why}; it was saved at "
        f"{describe_layout(commit.layout, commit.world_size)} and this run's layout is "
        f"{current.describe()}"
    )


def resolve(
    directory: Path,
    commit: Commit,
    plan: Plan,
    layout: Layout,
    rank: int,
    remap: dict[str, Callable[..., Any]],
) -> Resolution:
    """Decide where every per-rank entry (and the RNG states) of ``plan`` load from; refuse what
    cannot be served."""
    saved = layout_of(commit.layout)
    legacy = commit.format < 2
    if saved is None and not legacy:
        raise CheckpointUnreadable(
            f"{directory}: its COMMIT records no valid layout ({commit.layout!r})"
        )
    changed = (
        (commit.world_size != layout.world_size)
        if saved is None
        else (layout_dict(saved) != layout_dict(layout))
    )
    res = Resolution(
        changed, commit.layout, layout_dict(layout), rng_from=None if changed else rank
    )
    scopes = {n: (k, "rank") for n, k in plan.kinds.items()} if legacy else _entry_scopes(commit)
    missing = [n for n in plan.kinds if n not in scopes]
    if missing:
        raise CheckpointRefused(f"checkpoint {directory} has no saved state for {missing}")
    for name, kind in plan.kinds.items():
        saved_kind, scope = scopes[name]
        if saved_kind != kind:
            raise CheckpointRefused(
                f"checkpoint {directory}: entry {name!r} was saved as a {saved_kind}, "
                f"and is a {kind} now"
            )
        if name in remap and scope != Scope.DP.value:
            raise CheckpointRefused(
                f"remap[{name!r}]: entry {name!r} was saved with scope {scope!r}; remap applies "
                "to scope 'dp' entries only"
            )
        _place(res, directory, name, scope, commit, saved, layout, rank, remap)
    return res


def _place(
    res: Resolution,
    directory: Path,
    name: str,
    scope: str,
    commit: Commit,
    saved: Layout | None,
    layout: Layout,
    rank: int,
    remap: dict[str, Callable[..., Any]],
) -> None:
    if scope == Scope.REPLICATED.value:
        res.sources[name] = 0
    elif scope == Scope.RANK.value:
        if res.changed:
            raise _refusal(
                directory,
                name,
                "has scope 'rank' (one copy per rank: it loads only on the layout that saved "
                f"it); to change layouts, save it with scopes={{{name!r}: 'replicated'}} (the "
                "same on every rank) or 'dp' (one copy per data-parallel replica)",
                commit,
                layout,
            )
        res.sources[name] = rank
    elif scope == Scope.DP.value and saved is not None:
        dp = layout.coords(rank)["dp"]
        if saved.dp_size == layout.dp_size:
            res.sources[name] = saved.rank_of({"dp": dp})
        elif name in remap:
            res.remapped[name] = [saved.rank_of({"dp": d}) for d in range(saved.dp_size)]
        else:
            res.rederived.append(name)
    else:
        raise CheckpointRefused(
            f"checkpoint {directory}: entry {name!r} has an unknown scope {scope!r}"
        )


def read_payloads(directory: Path, commit: Commit, ranks: set[int]) -> dict[int, dict[str, Any]]:
    """The saved per-rank files of ``ranks`` (``weights_only``: tensors and plain values);
    unreadable: an error."""
    out = {}
    for r in sorted(ranks):
        path = rank_file(directory, r)
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointUnreadable(
                f"{path}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        if not isinstance(payload, dict) or payload.get("world_size") != commit.world_size:
            raise CheckpointUnreadable(
                f"{path}: not a per-rank file of this {commit.world_size}-rank checkpoint"
            )
        if "entries" not in payload:  # format 1: generators / stateful / plain, every one per rank
            payload["entries"] = {
                n: {"value": v}
                for part in ("generators", "stateful", "plain")
                for n, v in payload.get(part, {}).items()
            }
        out[r] = payload
    return out


def _apply(kind: str, name: str, state: dict[str, Any], value: Any) -> None:
    obj = state[name]
    if kind == "generator":
        obj.set_state(value)
    elif kind == "stateful":
        obj.load_state_dict(value)
    elif isinstance(obj, dict) and isinstance(value, dict):
        obj.clear()
        obj.update(value)
    elif isinstance(obj, list) and isinstance(value, list):
        obj[:] = value
    else:
        state[name] = value


def restore(
    plan: Plan,
    state: dict[str, Any],
    res: Resolution,
    payloads: dict[int, dict[str, Any]],
    remap: dict[str, Callable[..., Any]],
    layout: Layout,
    rank: int,
) -> None:
    """Give every per-rank entry its saved (or remapped) value; re-derived entries keep the task's
    own."""
    dp = layout.coords(rank)["dp"]
    for name, kind in plan.kinds.items():
        if name in res.sources:
            _apply(kind, name, state, payloads[res.sources[name]]["entries"][name]["value"])
        elif name in res.remapped:
            saved = [payloads[r]["entries"][name]["value"] for r in res.remapped[name]]
            _apply(kind, name, state, remap[name](saved, dp, layout.dp_size))


def check_present(directory: Path, res: Resolution, payloads: dict[int, dict[str, Any]]) -> None:
    """Every copy :func:`resolve` chose is in the files read; else the checkpoint is unreadable."""
    wanted = [(n, r) for n, r in res.sources.items()] + [
        (n, r) for n, rs in res.remapped.items() for r in rs
    ]
    for name, r in wanted:
        if name not in payloads[r].get("entries", {}):
            raise CheckpointUnreadable(
                f"{rank_file(directory, r)}: has no entry {name!r}, which its COMMIT lists"
            )
    if res.rng_from is not None and "rng" not in payloads[res.rng_from]:
        raise CheckpointUnreadable(f"{rank_file(directory, res.rng_from)}: has no RNG states")
