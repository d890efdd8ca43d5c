"""Rank layout as pure data: order string -> per-rank coordinates and group members.

Megatron's convention: the order string is innermost-first, so for
``order='tp-cp-pp-dp'`` a rank is ``tp + tp_size * (cp + cp_size * (pp + pp_size * dp))``.
Nothing here touches processes, so layouts can be checked (and benchmarked) at any
world size before a single rank starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..validation import is_int

__all__ = ["COMBINED", "DEFAULT_ORDER", "DIMS", "Layout", "engine_value", "parse_order"]

DIMS: tuple[str, ...] = ("tp", "cp", "pp", "dp")
"""Parallel dimensions a layout knows."""

COMBINED: tuple[str, ...] = ("tp-cp", "dp-cp", "tp-pp")
"""Combined groups built beside the four plain ones (helpers and data parallelism use them)."""

DEFAULT_ORDER = "-".join(DIMS)
"""Megatron's default order, innermost first: ``tp-cp-pp-dp``."""


def engine_value(engine: Any, name: str, default: Any = None) -> Any:
    """Field ``name`` of an engine config: a Mapping, a ``.get`` object (OmegaConf), attributes."""
    if isinstance(engine, Mapping):
        return engine.get(name, default)
    if hasattr(engine, "get") and not hasattr(engine, name):
        return engine.get(name, default)
    return getattr(engine, name, default)


def _layout_error(
    order: str, sizes: dict[str, int], world_size: int | None, why: str
) -> ValueError:
    shown = ", ".join(f"{d}_size={sizes.get(d)!r}" for d in DIMS)
    ws = "" if world_size is None else f", world_size={world_size}"
    return ValueError(f"invalid parallel layout (order={order!r}, {shown}{ws}): {why}")


def _order_problem(tokens: list[str], sizes: dict[str, int]) -> str:
    """What is wrong with an order's tokens: unknown, repeated, a used one missing ('' if none)."""
    unknown = [t for t in tokens if t not in DIMS]
    if unknown:
        return f"unknown token(s) {unknown}; allowed tokens are {list(DIMS)}"
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        return f"token(s) {repeated} appear more than once"
    missing = [d for d in DIMS if d not in tokens and sizes.get(d, 1) > 1]
    if missing:
        return f"token(s) {missing} have size > 1 but are missing from the order"
    return ""


def parse_order(
    order: str, sizes: dict[str, int], world_size: int | None = None
) -> tuple[str, ...]:
    """Return the full innermost-first dimension order for ``order``.

    Tokens of size 1 may be left out of ``order``; they are appended (they do not
    change any rank's position). Unknown or repeated tokens, and a token with
    size > 1 that is missing, raise one ValueError naming the order and sizes.
    """
    if not isinstance(order, str) or not order.strip():
        raise _layout_error(
            str(order),
            sizes,
            world_size,
            f"order must be a '-'-joined permutation of {'/'.join(DIMS)}",
        )
    tokens = [t.strip().lower() for t in order.split("-")]
    why = _order_problem(tokens, sizes)
    if why:
        raise _layout_error(order, sizes, world_size, why)
    return tuple(tokens) + tuple(d for d in DIMS if d not in tokens)


@dataclass(frozen=True)
class Layout:
    """A validated parallel layout over ``world_size`` ranks.

    ``dp_size=None`` (the default) takes whatever the other sizes leave:
    ``world_size // (tp * cp * pp)``.
    """

    world_size: int
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    dp_size: int | None = None
    order: str = DEFAULT_ORDER
    dims: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        raw = {d: getattr(self, f"{d}_size") for d in DIMS}
        ws = self.world_size
        if not is_int(ws) or ws < 1:
            raise _layout_error(self.order, raw, ws, "world_size must be an integer >= 1")
        for d, v in raw.items():
            if v is None and d == "dp":
                continue
            if not is_int(v) or v < 1:
                raise _layout_error(
                    self.order, raw, ws, f"{d}_size must be an integer >= 1, got {v!r}"
                )
        model = math.prod(raw[d] for d in DIMS if d != "dp")
        if ws % model:
            raise _layout_error(
                self.order, raw, ws, f"tp*cp*pp = {model} does not divide the world size {ws}"
            )
        if self.dp_size is None:
            object.__setattr__(self, "dp_size", ws // model)
        elif model * self.dp_size != ws:
            raise _layout_error(
                self.order, raw, ws, f"tp*cp*pp*dp = {model * self.dp_size} != world size {ws}"
            )
        object.__setattr__(self, "dims", parse_order(self.order, self.sizes, ws))

    @classmethod
    def from_engine(cls, engine: Any, world_size: int | None = None) -> Layout:
        """The layout an engine config describes (its ``tp/cp/pp/dp_size`` and ``order``).

        ``engine`` is a Mapping or an attribute object (an OmegaConf config works
        as either). Absent ``tp_size`` / ``cp_size`` / ``pp_size`` are 1 and an
        absent ``order`` is ``tp-cp-pp-dp``; ``dp_size`` None, 0 or -1 (or absent)
        takes what ``world_size`` leaves. ``world_size=None`` means the product of
        the four sizes, so ``dp_size`` must then be given. Raises the same
        ValueError as the constructor.
        """
        sizes: dict[str, Any] = {
            d: engine_value(engine, f"{d}_size", None if d == "dp" else 1) for d in DIMS
        }
        if sizes["dp"] in (None, 0, -1):
            sizes["dp"] = None
        order = engine_value(engine, "order", DEFAULT_ORDER)
        if world_size is None:
            if sizes["dp"] is None:
                raise _layout_error(
                    str(order),
                    sizes,
                    None,
                    "dp_size must be given when the world size is not (it is their product)",
                )
            world_size = 1
            for d in DIMS:
                v = sizes[d]
                if not is_int(v) or v < 1:
                    raise _layout_error(
                        str(order), sizes, None, f"{d}_size must be an integer >= 1, got {v!r}"
                    )
                world_size *= v
        return cls(world_size, **{f"{d}_size": v for d, v in sizes.items()}, order=order)

    @property
    def sizes(self) -> dict[str, int]:
        """Size of each dimension."""
        return {d: getattr(self, f"{d}_size") or 1 for d in DIMS}

    @cached_property
    def strides(self) -> dict[str, int]:
        """Rank stride of each dimension (innermost dimension has stride 1)."""
        out, s = {}, 1
        for d in self.dims:
            out[d] = s
            s *= self.sizes[d]
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates (index along tp/cp/pp/dp) of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        return {d: (rank // self.strides[d]) % self.sizes[d] for d in DIMS}

    def rank_of(self, coords: dict[str, int]) -> int:
        """Global rank at ``coords`` (missing dimensions count as 0)."""
        return sum(coords.get(d, 0) * self.strides[d] for d in DIMS)

    def group_of(self, rank: int, name: str) -> list[int]:
        """Members of ``rank``'s group for ``name`` ('tp', 'tp-cp', ...), in group-rank order."""
        varying = self._varying(name)
        base = {d: c for d, c in self.coords(rank).items() if d not in varying}
        return self._enumerate(base, varying)

    def groups(self, name: str) -> list[list[int]]:
        """Every group for ``name``, each in group-rank order, sorted by first member."""
        varying = self._varying(name)
        fixed = [d for d in DIMS if d not in varying]
        out = []
        for idx in range(math.prod(self.sizes[d] for d in fixed)):
            base = {}
            for d in fixed:
                base[d] = idx % self.sizes[d]
                idx //= self.sizes[d]
            out.append(self._enumerate(base, varying))
        return sorted(out)

    def _varying(self, name: str) -> list[str]:
        parts = name.split("-")
        if any(p not in DIMS for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(
                f"unknown group name {name!r}; use tokens of {list(DIMS)} joined by '-'"
            )
        return [d for d in self.dims if d in parts]

    def _enumerate(self, base: dict[str, int], varying: list[str]) -> list[int]:
        members = []
        for idx in range(math.prod(self.sizes[d] for d in varying)):
            c = dict(base)
            for d in varying:
                c[d] = idx % self.sizes[d]
                idx //= self.sizes[d]
            members.append(self.rank_of(c))
        return members

    def describe(self) -> str:
        """One line: sizes and order, e.g. 'tp=1 cp=4 pp=2 dp=1 (order tp-cp-pp-dp, 8 ranks)'."""
        s = self.sizes
        return (
            f"tp={s['tp']} cp={s['cp']} pp={s['pp']} dp={s['dp']} "
            f"(order {'-'.join(self.dims)}, {self.world_size} ranks)"
        )
