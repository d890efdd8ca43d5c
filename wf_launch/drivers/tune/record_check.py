"""Every field of a ``tune.json`` checked before a resume uses it (issue 29).

A tune directory may have been changed by someone else (a group-writable directory
made under an old umask) or by a crash. Nothing in it is executed or trusted as
written: the space is rebuilt from ``world_size`` and ``--also`` and must match the
stored points exactly (so trial ids, which name files, are the tuner's own), the
overrides pass the same checks as on the command line, and every number, string and
reference to a trial is checked. :func:`check_record` raises :class:`TuneError`
naming the field, the value and what is allowed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

from ...rundir.record import Status
from .prune import check_conflicts
from .space import MAX_WORLD_SIZE, TuneError, build_space, parse_also, split_command

__all__ = ["ROUND_STATUSES", "TUNE_STATUSES", "check_record"]

TUNE_STATUSES = ("done", "running", "interrupted", "budget", "failed")
ROUND_STATUSES = ("running", "done", "budget", "interrupted", "no_metric", "sweep_failed")
MEASURE_STATUSES = (
    *("ok", "no_metric", "stalled", "oom", "failed", "not_run", "incomplete", "unreadable"),
    *(str(s) for s in Status if str(s) not in ("ok", "failed")),
)
"""A trial's measurement takes the tuner's own statuses, or its run's (an interrupted point)."""
VERDICTS = ("valid", "invalid", "memory")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BIG = 10**9


class _Checker:
    """Checks of one record; each failure names ``tune.json``'s field."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, field: str, value: Any, allowed: str) -> TuneError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        return TuneError(f"{self.where}: field {field} = {shown} is not allowed: {allowed}")

    def integer(self, field: str, value: Any, low: int = 0, high: int = _BIG) -> int:
        if type(value) is not int or not low <= value <= high:
            raise self.fail(field, value, f"an integer from {low} to {high}")
        return value

    def number(self, field: str, value: Any, optional: bool = False, low: float = 0.0) -> Any:
        if value is None and optional:
            return None
        ok = type(value) in (int, float) and math.isfinite(value) and value >= low
        if not ok:
            what = "a finite number" + (f" >= {low:g}" if low > -math.inf else "")
            raise self.fail(field, value, what + (" or null" if optional else ""))
        return value

    def text(
        self, field: str, value: Any, pattern: re.Pattern[str] | None = None, lines: bool = False
    ) -> str:
        """A string without control characters (``lines``: but for new lines and tabs)."""
        bad = _CONTROL_BUT_LINES if lines else _CONTROL
        if not isinstance(value, str) or len(value) > 100_000 or bad.search(value):
            raise self.fail(field, value, "a string without control characters")
        if pattern is not None and not pattern.fullmatch(value):
            raise self.fail(field, value, f"a string matching {pattern.pattern}")
        return value

    def texts(self, field: str, value: Any, lines: bool = False) -> list[str]:
        if not isinstance(value, list):
            raise self.fail(field, value, "a list of strings")
        return [self.text(f"{field}[{i}]", v, lines=lines) for i, v in enumerate(value)]

    def choice(self, field: str, value: Any, allowed: tuple[str, ...]) -> str:
        if value not in allowed:
            raise self.fail(field, value, f"one of {', '.join(allowed)}")
        return value

    def mapping(self, field: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(field, value, "a JSON object")
        return value


def _check_args(c: _Checker, args: dict[str, Any]) -> None:
    world = c.integer("args.world_size", args.get("world_size"), 1, MAX_WORLD_SIZE)
    steps_field = c.text("args.steps_field", args.get("steps_field"), _NAME)
    overrides = c.texts("args.overrides", args.get("overrides"))
    also = args.get("also")
    if not isinstance(also, list) or not all(
        isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) for a in also
    ):
        raise c.fail("args.also", also, "a list of [KEY, [VALUE, ...]] pairs")
    axes = []
    for i, (key, values) in enumerate(also):
        values = c.texts(f"args.also[{i}]", values)
        parsed = parse_also([f"{c.text(f'args.also[{i}]', key)}={','.join(values)}"])
        if parsed != [(key, values)]:
            raise c.fail(f"args.also[{i}]", also[i], "the values --also gave (KEY=V1,V2,...)")
        axes.append((key, values))
    if split_command([f"world_size={world}", *overrides], steps_field)[1] != overrides:
        raise c.fail("args.overrides", overrides, "Hydra overrides a tune accepts")
    check_conflicts(overrides, axes)
    c.number("args.mem_gb", args.get("mem_gb"), optional=True)
    c.text("args.metric", args.get("metric"), _NAME)
    c.integer("args.warmup", args.get("warmup"), 0, 10_000)
    c.integer("args.min_steps", args.get("min_steps"), 1, 1_000_000)
    cutoff = c.number("args.cutoff", args.get("cutoff"))
    if cutoff >= 1:
        raise c.fail("args.cutoff", cutoff, "a fraction in [0, 1)")
    settings = c.mapping("args.settings", args.get("settings", {}))
    c.number("args.settings.budget_s", settings.get("budget_s"), optional=True)
    c.number("args.settings.stall_s", settings.get("stall_s"), optional=True)


def _check_space(c: _Checker, data: dict[str, Any]) -> set[str]:
    """The ids of the valid points; every stored point must be the one the tuner builds."""
    args = data["args"]
    axes = [(k, list(v)) for k, v in args["also"]]
    built = [p.to_json() for p in build_space(args["world_size"], axes)]
    space = data.get("space")
    if not isinstance(space, list) or len(space) != len(built):
        raise c.fail("space", space, f"the {len(built)} point(s) world_size and --also make")
    valid = set()
    for i, (point, want) in enumerate(zip(space, built)):
        point = c.mapping(f"space[{i}]", point)
        for key, value in want.items():
            if point.get(key) != value:
                raise c.fail(f"space[{i}].{key}", point.get(key), f"{value!r}")
        verdict = c.mapping(f"space[{i}].verdict", point.get("verdict"))
        status = c.choice(f"space[{i}].verdict.status", verdict.get("status"), VERDICTS)
        c.text(f"space[{i}].verdict.message", verdict.get("message", ""), lines=True)
        c.number(f"space[{i}].verdict.estimate_gb", verdict.get("estimate_gb"), optional=True)
        if status == "valid":
            valid.add(want["id"])
    return valid


def _subset(c: _Checker, field: str, value: Any, known: set[str]) -> list[str]:
    items = c.texts(field, value)
    if len(set(items)) != len(items) or not set(items) <= known:
        raise c.fail(field, value, "distinct ids of valid trials of this tune")
    return items


def _check_round(c: _Checker, i: int, rec: Any, valid: set[str], full: int) -> None:
    f = f"rounds[{i}]"
    rec = c.mapping(f, rec)
    c.integer(f"{f}.index", rec.get("index"), i, i)
    c.integer(f"{f}.steps", rec.get("steps"), 1, full)
    trials = _subset(c, f"{f}.trials", rec.get("trials"), valid)
    c.choice(f"{f}.status", rec.get("status"), ROUND_STATUSES)
    _subset(c, f"{f}.kept", rec.get("kept", []), set(trials))
    dropped = c.mapping(f"{f}.dropped", rec.get("dropped", {}))
    _subset(c, f"{f}.dropped", list(dropped), set(trials))
    c.texts(f"{f}.dropped", list(dropped.values()), lines=True)
    for key in ("started_at", "ended_at", "wall_s"):
        c.number(f"{f}.{key}", rec.get(key), optional=True)
    if rec.get("exit_code") is not None:
        c.integer(f"{f}.exit_code", rec.get("exit_code"), -255, 255)
    c.texts(f"{f}.argv", rec.get("argv", []))  # an older record's; never run


def _check_measurement(c: _Checker, i: int, m: Any, valid: set[str], rounds: int) -> None:
    f = f"measurements[{i}]"
    m = c.mapping(f, m)
    _subset(c, f"{f}.trial", [m.get("trial")], valid)
    c.integer(f"{f}.round", m.get("round"), 0, max(rounds - 1, 0))
    c.choice(f"{f}.status", m.get("status"), MEASURE_STATUSES)
    c.text(f"{f}.cause", m.get("cause", ""), lines=True)
    for key in ("source", "run_dir"):
        c.text(f"{f}.{key}", m.get(key, ""))
    for key in ("steps", "measured"):
        c.integer(f"{f}.{key}", m.get(key, 0))
    for key in ("step_time", "value", "p25", "p75", "wall_s", "overhead_s"):
        c.number(f"{f}.{key}", m.get(key), optional=True, low=-math.inf)


def _check_top(c: _Checker, data: dict[str, Any], valid: set[str]) -> None:
    checks: list[tuple[str, Callable[[Any], Any]]] = [
        ("full_length", lambda v: c.integer("full_length", v, 1)),
        ("launcher", lambda v: c.text("launcher", v, _NAME)),
        ("command", lambda v: c.texts("command", v)),
        ("status", lambda v: c.choice("status", v, TUNE_STATUSES)),
        ("elapsed_s", lambda v: c.number("elapsed_s", v)),
        ("created_at", lambda v: c.number("created_at", v)),
        ("finished_at", lambda v: c.number("finished_at", v, optional=True)),
        ("sessions", lambda v: c.integer("sessions", v, 1, 1_000_000)),
    ]
    defaults = {"full_length": 1, "launcher": "local", "command": [], "status": "running"}
    for key, check in checks:
        check(data.get(key, defaults.get(key, 0 if key != "sessions" else 1)))
    if data.get("winner") is not None:
        _subset(c, "winner", [data["winner"]], valid)


def check_record(data: Any, where: str) -> None:
    """:class:`TuneError` naming the first field of the tune record ``data`` that is not allowed."""
    c = _Checker(where)
    try:
        _check(c, c.mapping("(the record)", data))
    except TuneError as exc:
        text = str(exc)
        raise TuneError(text if text.startswith(where) else f"{where}: {text}") from None


def _check(c: _Checker, data: dict[str, Any]) -> None:
    _check_args(c, c.mapping("args", data.get("args")))
    valid = _check_space(c, data)
    _check_top(c, data, valid)
    rounds = data.get("rounds", [])
    if not isinstance(rounds, list):
        raise c.fail("rounds", rounds, "a list")
    for i, rec in enumerate(rounds):
        _check_round(c, i, rec, valid, data.get("full_length", 1))
    ms = data.get("measurements", [])
    if not isinstance(ms, list):
        raise c.fail("measurements", ms, "a list")
    for i, m in enumerate(ms):
        _check_measurement(c, i, m, valid, len(rounds))
