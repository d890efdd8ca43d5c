"""``tracking=wandb``: one W&B run per wf_launch run, ``id`` = the run id, ``resume="allow"``.

Every attempt (restart, requeue, ``launcher.resume``) calls ``wandb.init`` with the same id, so
W&B continues one run. Offline (``WANDB_MODE=offline`` or ``tracking.wandb.mode=offline``) each
attempt writes its own ``RUN_DIR/wandb/offline-run-*-ID`` directory, all of the same run id
(``wandb sync`` uploads them into that run, oldest first). The last step an earlier attempt left
is read back: from the server when online (the resumed run's step), from the earlier attempts'
offline files with W&B's own reader (``wandb leet inspect``) when offline. The config goes in as
W&B's config; the attempt's end as ``summary["wf_launch/status"]``, the exit code (0 for
``ok``) and, for a stopped attempt, W&B's "preempting" mark. With ``tracking.all_ranks`` rank R
(> 0) writes its own run ``ID-rankR``, all grouped under the run id.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

from ...rundir import files
from .base import Tracker

__all__ = ["WandbTracker", "offline_last_step"]


class WandbTracker(Tracker):
    """One W&B run per tracked rank."""

    name: ClassVar[str] = "wandb"

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.run: Any = None

    @property
    def wandb_id(self) -> str:
        s = self.settings
        return f"{s.run_id}-rank{s.rank}" if s.tagged and s.rank else s.run_id

    def open(self) -> int | None:
        import wandb

        s, section = self.settings, self.settings.section
        quiet = wandb.Settings(
            console="off", silent=True, x_disable_stats=True, disable_git=True, disable_code=True
        )
        self.run = wandb.init(
            project=section.get("project") or "wf_launch",
            entity=section.get("entity"),
            mode=section.get("mode"),
            name=section.get("name") or s.run_name,
            group=section.get("group") or (s.run_id if s.tagged else None),
            tags=list(section.get("tags") or []) or None,
            id=self.wandb_id,
            resume="allow",
            dir=str(s.run_dir),
            config=s.config,
            allow_val_change=True,
            settings=quiet,
        )
        if self.run.settings.mode == "offline":
            current = Path(self.run.dir).parent
            try:
                return offline_last_step(files.wandb_dir(s.run_dir), self.wandb_id, exclude=current)
            except (OSError, ValueError, RuntimeError, subprocess.SubprocessError):
                return (
                    s.last_step
                )  # a W&B without `leet inspect`: the step recorded after the last log
        return (
            self.run.step - 1 if getattr(self.run, "resumed", False) and self.run.step > 0 else None
        )

    def log(self, points: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in points:
            self.run.log(values, step=step)

    def close(self, status: str) -> None:
        if self.run is None:
            return
        self.run.summary["wf_launch/status"] = status
        if status == "interrupted":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == "ok" else 1)
        self.run = None

    def run_ref(self) -> str | None:
        return self.wandb_id


def offline_last_step(wandb_dir: Path, wandb_id: str, exclude: Path | None = None) -> int | None:
    """The last history step in the offline runs of ``wandb_id`` under ``wandb_dir``, read with
    W&B's own reader (``wandb leet inspect --summary --json``); None when there are none."""
    steps = []
    for run in sorted(wandb_dir.glob(f"offline-run-*-{wandb_id}")):
        if exclude is not None and run.resolve() == exclude.resolve():
            continue
        out = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(run)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0:
            raise RuntimeError(f"wandb leet inspect {run}: {out.stderr.strip()[-300:]}")
        summary = json.loads(out.stdout)
        history = summary.get("summary") or {}
        step = history.get("_step", summary.get("step"))
        if isinstance(step, int) and ("_step" in history):
            steps.append(step)
    return max(steps) if steps else None
