"""A finished rank leaves before the interpreter's teardown, which can abort it (torch quirk)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_BOMB = """
import os, sys
from wf_launch.rank.hardexit import exit_after_cleanup

class TeardownAbort:
    def __del__(self):  # stands in for torch's C++ teardown aborting at interpreter exit
        os.abort()

keep = TeardownAbort()
print("work done", flush=True)
{leave}
{end}
"""


def _run(leave: str, end: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BOMB.format(leave=leave, end=end)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_teardown_abort_is_real_without_the_hook() -> None:
    proc = _run("")
    assert proc.returncode == -6 and "work done" in proc.stdout


@pytest.mark.parametrize("code", [0, 1])
def test_a_rank_leaves_with_its_code_before_the_teardown(code: int) -> None:
    proc = _run(f"exit_after_cleanup({code})")
    assert proc.returncode == code, proc.stderr
    assert "work done" in proc.stdout


def test_an_unhandled_error_is_printed_before_leaving() -> None:
    proc = _run("exit_after_cleanup(1)", "raise RuntimeError('task failed')")
    assert proc.returncode == 1
    assert "RuntimeError: task failed" in proc.stderr
