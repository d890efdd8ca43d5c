"""The search space of a tune: every (tp, cp, pp, dp) whose product is the world size, times the
``--also`` values.

A :class:`Point` is one candidate: its layout sizes and one value of every ``--also``
axis. Its overrides (``engine.tp_size=2 ... task.micro_batches=4``) are what a trial
adds to the user's own. This module also checks the tune's command line: a
``world_size`` every layout must have, and no override that fixes what the tuner
chooses (:class:`TuneError`: the tune exits with code 2, nothing started).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any

from worldfoundry.core.distributed.topology import DIMS

__all__ = [
    "OWNED_KEYS",
    "SIZE_KEYS",
    "Point",
    "TuneError",
    "build_space",
    "divisors",
    "layouts",
    "override_key",
    "parse_also",
    "split_command",
]

SIZE_KEYS = tuple(f"engine.{d}_size" for d in DIMS)
"""The sizes the tuner chooses: an override that fixes one is refused."""
OWNED_KEYS = (
    "hydra.run.dir",
    "hydra.sweep.dir",
    "hydra.sweep.subdir",
    "launcher.resume",
    "launcher.overwrite",
    "launcher.dry_run",
    "launcher.wait",
    "engine",
)
"""What the tuner sets itself for every trial (or what would fix every size at once)."""
MAX_WORLD_SIZE = 1 << 20
_SLUG = re.compile(r"[^A-Za-z0-9_]+")


class TuneError(Exception):
    """Bad input to the tuner (the command line, the space, a --resume directory): exit code 2, with
    the reason."""


def override_key(override: str) -> str:
    """``+task.steps=3`` -> ``task.steps`` (the key an override sets)."""
    return override.split("=", 1)[0].lstrip("+~")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(world_size: int) -> list[dict[str, int]]:
    """Every (tp, cp, pp, dp) whose product is ``world_size``, in lexicographic order of the
    sizes."""
    out = []
    for tp in divisors(world_size):
        for cp in divisors(world_size // tp):
            for pp in divisors(world_size // (tp * cp)):
                out.append({"tp": tp, "cp": cp, "pp": pp, "dp": world_size // (tp * cp * pp)})
    return out


@dataclass(frozen=True)
class Point:
    """One candidate of the space: a layout and one value of each ``--also`` axis (``(key, value)``
    pairs)."""

    index: int
    sizes: tuple[tuple[str, int], ...]
    also: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @property
    def layout(self) -> dict[str, int]:
        """``{"tp", "cp", "pp", "dp", "world_size"}``: what a task's ``estimate_memory_gb``
        receives."""
        sizes = dict(self.sizes)
        return {**sizes, "world_size": sizes["tp"] * sizes["cp"] * sizes["pp"] * sizes["dp"]}

    @property
    def id(self) -> str:
        """A name for files and configs: ``t03-tp1-cp2-pp1-dp4-micro_batches2``."""
        parts = [f"t{self.index:02d}", *(f"{d}{n}" for d, n in self.sizes)]
        parts += [_SLUG.sub("_", f"{key.rpartition('.')[2]}{value}") for key, value in self.also]
        return "-".join(parts)

    @property
    def label(self) -> str:
        """How reports name it: ``tp1 cp2 pp1 dp4 micro_batches=2``."""
        return " ".join(
            [
                *(f"{d}{n}" for d, n in self.sizes),
                *(f"{key.rpartition('.')[2]}={value}" for key, value in self.also),
            ]
        )

    def overrides(self) -> list[str]:
        """The overrides that select this point: the engine sizes, then the ``--also`` values."""
        return [
            *(f"engine.{d}_size={n}" for d, n in self.sizes),
            *(f"{k}={v}" for k, v in self.also),
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "label": self.label,
            "sizes": dict(self.sizes),
            "also": dict(self.also),
            "world_size": self.layout["world_size"],
            "overrides": self.overrides(),
        }


def parse_also(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``["task.micro_batches=1,2,4"]`` -> ``[("task.micro_batches", ["1", "2", "4"])]`` (Hydra's
    sweep syntax:
    ``a,b``, ``range(1,5)``, ``choice(...)``); :class:`TuneError` naming a bad one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    axes: list[tuple[str, list[str]]] = []
    for spec in specs:
        key = override_key(spec)
        if "=" not in spec or not key:
            raise TuneError(
                f"--also {spec!r}: expected KEY=V1,V2,... (e.g. --also task.micro_batches=1,2,4)"
            )
        if key in SIZE_KEYS or key in OWNED_KEYS:
            raise TuneError(
                f"--also {spec!r}: the tuner chooses {key} itself (it searches every tp/cp/pp/dp "
                "whose product is world_size)"
            )
        if any(key == k for k, _ in axes):
            raise TuneError(
                f"--also {spec!r}: {key} is given twice; give all its values in one --also"
            )
        try:
            parsed = OverridesParser.create().parse_override(spec)
        except HydraException as exc:
            raise TuneError(f"--also {spec!r}: not a Hydra sweep override ({exc})") from None
        if parsed.is_sweep_override() and not parsed.is_discrete_sweep():
            raise TuneError(
                f"--also {spec!r}: only discrete values (a,b,c, range(...), choice(...)) can be "
                "searched"
            )
        values = (
            list(parsed.sweep_string_iterator())
            if parsed.is_sweep_override()
            else [parsed.get_value_element_as_str()]
        )
        if len(set(values)) != len(values):
            raise TuneError(f"--also {spec!r}: a value is given twice")
        axes.append((key, values))
    return axes


def build_space(world_size: int, axes: list[tuple[str, list[str]]]) -> list[Point]:
    """Every layout of ``world_size`` times every combination of the ``--also`` values, numbered in
    order."""
    combos = list(itertools.product(*[[(key, v) for v in values] for key, values in axes]))
    points = []
    for lay in layouts(world_size):
        for combo in combos:
            points.append(Point(len(points), tuple((d, lay[d]) for d in DIMS), tuple(combo)))
    return points


def _world_size(value: str) -> int:
    try:
        world = int(value)
    except ValueError:
        world = 0
    if not 1 <= world <= MAX_WORLD_SIZE or str(world) != value.strip():
        raise TuneError(
            f"world_size={value} is not allowed: expected an integer from 1 to {MAX_WORLD_SIZE} "
            "(the number of ranks every layout has)"
        )
    return world


def split_command(args: list[str], steps_field: str) -> tuple[int, list[str]]:
    """The tune's positional arguments -> (world size, the Hydra overrides every trial gets).

    :class:`TuneError` when ``world_size=N`` is missing or bad, when an override fixes a size the
    tuner chooses, sets what the tuner owns, or is not an override at all.
    """
    world: int | None = None
    overrides: list[str] = []
    for arg in args:
        key = override_key(arg)
        if arg.startswith("-") or "=" not in arg:
            raise TuneError(
                f"{arg!r}: not a Hydra override (KEY=VALUE) nor a tune option (see --help)"
            )
        if key == "world_size":
            world = _world_size(arg.split("=", 1)[1])
        elif key in SIZE_KEYS:
            raise TuneError(
                f"{arg!r} fixes a size the tuner must choose: it searches every tp/cp/pp/dp whose "
                "product is world_size; leave engine.tp_size/cp_size/pp_size/dp_size out"
            )
        elif key in OWNED_KEYS:
            raise TuneError(
                f"{arg!r}: the tuner sets {key} itself for every trial (--dir names the tune's "
                "directory)"
            )
        elif key == f"task.{steps_field}" and "," in arg.split("=", 1)[1]:
            raise TuneError(
                f"{arg!r}: task.{steps_field} is the full length of a run (one value); the tuner "
                "chooses each trial's length"
            )
        else:
            overrides.append(arg)
    if world is None:
        raise TuneError(
            "world_size=N is required: the number of ranks every layout has (e.g. world_size=8)"
        )
    return world, overrides
