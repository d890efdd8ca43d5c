"""Sweep reports: one row per ``-m`` point, as CSV, Markdown and charts (docs/sweeps.md).

:mod:`.points` reads the points from their job directories, :mod:`.tables` and
:mod:`.charts` render them, :mod:`.report` writes the report (and is
``python -m wf_launch.sweep_report``), :mod:`.callback` is the Hydra callback that
writes it when a sweep ends.
"""

from __future__ import annotations

from .points import collect_points
from .report import sweep_exit_code, write_report

__all__ = ["collect_points", "sweep_exit_code", "write_report"]
