"""The live view of a waiting SLURM launcher: queue state and reason, rank output, progress, the final line.

While :func:`~.poll.wait_all` waits, :class:`LiveView` shows what a local run shows:

* the job's queue state and SLURM's reason, on change only (``PENDING (Resources)``,
  ``RUNNING on n[1-2]``);
* the console ranks' (``launcher.console_ranks``) log lines as they are written,
  with their rank labels (a single run; a sweep shows states only);
* the run's progress (:class:`~wf_launch.progress.ProgressMonitor`) once ranks report;
* at the end, the same final line as a local run: status, wall time, the record's
  path, and the root cause on failure.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import rundir
from ...outcome import RunOutcome
from ...progress import ProgressMonitor, ProgressView
from ...record import RunRecord
from .finalize import checked_job_id, read_job

__all__ = ["LiveView", "final_line", "queue_state"]


def queue_state(job_id: str) -> str | None:
    """'PENDING (Resources)' or 'RUNNING on n[1-2]' from squeue; None once the job left the queue."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", checked_job_id(job_id), "-o", "%T|%r|%N"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    if not line:
        return None
    state, reason, nodes = [*line.split("|"), "", ""][:3]
    if state == "PENDING":
        return f"PENDING ({reason})" if reason and reason != "None" else "PENDING"
    return f"{state} on {nodes}" if nodes else state


def final_line(outcome: RunOutcome, run_dir: Path) -> str:
    """'run ok in 12.3s: RUN_DIR/result.json' (the root cause of a failure follows it, printed by the CLI)."""
    record = outcome.record
    wall = (record.timings.get("wall_s") if record is not None else None) or 0.0
    return f"run {outcome.status} in {wall:.2f}s: {RunRecord.path(run_dir)}"


class LiveView:
    """What a waiting SLURM launcher shows about its runs (call :meth:`tick` every poll)."""

    def __init__(self, run_dirs: list[Path], write: Callable[[str], None]) -> None:
        self.write = write
        self.runs = {Path(d): read_job(d) or {} for d in run_dirs}
        self.single = len(run_dirs) == 1
        self._states: dict[Path, str | None] = {}
        self._offsets: dict[Path, int] = {}
        self._monitor: ProgressMonitor | None = None
        if self.single:
            from ...entrypoint import layout_of
            from ...ranklog import rank_label

            run_dir = next(iter(self.runs))
            config = _config(run_dir)
            lc = config.get("launcher") or {}
            layout = layout_of(config)
            console = lc.get("console_ranks")
            self.console = list(range(layout.world_size)) if console is None else list(console)
            view = ProgressView(run_dir, layout.world_size, lambda r: rank_label(r, layout.coords(r)),
                                float(lc.get("stall_warning_s", 300)))
            self._monitor = ProgressMonitor(view, float(lc.get("progress_interval_s", 10)), write=write)

    def tick(self) -> None:
        for run_dir, job in self.runs.items():
            state = queue_state(job["job_id"]) if job.get("job_id") else None
            if state is not None and state != self._states.get(run_dir):
                self._states[run_dir] = state
                where = "" if self.single else f" ({run_dir.name})"
                self.write(f"SLURM job {job['job_id']}{where}: {state}")
            if self.single:
                self._stream(run_dir)
        if self._monitor is not None:
            self._monitor.tick()

    def _stream(self, run_dir: Path) -> None:
        """Write the console ranks' new complete log lines, as '[r0 tp0 cp0 pp0 dp0] message'."""
        for rank in self.console:
            path = rundir.rank_log(run_dir, rank)
            offset = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self._offsets[path] = offset + end + 1
            for line in data[:end].decode(errors="replace").splitlines():
                self.write(_console_form(line))

    def close(self) -> None:
        if self.single:
            for run_dir in self.runs:
                self._stream(run_dir)
        if self._monitor is not None:
            self._monitor.tick()


def _config(run_dir: Path) -> dict[str, Any]:
    import yaml

    try:
        return yaml.safe_load((run_dir / rundir.CONFIG).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}



def _console_form(line: str) -> str:
    """A rank log file line ('time | LEVEL | [label] where | message') as '[label] message'."""
    parts = line.split(" | ", 3)
    if len(parts) == 4 and parts[2].startswith("["):
        return f"{parts[2].split(']', 1)[0]}] {parts[3]}"
    return line
