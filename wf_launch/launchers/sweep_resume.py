"""Resuming a sweep: ``python -m wf_launch -m ... hydra.sweep.dir=DIR launcher.resume=true``.

Only the points of ``DIR`` that did not end ``ok`` run again (failed, invalid,
cancelled, interrupted, never started); a point that ended ok keeps its directory and
result, and one that is still running (a SLURM job in the queue, a live local launch)
is left to finish. A point that runs again continues in its own directory as a single
run with ``launcher.resume=true`` does (its checkpoints and attempt records stay).
The report then covers every point.

A sweep directory is resumed only by the sweep that made it: the same overrides, in the
same order (they number the points), apart from :data:`EXEMPT` keys that do not change
what a point computes. Anything else is refused (exit 2) naming what differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.claim import launch_alive
from ..rundir.io import read_yaml
from ..rundir.outcome import RunOutcome
from ..rundir.record import RecordError, RunRecord, Status
from .registry import get_launcher

__all__ = [
    "EXEMPT",
    "ResumeRefused",
    "check_same_sweep",
    "count_kept",
    "kept_outcome",
    "still_running",
    "sweep_parameters",
]

EXEMPT = frozenset(
    {
        "launcher.resume",
        "launcher.dry_run",
        "launcher.console_ranks",
        "launcher.progress_interval_s",
        "launcher.stall_warning_s",
    }
)
"""Overrides a resumed sweep may add, drop or change: they do not change what a point computes."""


class ResumeRefused(Exception):
    """The sweep asked to resume a directory that another sweep made (or that cannot be checked)."""


def sweep_parameters(
    task_overrides: list[str], sweeper_params: dict[str, Any] | None = None
) -> list[tuple[str, str]]:
    """(key, values) of a sweep's overrides as Hydra parses them, in order, :data:`EXEMPT` keys left
    out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    args = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + [
        str(o) for o in task_overrides
    ]
    out = []
    for override in OverridesParser.create().parse_overrides(args):
        key = override.get_key_element()
        if key.lstrip("+~") in EXEMPT:
            continue
        if override.is_sweep_override() and override.is_discrete_sweep():
            value = ",".join(override.sweep_string_iterator())
        else:
            value = override.get_value_element_as_str()
        out.append((key, value))
    return out


def _describe(old: list[tuple[str, str]], new: list[tuple[str, str]]) -> list[str]:
    before, after = dict(old), dict(new)
    lines = [
        f"{k}: {before[k]} there, {after[k]} now"
        for k in before
        if k in after and before[k] != after[k]
    ]
    lines += [f"{k}={before[k]} there, not given now" for k in before if k not in after]
    lines += [f"{k}={after[k]} now, not there" for k in after if k not in before]
    if not lines and [k for k, _ in old] != [k for k, _ in new]:
        lines.append(
            f"the order of the overrides (it numbers the points): {' '.join(k for k, _ in old)} "
            "there, "
            f"{' '.join(k for k, _ in new)} now"
        )
    return lines


def check_same_sweep(sweep_dir: Path, config: Any) -> None:
    """:class:`ResumeRefused` unless the sweep being launched (``config``, Hydra's) is the one that
    made ``sweep_dir``."""
    try:
        plan = read_yaml(sweep_dir / files.SWEEP_PLAN)
        if plan is None and not (sweep_dir / files.SWEEP_PLAN).exists():
            raise FileNotFoundError(files.SWEEP_PLAN)
        plan = plan or {}
    except FileNotFoundError:
        raise ResumeRefused(
            f"launcher.resume=true: {sweep_dir} holds points but no {files.SWEEP_PLAN}: cannot "
            "check "
            "that this sweep made it"
        ) from None
    except (OSError, ValueError) as exc:
        raise ResumeRefused(
            f"launcher.resume=true: {sweep_dir / files.SWEEP_PLAN} is not readable ({exc})"
        ) from None
    hydra_old = (plan.get("hydra") or {}) if isinstance(plan, dict) else {}
    old = sweep_parameters(
        list((hydra_old.get("overrides") or {}).get("task") or []),
        (hydra_old.get("sweeper") or {}).get("params"),
    )
    new = sweep_parameters(
        list(config.hydra.overrides.task), dict(config.hydra.sweeper.get("params") or {})
    )
    if old != new:
        raise ResumeRefused(
            f"launcher.resume=true: {sweep_dir} was made by another sweep; what differs:\n  "
            + "\n  ".join(_describe(old, new))
        )


def still_running(run_dir: Path, record: RunRecord | None = None) -> bool:
    """Whether the run in ``run_dir`` may still be going, asked of the launcher that ran it (a SLURM
    job in the queue whose launcher has exited counts); only its lock can tell for a launcher not
    installed here."""

    name = (
        record.launcher if record is not None and record.launcher else files.launcher_name(run_dir)
    )
    if name is None:
        return launch_alive(run_dir)
    try:
        launcher = get_launcher(name)
    except ValueError:
        return launch_alive(run_dir)
    return bool(launcher.is_live(run_dir)) or launcher.live_state(run_dir) is not None


def kept_outcome(run_dir: Path) -> RunOutcome | None:
    """The outcome of a point that must not run again (it ended ok, or still runs); None: run it."""
    if not run_dir.is_dir():
        return None
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    if record is not None and record.final and record.status is Status.OK:
        print(f"wf_launch: kept {run_dir}: it ended ok in the earlier sweep", flush=True)
        return RunOutcome.of(record, run_dir)
    if (
        (record is None or not record.final)
        and files.config_path(run_dir).exists()
        and still_running(run_dir, record)
    ):
        print(
            f"wf_launch: left {run_dir} running: it was started by the earlier sweep and has not "
            "ended",
            flush=True,
        )
        return RunOutcome(Status.SUBMITTED, run_dir, record=record)
    return None


def count_kept(sweep_dir: Path) -> tuple[int, int]:
    """(points of ``sweep_dir`` that ended ok, points with a directory)."""
    ok = total = 0
    for d in sweep_dir.iterdir() if sweep_dir.is_dir() else []:
        if d.is_dir() and not d.is_symlink() and d.name.isdigit():
            total += 1
            try:
                record = RunRecord.read(d)
            except RecordError:
                continue
            ok += bool(record is not None and record.final and record.status is Status.OK)
    return ok, total
