"""RunOutcome: how a launch ended, and the run record it leaves."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import rundir

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


@dataclass
class RunOutcome:
    """Status ('ok', 'failed', 'interrupted', 'invalid', 'submitted', 'dry_run') and where it is recorded."""

    status: str
    exit_code: int
    run_dir: Path | None = None
    summary: str = ""
    result: dict[str, Any] | None = None


def finalize_result(run_dir: Path, plan_info: dict[str, Any], status: str, exit_code: int,
                    extra: dict[str, Any]) -> dict[str, Any]:
    """Merge launcher facts into ``result.json`` (written by rank 0 on success) and write it atomically."""
    path = run_dir / rundir.RESULT
    result = rundir.read_json(path) or {}
    if status != "ok":
        result.pop("finished_at", None)
    result.update(plan_info)
    result["status"] = status
    result["exit_code"] = exit_code
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = {**result[key], **value}
        else:
            result[key] = value
    result.setdefault("finished_at", time.time())
    rundir.atomic_write_json(path, result)
    return result


def success_summary(result: dict[str, Any]) -> str:
    """What rank 0's result asks the launcher to print: its ``summary`` or ``table``, if any."""
    rank0 = (result.get("results") or {}).get("0") or {}
    return str(rank0.get("summary") or rank0.get("table") or "")
