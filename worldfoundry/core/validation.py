"""What counts as an integer or a number in an argument or a config field: one definition for the
project.

``bool`` is a subclass of ``int`` in Python, so ``isinstance(True, int)`` holds; a
``True`` passed as a size or a step is always a mistake. These predicates exclude it;
every argument check in ``worldfoundry`` and every config field check in ``wf_launch``
(:mod:`wf_launch.config.fields`) is built on them.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["is_finite_number", "is_int", "is_number"]


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool`` (``nan`` and ``inf`` included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """:func:`is_number` and finite."""
    return is_number(value) and math.isfinite(value)
