"""The one toolkit for checking config fields: engine, launchers and tasks raise the same errors.

Every check raises :class:`ConfigError` with one message shape,
``FIELD=VALUE is not allowed: WHAT IS ALLOWED`` (:func:`config_error`), before any
process starts. ``note`` adds what the field means (``"(0 = no cap)"``). The
predicates (an integer is never a ``bool``) are :mod:`worldfoundry.core.validation`'s.

A config dataclass declares what each field allows where it declares the field
(:func:`integer`, :func:`number`, :func:`flag`, :func:`choice`, :func:`line`: a
:class:`Rule` in the field's metadata), and :func:`check_fields` checks them all; a
``validate`` method is left with the checks that span fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from worldfoundry.core.validation import is_finite_number, is_int, is_number

__all__ = [
    "RULE",
    "ConfigError",
    "Rule",
    "check_bool",
    "check_choice",
    "check_fields",
    "check_int",
    "check_number",
    "check_single_line",
    "choice",
    "closest",
    "config_error",
    "flag",
    "integer",
    "is_finite_number",
    "is_int",
    "is_number",
    "line",
    "number",
    "positive_int",
    "redefault",
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
    found = difflib.get_close_matches(str(name), [str(k) for k in known], n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_field(
    field_name: str, value: Any, known: Iterable[str], owner: str = ""
) -> ConfigError:
    """'engine.cp_sise=2 is not allowed: no such field (did you mean engine.cp_size?); ...'.

    The message ends with the allowed fields. ``owner`` names what lacks the field ('train' ->
    'train has no such field; ...').
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
            left, right = "(" if low_open else "[", ")" if high_open else "]"
            return f"expected {kind}{unit} in {left}{low:g}, {high:g}{right}"
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
    """``value`` if it is a finite number (not a bool) within the bounds; else :class:`ConfigError`.

    ``low_open`` / ``high_open`` exclude the bound itself (``(0, 60]``); ``unit`` names what
    is counted ("seconds", "MB"); ``allowed`` replaces the generated text where the bounds
    need words.
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
    """:class:`ConfigError` when the string ``value`` holds a control character (a newline first).

    Non-strings pass: their type is checked elsewhere. ``why`` says what a newline would do
    there.
    """
    if isinstance(value, str) and _CONTROL.search(value):
        raise config_error(
            field, value, f"{what} without control characters" + (f" ({why})" if why else "")
        )


# --------------------------------------------------------------------------- declared rules

RULE = "wf_launch.rule"
"""The key of a field's :class:`Rule` in its dataclass metadata."""


@dataclass(frozen=True)
class Rule:
    """What one config field allows: a kind (a key of :data:`_KINDS`) and its bounds or choices.

    ``optional`` lets None through (the field's "not set"); ``normalize`` maps a value
    before it is compared with ``choices`` (the error still shows the value as given).
    """

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    unit: str = ""
    note: str = ""
    allowed: str = ""
    choices: tuple[Any, ...] = ()
    normalize: Callable[[Any], Any] | None = None
    why: str = ""
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        """Raise :class:`ConfigError` when ``value`` of field ``name`` breaks the rule."""
        if value is None and self.optional:
            return
        _KINDS[self.kind](self, name, value)


def _check_int(rule: Rule, name: str, value: Any) -> None:
    check_int(name, value, rule.low, rule.high, rule.note)  # type: ignore[arg-type]


def _check_number(rule: Rule, name: str, value: Any) -> None:
    check_number(
        name,
        value,
        rule.low,
        rule.high,
        low_open=rule.low_open,
        high_open=rule.high_open,
        unit=rule.unit,
        note=rule.note,
        allowed=rule.allowed,
    )


def _check_choice(rule: Rule, name: str, value: Any) -> None:
    if rule.normalize is not None and rule.normalize(value) in rule.choices:
        return
    check_choice(name, value, rule.choices, rule.note)


_KINDS: dict[str, Callable[[Rule, str, Any], None]] = {
    "int": _check_int,
    "number": _check_number,
    "bool": lambda rule, name, value: check_bool(name, value),
    "choice": _check_choice,
    "line": lambda rule, name, value: check_single_line(name, value, why=rule.why),
}


def _field(default: Any, rule: Rule) -> Any:
    """A dataclass field with ``default`` (a scalar or None) and ``rule`` in its metadata."""
    return dataclasses.field(default=default, metadata={RULE: rule})


def integer(
    default: int | None,
    low: int | None = None,
    high: int | None = None,
    *,
    note: str = "",
    optional: bool = False,
) -> Any:
    """A dataclass field holding an integer (not a bool) in ``[low, high]``."""
    return _field(default, Rule("int", low, high, note=note, optional=optional))


def number(
    default: float | None,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    unit: str = "",
    note: str = "",
    allowed: str = "",
    optional: bool = False,
) -> Any:
    """A dataclass field holding a finite number within the bounds (see :func:`check_number`)."""
    rule = Rule(
        "number",
        low,
        high,
        low_open=low_open,
        high_open=high_open,
        unit=unit,
        note=note,
        allowed=allowed,
        optional=optional,
    )
    return _field(default, rule)


def flag(default: bool) -> Any:
    """A dataclass field holding ``True`` or ``False``."""
    return _field(default, Rule("bool"))


def choice(
    default: Any,
    choices: Iterable[Any],
    *,
    note: str = "",
    normalize: Callable[[Any], Any] | None = None,
    optional: bool = False,
) -> Any:
    """A dataclass field holding one of ``choices`` (after ``normalize``, when given)."""
    rule = Rule("choice", choices=tuple(choices), note=note, normalize=normalize, optional=optional)
    return _field(default, rule)


def line(default: str | None, *, why: str = "") -> Any:
    """A dataclass field whose string has no control character; ``why`` says what one would do."""
    return _field(default, Rule("line", why=why))


def redefault(owner: type, name: str, default: Any) -> Any:
    """Field ``name`` of dataclass ``owner`` with its rule, under another default.

    A subclass that shares a base's fields but not its defaults (task ``train`` runs a
    smaller model than ``demo``) redeclares only the default.
    """
    base = owner.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return _field(default, base.metadata[RULE])


def check_fields(obj: Any, section: str, kind: type | None = None) -> None:
    """Check every field of dataclass ``obj`` that declares a :class:`Rule`, in field order.

    Errors name the field as ``SECTION.NAME``. ``kind`` limits the check to the fields
    that dataclass has (a base class checking only its own share).
    """
    for f in dataclasses.fields(kind or obj):
        rule = f.metadata.get(RULE)
        if rule is not None:
            rule.check(f"{section}.{f.name}", getattr(obj, f.name))
