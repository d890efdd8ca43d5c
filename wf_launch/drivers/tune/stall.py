"""A trial that stopped making progress: when it last showed life, and stopping it with its stacks
on record.

Life is what the ranks write as they go: ``logs/rank{r}.pid`` and the ``arrived`` /
``joined`` markers at start-up, then ``logs/rank{r}.progress.json`` at every
``ctx.progress`` (published at least every 0.5 s while steps advance). A trial whose
ranks have written nothing yet is not stalled unless it runs locally (a SLURM trial may
wait in the queue); a local launch writes its ``config.yaml`` just before forking.
"""

from __future__ import annotations

import signal
from pathlib import Path

from ...config.layout import layout_of, rank_label
from ...launchers import get_launcher
from ...observe.stacks import live_autopsy
from ...rundir import files
from .measure import read_steps

__all__ = ["last_activity", "stop_stalled"]


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def last_activity(run_dir: Path, world_size: int, local: bool) -> float | None:
    """When the trial's ranks last showed life (Unix time), or None: not started yet."""
    times = []
    for rank in range(world_size):
        times += [
            _mtime(files.rank_progress(run_dir, rank)),
            _mtime(files.rank_pid(run_dir, rank)),
            *(_mtime(files.rank_marker(run_dir, rank, phase)) for phase in ("arrived", "joined")),
        ]
    found = [t for t in times if t is not None]
    if found:
        return max(found)
    return _mtime(files.config_path(run_dir)) if local else None


def stop_stalled(run_dir: Path, world_size: int, launcher_name: str, stall_s: float) -> str:
    """Dump the stalled trial's stacks, stop it through its launcher, and say why (for the
    report)."""
    launcher = get_launcher(launcher_name)
    step = max(read_steps(run_dir), default=None)
    where: list[str] = []
    try:
        layout = layout_of(files.read_config(run_dir, strict=True))
        _, lines = live_autopsy(
            run_dir,
            world_size,
            lambda r: rank_label(r, layout.coords(r)),
            launcher.signal_ranks,
            wait_s=3.0,
        )
        where = [line.strip() for line in lines[1:] if not line.strip().startswith("full dumps")]
    except (OSError, ValueError) as exc:
        where = [f"no stacks: {exc}"]
    cancel = getattr(launcher, "cancel", None)
    if callable(cancel):
        cancel(run_dir)
    else:
        launcher.signal_ranks(run_dir, signal.SIGKILL)
    at = "before its first step" if step is None else f"after step {step}"
    return f"no progress for {stall_s:g} s {at}; stopped by the tuner" + (
        f"; {'; '.join(where[:3])}" if where else ""
    )
