"""The live view of a run, for any launcher: scheduler state, console ranks' lines, progress, the
final line.

:class:`LiveView` is what a waiting launcher (``launcher=slurm`` polling its job) and
``python -m wf_launch.status --follow`` (a local or detached run) show:

* the scheduler's state of each run, on change only (``SLURM job 42: PENDING
  (Resources)``), from the launcher's optional ``live_state(run_dir)`` hook;
* the console ranks' (``launcher.console_ranks``) log lines as they are written,
  with their rank labels (a single run; a sweep shows states only);
* the run's progress (:class:`~wf_launch.observe.progress.ProgressMonitor`) once ranks report.

:func:`final_line` is the one line every launch ends with, whatever its launcher
(the CLI prints it after ``launch`` returns, and ``status --follow`` at the end):
``run ok in 12.34s: RUN_DIR/result.json``; the root cause of a failure follows it.
A local launcher shows its ranks' lines itself (they write to the console), so it
uses :func:`progress_monitor` but not :class:`LiveView`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_int

from ..config.layout import rank_label, run_layout
from ..rank.ranklog import QUIET_MARK
from ..rundir import files
from ..rundir.io import open_regular
from ..rundir.outcome import RunOutcome
from ..rundir.record import RunRecord
from ..rundir.text import printable
from .progress import ProgressMonitor, ProgressView

__all__ = ["LiveView", "StateOf", "console_form", "console_ranks", "final_line", "progress_monitor"]

_BACKLOG_BYTES = 1 << 16
"""How far back from a log's end the backlog is looked for (a log may hold a GB)."""
_READ_BYTES = 4 << 20
"""The most of a log read at one tick (the rest comes at the next)."""
_MAX_LINE = 16 << 10
"""The most of one line shown (a rank may print a megabyte on one line)."""

StateOf = Callable[[Path], "tuple[str, str] | None"]
"""A launcher's ``live_state(run_dir)``: ('SLURM job 42', 'RUNNING on n[1-2]'), or None when not
known."""


def final_line(outcome: RunOutcome) -> str:
    """'run ok in 12.34s: RUN_DIR/result.json': status, wall time and the record's path."""
    record = outcome.record
    if record is None:
        return f"run {outcome.status}: {outcome.run_dir} (no record)"
    wall = record.timings.get("wall_s") or 0.0
    return f"run {outcome.status} in {wall:.2f}s: {RunRecord.path(outcome.run_dir)}"


def console_ranks(config: dict[str, Any], world_size: int) -> list[int]:
    """The ranks ``launcher.console_ranks`` shows (null: every rank); entries that are not ranks are
    left out."""
    launcher = config.get("launcher")
    ranks = launcher.get("console_ranks") if isinstance(launcher, dict) else None
    if not isinstance(ranks, list):
        return list(range(world_size))
    return [r for r in ranks if is_int(r) and 0 <= r < world_size]


def progress_monitor(
    run_dir: Path,
    config: dict[str, Any],
    label_of: Callable[[int], str],
    write: Callable[[str], None],
    warn: Callable[[str], None] | None = None,
    since: float | None = None,
) -> ProgressMonitor:
    """The run's progress display, set up from its ``launcher.progress_interval_s`` and
    ``stall_warning_s``.

    Stall warnings go to ``warn`` (default ``write``); states older than ``since`` (an earlier
    attempt's, on a resume) are not shown.
    """
    lc = config.get("launcher") if isinstance(config.get("launcher"), dict) else {}
    view = ProgressView(
        Path(run_dir),
        run_layout(config).world_size,
        label_of,
        _seconds(lc.get("stall_warning_s"), 300),
        since=since,
    )
    interval = _seconds(lc.get("progress_interval_s"), 10)
    return ProgressMonitor(view, interval, write=write, warn=warn)


def _seconds(value: Any, default: float) -> float:
    """A launcher interval from a run's config, or ``default`` when it is not a positive finite
    number."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return default
    return seconds if 0 < seconds < float("inf") else default


def console_form(line: str) -> str:
    """A rank log file line ('time | LEVEL | [label] where | message') as '[label] message'."""
    parts = line.split(" | ", 3)
    if len(parts) == 4 and parts[2].startswith("["):
        return f"{parts[2].split(']', 1)[0]}] {parts[3]}"
    return line


def console_shows(line: str, previous: bool) -> bool:
    """Whether a rank's console would show this log line: INFO and above, never a record it keeps
    for its file (its failure: the launcher shows ranks that failed alike once). A line that
    continues a record (a traceback) goes with it (``previous``)."""
    parts = line.split(" | ", 3)
    if len(parts) != 4 or not parts[2].startswith("["):
        return previous
    return parts[1].strip() != "DEBUG" and not parts[2].endswith(QUIET_MARK)


class LiveView:
    """What is shown about runs while they run (call :meth:`tick` every poll, :meth:`close` at the
    end).

    ``state_of`` is the launcher's ``live_state`` hook (None for a launcher without a
    queue, e.g. a local run). ``backlog`` None streams the console ranks' logs from
    their start (a launcher that just started the run); N shows only the last N lines
    already written, then new ones (attaching to a run that has been going for hours).
    Lines go to ``write`` (stall warnings to ``warn``, default ``write``); on a terminal they
    are written above the progress bar, which is redrawn below them. A launcher's view
    (``backlog`` None) shows no progress an earlier attempt left (a resumed run's).
    """

    def __init__(
        self,
        run_dirs: list[Path],
        write: Callable[[str], None],
        state_of: StateOf | None = None,
        backlog: int | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self._write = write
        self._warn = warn or write
        self.backlog = backlog
        self.runs = [Path(d) for d in run_dirs]
        self.state_of = state_of
        self.single = len(self.runs) == 1
        self.console: list[int] = []
        self._states: dict[Path, tuple[str, str]] = {}
        self._offsets: dict[Path, int] = {}
        self._shown: dict[Path, bool] = {}
        self._monitor: ProgressMonitor | None = None
        if self.single:
            config = files.read_config(self.runs[0])
            layout = run_layout(config)
            self.console = console_ranks(config, layout.world_size)
            self._monitor = progress_monitor(
                self.runs[0],
                config,
                lambda r: rank_label(r, layout.coords(r)),
                self.write,
                warn=lambda line: self.write(line, warning=True),
                since=time.time() if backlog is None else None,
            )

    def write(self, line: str, warning: bool = False) -> None:
        """Show ``line`` (what a run wrote, or its scheduler said: control characters escaped)
        above the bar; a ``warning`` goes to the view's ``warn``."""
        out = self._warn if warning else self._write
        line = printable(
            line
            if len(line) <= _MAX_LINE
            else f"{line[:_MAX_LINE]}... ({len(line)} characters, cut)"
        )
        bar = self._monitor._bar if self._monitor is not None else None
        if bar is None:
            out(line)
            return
        bar.clear()
        out(line)
        sys.stderr.flush()
        bar.refresh()

    def tick(self) -> None:
        for run_dir in self.runs:
            state = self.state_of(run_dir) if self.state_of is not None else None
            if state is not None and state != self._states.get(run_dir):
                self._states[run_dir] = state
                label, text = state
                where = "" if self.single else f" ({run_dir.name})"
                self.write(f"{label}{where}: {text}")
            if self.single:
                self._stream(run_dir)
        if self._monitor is not None:
            self._monitor.tick()

    def _stream(self, run_dir: Path) -> None:
        """Write the console ranks' new complete log lines, as '[r0 tp0 cp0 pp0 dp0] message'."""
        logs = files.rank_files(run_dir, "log")
        for rank in (
            self.console
            if len(self.console) <= len(logs)
            else sorted(set(self.console) & set(logs))
        ):
            path = files.rank_log(run_dir, rank)
            offset = self._offsets.get(path)
            first = offset is None and self.backlog is not None
            try:
                with open(open_regular(path), "rb") as f:
                    if first:
                        offset = max(0, f.seek(0, os.SEEK_END) - _BACKLOG_BYTES)
                    f.seek(offset or 0)
                    data = f.read(_READ_BYTES)
            except (OSError, ValueError):
                continue
            end = data.rfind(b"\n")
            if end < 0:
                if (
                    len(data) == _READ_BYTES
                ):  # one line longer than a read: skipped, never re-read for ever
                    self._offsets[path] = (offset or 0) + len(data)
                continue
            self._offsets[path] = (offset or 0) + end + 1
            lines = data[:end].decode(errors="replace").splitlines()
            if first:
                lines = lines[1:] if offset else lines  # the first one may be cut
                lines = lines[-self.backlog :] if self.backlog else []
            self._show(path, lines)

    def _show(self, path: Path, lines: list[str]) -> None:
        """Write what the rank's console would show of ``lines`` (:func:`console_shows`)."""
        for line in lines:
            self._shown[path] = console_shows(line, self._shown.get(path, True))
            if self._shown[path]:
                self.write(console_form(line))

    def close(self) -> None:
        """Show the last lines and the last progress state, and close the bar (the final line
        follows it)."""
        if self.single:
            for run_dir in self.runs:
                self._stream(run_dir)
        if self._monitor is not None:
            self._monitor.stop()
