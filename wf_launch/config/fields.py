"""The one toolkit for checking config fields: engine, launchers and tasks raise the same errors with it.

Every check raises :class:`ConfigError` with one message shape,
``FIELD=VALUE is not allowed: WHAT IS ALLOWED`` (:func:`config_error`), before any
process starts. ``note`` adds what the field means (``"(0 = no cap)"``). The
predicates (an integer is never a ``bool``) are :mod:`worldfoundry.core.validation`'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TypeVar

from worldfoundry.core.validation import is_finite_number, is_int, is_number

__all__ = [
    "ConfigError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_single_line",
    "closest",
    "config_error",
    "is_finite_number",
    "is_int",
    "is_number",
    "positive_int",
    "unknown_field",
]

T = TypeVar("T")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ConfigError(ValueError):
    """A config value is not allowed; the message names field, value and what is allowed."""


def config_error(field_name: str, value: Any, allowed: str) -> ConfigError:
    """'FIELD=VALUE is not allowed: ALLOWED', the one shape of every config error."""
    return ConfigError(f"{field_name}={value!r} is not allowed: {allowed}")


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` most likely misspells (``cp_sise`` -> ``cp_size``), or None."""
    import difflib

    found = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_field(
    field_name: str, value: Any, known: Iterable[str], owner: str = ""
) -> ConfigError:
    """'engine.cp_sise=2 is not allowed: no such field (did you mean engine.cp_size?); allowed fields: [...]'.

    ``owner`` names what lacks the field ('train' -> 'train has no such field; ...').
    """
    known = sorted(str(k) for k in known)
    parent, _, leaf = field_name.rpartition(".")
    guess = closest(leaf, known)
    meant = f" (did you mean {parent + '.' if parent else ''}{guess}?)" if guess else ""
    return config_error(
        field_name,
        value,
        f"{owner + ' has ' if owner else ''}no such field{meant}; allowed fields: {known}",
    )


def _with(text: str, note: str) -> str:
    return f"{text} {note}" if note else text


def _bounds(
    kind: str, low: float | None, high: float | None, low_open: bool, high_open: bool, unit: str
) -> str:
    unit = f" {unit}" if unit else ""
    if low is not None and high is not None:
        if low_open or high_open:
            return f"expected {kind}{unit} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        return f"expected {kind}{unit} from {low:g} to {high:g}"
    if low is not None:
        return f"expected {kind}{unit} {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"expected {kind}{unit} {'<' if high_open else '<='} {high:g}"
    return f"expected {kind}{unit}"


def check_int(
    field: str, value: Any, low: int | None = None, high: int | None = None, note: str = ""
) -> int:
    """``value`` if it is an integer (not a bool) in ``[low, high]``; else :class:`ConfigError`."""
    if (
        not is_int(value)
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        raise config_error(
            field, value, _with(_bounds("an integer", low, high, False, False, ""), note)
        )
    return value


def positive_int(field: str, value: Any, note: str = "") -> int:
    """:func:`check_int` with ``low=1``."""
    return check_int(field, value, low=1, note=note)


def check_number(
    field: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    unit: str = "",
    note: str = "",
    allowed: str = "",
) -> float:
    """``value`` if it is a finite number (int or float, not a bool) within the bounds; else :class:`ConfigError`.

    ``low_open`` / ``high_open`` exclude the bound itself (``(0, 60]``); ``unit`` names what is
    counted ("seconds", "MB"); ``allowed`` replaces the generated text where the bounds need words.
    """
    ok = is_finite_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        kind = "a number" if not unit else ""
        text = allowed or _bounds(kind, low, high, low_open, high_open, unit).replace(
            "expected  ", "expected "
        )
        raise config_error(field, value, _with(text, note))
    return value


def check_bool(field: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``; else :class:`ConfigError`."""
    if not isinstance(value, bool):
        raise config_error(field, value, "expected true or false")
    return value


def check_choice(field: str, value: T, choices: Iterable[T], note: str = "") -> T:
    """``value`` if it is one of ``choices``; else :class:`ConfigError` listing them."""
    allowed = list(choices)
    if value not in allowed:
        raise config_error(field, value, _with(f"choose one of {allowed}", note))
    return value


def check_single_line(field: str, value: Any, what: str = "a single line", why: str = "") -> None:
    """:class:`ConfigError` when the string ``value`` holds a control character (a newline above all).

    Non-strings pass: their type is checked elsewhere. ``why`` says what a newline would do there.
    """
    if isinstance(value, str) and _CONTROL.search(value):
        raise config_error(
            field, value, f"{what} without control characters" + (f" ({why})" if why else "")
        )
