"""Text a run wrote, made safe to print: no terminal control sequence from a run file reaches a
console.

Failure messages, task names, metric names and rank-log lines come from files a run
(or whoever could write into it) wrote. Printed raw, an escape sequence in them can
retitle the terminal window, clear the screen, or move the cursor to overwrite what
was printed before. :func:`printable` writes every C0 and C1 control character (and
the Unicode line separators and bidirectional overrides, which reorder or split what
is shown) as a visible ``\\xNN`` / ``\\uNNNN`` escape, and so each byte of a file
name that is not UTF-8 (Python holds it as a lone surrogate; printed raw, ``\\x9b`` is
an 8-bit CSI); tab and newline are kept only where the text may span lines
(``multiline=True``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["printable"]

_UNSAFE = (
    "\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff"
)
_ONE_LINE = re.compile(f"[\t\n{_UNSAFE}]")
_MULTI_LINE = re.compile(f"[{_UNSAFE}]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a file name that is not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: Any, multiline: bool = False) -> str:
    """``text`` (any value, as ``str()``) with its control characters escaped: safe to print on a
    terminal."""
    return (_MULTI_LINE if multiline else _ONE_LINE).sub(_escape, str(text))
