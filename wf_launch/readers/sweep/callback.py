"""The Hydra callback of ``-m`` sweeps (``hydra.callbacks.sweep_report`` in
``wf_launch/conf/config.yaml``)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from ...launchers.base import run_dir_mode
from ...launchers.sweep_resume import ResumeRefused, check_same_sweep, count_kept
from ...rundir import files
from ...rundir.claim import OWNER_ONLY, make_private, private_umask, remove_made_folders
from ...rundir.io import MAX_RECORD_BYTES, atomic_write_text, read_text
from ...rundir.outcome import RunOutcome
from ...rundir.record import RunRecord, Status
from .points import DEFAULT_METRIC, collect_points
from .report import status_line, sweep_exit_code, write_report

__all__ = ["SweepReport"]


def _mode(value: Any) -> int:
    """``launcher.run_dir_mode`` as a mode for the sweep directory; owner-only unless it is a valid
    one."""

    try:
        return run_dir_mode(value)
    except ValueError:
        return 0o700


def _read_plan(sweep_dir: Path) -> str | None:
    try:
        return read_text(sweep_dir / files.SWEEP_PLAN, MAX_RECORD_BYTES)
    except (OSError, ValueError):
        return None


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency; keep the offline reader importable
    _HydraCallback = object  # type: ignore[assignment,misc]


class SweepReport(_HydraCallback):  # type: ignore[misc,valid-type]
    """Hydra callback: keep every point's failure in the report, write the report, set the exit
    code.

    ``metric``: the charted metric. ``exit_nonzero``: leave the sweep with
    :func:`sweep_exit_code` once the report is written. A point whose launch
    raised is recorded as 'failed' in its ``result.json`` and the sweep goes on
    (Hydra would otherwise abort before reporting). An interrupted point stops the
    sweep: the report is written (remaining points ``not_run``) and the process
    leaves with the point's exit code (128 + signal).
    """

    def __init__(
        self, metric: str = DEFAULT_METRIC, exit_nonzero: bool = True, chart: bool = True
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ValueError(
                f"hydra.callbacks.sweep_report.metric={metric!r} is not allowed: "
                "expected the name of a numeric result field, e.g. tokens_per_s or wall_s"
            )
        self.metric = metric
        self.exit_nonzero = bool(exit_nonzero)
        self.chart = bool(chart)
        self._sweep_dir: Path | None = None
        self._dry_run: tuple[Path, float, str | None] | None = None

    @staticmethod
    def _remove_dry_run(sweep_dir: Path, started: float, kept_plan: str | None = None) -> None:
        """A dry-run sweep leaves nothing: Hydra's ``multirun.yaml`` and the folders made for it go
        (a resumed sweep's ``multirun.yaml`` is put back as it was: it is what a later resume is
        checked against)."""

        plan = sweep_dir / files.SWEEP_PLAN
        try:
            if kept_plan is not None:
                atomic_write_text(plan, kept_plan)
            elif plan.stat().st_mtime >= started - 0.05:
                plan.unlink()
        except OSError:
            pass
        remove_made_folders(sweep_dir, started)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """A sweep directory holds one sweep: refuse one that holds points already (exit 2).

        With ``launcher.resume=true`` the sweep continues the one in the directory (only
        the sweep that made it may: :mod:`.resume`). With ``launcher.overwrite=true`` the
        earlier sweep is moved aside into a sibling ``NAME.replaced-TIMESTAMP`` directory
        (made owner-only) first, so its points never mix into this sweep's report. The
        sweep directory is made before Hydra writes into it, with ``launcher.run_dir_mode``
        (0700): a SLURM sweep keeps the pickles submitit runs and the code snapshot there. A
        dry run (``launcher.dry_run=true``) moves and writes nothing, and leaves no folder.
        """
        from omegaconf import OmegaConf

        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        old = (
            sorted(
                d.name
                for d in sweep_dir.iterdir()
                if d.is_dir()
                and not d.is_symlink()
                and any((d / m).exists() for m in files.MARKERS)
            )
            if sweep_dir.is_dir()
            else []
        )
        resume = OmegaConf.select(config, "launcher.resume", default=False) in (True, "auto")
        if resume:
            self._resume(config, sweep_dir, old)
        elif old and OmegaConf.select(config, "launcher.overwrite", default=False) is not True:
            print(
                f"wf_launch: sweep directory {sweep_dir} already holds a sweep (points "
                f"{', '.join(old[:8])}"
                f"{' ...' if len(old) > 8 else ''}); choose another hydra.sweep.dir, or pass "
                "launcher.overwrite=true to move that sweep aside",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(2)
        if OmegaConf.select(config, "launcher.dry_run", default=False) is True:
            self._dry_run = (sweep_dir, time.time(), _read_plan(sweep_dir) if resume else None)
            return
        private_umask()
        if old and not resume:
            aside = sweep_dir.with_name(
                f"{sweep_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            )
            sweep_dir.rename(aside)
            os.chmod(aside, OWNER_ONLY)
        make_private(
            sweep_dir, _mode(OmegaConf.select(config, "launcher.run_dir_mode", default=None))
        )
        self._sweep_dir = sweep_dir

    @staticmethod
    def _resume(config: Any, sweep_dir: Path, old: list[str]) -> None:
        """``launcher.resume=true``: check that this sweep made ``sweep_dir`` (else exit 2), and say
        what will run."""
        from omegaconf import OmegaConf

        if OmegaConf.select(config, "launcher.overwrite", default=False) is True:
            print(
                "wf_launch: launcher.overwrite=true and launcher.resume=true: choose one "
                "(overwrite moves the sweep "
                "aside, resume continues it)",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(2)
        if not old:
            print(
                f"wf_launch: launcher.resume=true: {sweep_dir} holds no sweep yet; every point "
                "runs",
                file=sys.stderr,
                flush=True,
            )
            return
        try:
            check_same_sweep(sweep_dir, config)
        except ResumeRefused as exc:
            print(f"wf_launch: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        ok, total = count_kept(sweep_dir)
        print(
            f"wf_launch: resuming the sweep in {sweep_dir}: {ok} of {total} started point(s) "
            "ended ok and are "
            "kept; the others, and the points never started, run",
            file=sys.stderr,
            flush=True,
        )

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if self._sweep_dir is None:
            return
        job_dir = Path(str(config.hydra.runtime.output_dir))
        if job_return.status == JobStatus.FAILED:
            self._record_launch_error(job_dir, job_return)
            return
        outcome = job_return.return_value
        if getattr(outcome, "status", None) == Status.INTERRUPTED:
            self.report()
            raise SystemExit(int(getattr(outcome, "exit_code", 130)) or 130)

    def _record_launch_error(self, job_dir: Path, job_return: Any) -> None:
        """The launch itself raised: record it as a failed point and let the sweep go on.

        A signal that reached the launch before it could stop its ranks itself (torch elastic's
        handler raises ``SignalException`` from wherever the process is) is an interruption, not a
        failure: the point is recorded as interrupted and the sweep stops, as when the signal
        reaches a running point.
        """
        import signal
        import traceback

        from hydra.core.utils import JobStatus

        try:
            job_return.return_value  # noqa: B018 - re-raises what the launch raised
            return
        except BaseException as raised:
            exc = raised
        sigval = getattr(exc, "sigval", None)
        if isinstance(sigval, int):
            name = signal.Signals(sigval).name
            RunRecord.finalize(
                job_dir,
                Status.INTERRUPTED,
                signal_name=name,
                run_dir=str(job_dir),
                overrides=list(job_return.overrides or []),
                failure={
                    "cause": "interrupt",
                    "type": "Signal",
                    "message": f"interrupted by {name}",
                },
            )
            print(
                f"wf_launch: interrupted by {name} while the point started",
                file=sys.stderr,
                flush=True,
            )
            self.report()
            raise SystemExit(128 + int(sigval))
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        message = f"launcher error: {type(exc).__name__}: {exc}"
        RunRecord.finalize(
            job_dir,
            Status.FAILED,
            overrides=list(job_return.overrides or []),
            run_dir=str(job_dir),
            failure={"cause": "launcher_error", "type": type(exc).__name__, "message": str(exc)},
        )
        print(f"wf_launch: {message}", file=sys.stderr, flush=True)
        job_return.status = JobStatus.COMPLETED
        job_return.return_value = RunOutcome(Status.FAILED, job_dir, message)

    def report(self) -> list[dict[str, Any]]:
        """Write the report for this sweep; returns its points."""
        assert self._sweep_dir is not None
        points = collect_points(self._sweep_dir)
        written = write_report(self._sweep_dir, points, self.metric, chart=self.chart)
        print(status_line(points, written), file=sys.stderr, flush=True)
        return points

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        if self._dry_run is not None:
            self._remove_dry_run(*self._dry_run)
        if self._sweep_dir is None:
            return
        try:
            code = sweep_exit_code(self.report())
        except Exception as exc:
            print(
                f"wf_launch: writing the sweep report in {self._sweep_dir} failed: "
                f"{type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            code = 1
        if code and self.exit_nonzero:
            raise SystemExit(code)
