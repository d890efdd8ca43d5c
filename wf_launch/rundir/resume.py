"""How to continue a run that did not complete: the command, for the messages that should say so."""

from __future__ import annotations

import shlex
from pathlib import Path

from ..config.redact import redact_overrides
from . import files
from .checkpoints import complete_checkpoints
from .io import read_yaml
from .record import RecordError, RunRecord, Status

__all__ = ["RESUMABLE", "resume_command", "resume_hint"]

RESUMABLE = (Status.INTERRUPTED, Status.FAILED, Status.TIMEOUT, Status.CANCELLED, Status.UNKNOWN)
"""A run that ended so can go on with ``launcher.resume=true`` (from its newest checkpoint, if
any)."""
_OWN = ("launcher.resume", "launcher.overwrite", "hydra.run.dir")


def _overrides(run_dir: Path) -> list[str]:
    try:
        data = read_yaml(Path(run_dir) / files.OVERRIDES)
    except (OSError, ValueError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


def resume_command(run_dir: Path | str, overrides: list[str] | None = None) -> str:
    """``python -m wf_launch OVERRIDES launcher.resume=true hydra.run.dir=RUN_DIR``, quoted for a
    shell; a secret-looking value shows as ``***`` (give it again)."""
    given = _overrides(Path(run_dir)) if overrides is None else overrides
    kept = [o for o in given if o.lstrip("+~").split("=", 1)[0] not in _OWN]
    args = [*redact_overrides(kept), "launcher.resume=true", f"hydra.run.dir={Path(run_dir)}"]
    return "python -m wf_launch " + " ".join(shlex.quote(a) for a in args)


def resume_hint(
    run_dir: Path | str, overrides: list[str] | None = None, saved_in: Path | None = None
) -> str:
    """'continue it: python -m wf_launch ... launcher.resume=true ...' for a run that can go on,
    else ''. ``saved_in``: the run directory whose checkpoints it resumes from, when not
    ``run_dir`` (``ft=torchft``: the first replica group's)."""
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    status = record.status if record is not None else Status.UNKNOWN
    if status not in RESUMABLE:
        return ""

    found = complete_checkpoints(saved_in or run_dir)
    start = (
        f"from its checkpoint of step {found[-1][0]}"
        if found
        else "from the start (it saved no checkpoint)"
    )
    return f"continue it {start}: {resume_command(run_dir, overrides)}"
