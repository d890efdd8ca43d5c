"""``python -m wf_launch.status DIR`` / ``wf-launch-status DIR``: a detached run's or sweep's state.

DIR is a run directory or a sweep directory (whose points are run directories). A run
directory's ``config.yaml`` names its launcher (``launcher.name``); runs of a
:class:`~wf_launch.launchers.DetachedLauncher` (``launcher=slurm``, or a third-party
one registered through the ``wf_launch.launchers`` entry points) are shown: the
scheduler's state and, once the run ended, its final ``result.json`` (written by the
launcher's ``status`` if no one wrote it yet). For a sweep the sweep report is
rewritten too. ``--cancel`` cancels every run still running and waits until it ended;
``--wait`` waits until every run has ended. Exit code: 0 while all are ok or running,
else the first non-zero exit code of an ended run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from . import attempts, rundir
from .launchers import DetachedLauncher, get_launcher
from .outcome import RunOutcome
from .record import RecordError, RunRecord, Status

FOLLOW_BACKLOG = 10
"""Lines of each console rank's log already written that ``--follow`` shows before new ones."""


def launcher_of(run_dir: Path) -> Any | None:
    """The detached launcher that ran ``run_dir`` (named in its ``config.yaml``), else None."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / rundir.CONFIG).read_text()) or {}
        name = (cfg.get("launcher") or {}).get("name")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    if not isinstance(name, str):
        return None
    try:
        launcher = get_launcher(name)
    except Exception:
        return None
    return launcher if isinstance(launcher, DetachedLauncher) else None


def find_runs(path: Path) -> tuple[dict[Path, Any], bool]:
    """The detached runs at ``path`` (run dir -> its launcher) and whether ``path`` is a sweep directory."""
    launcher = launcher_of(path)
    if launcher is not None:
        return {path: launcher}, False
    runs = {d: launcher for d in _subdirs(path) if (launcher := launcher_of(d)) is not None}
    return runs, True


def _subdirs(path: Path) -> list[Path]:
    """The directories in ``path``, a sweep's numbered points first and in order."""
    return sorted((d for d in path.iterdir() if d.is_dir()),
                  key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))


def _label(run_dir: Path, launcher: Any) -> str:
    """How the launcher names the run ('SLURM job 42'); '<name> run' when it has no ``status_label``."""
    label_of = getattr(launcher, "status_label", None)
    return label_of(run_dir) if callable(label_of) else f"{launcher.name} run"


def _print_run(run_dir: Path, launcher: Any, state: str, outcome: RunOutcome | None) -> None:
    details = getattr(launcher, "status_details", None)
    _print_state(run_dir, _label(run_dir, launcher), state, outcome, details(run_dir) if callable(details) else [])


def _print_state(run_dir: Path, label: str, state: str, outcome: RunOutcome | None, details: list[str]) -> None:
    verdict = f" -> {outcome.status} (exit {outcome.exit_code})" if outcome else ""
    print(f"{run_dir}: {label} {state}{verdict}")
    if outcome and outcome.exit_code:
        try:
            record = RunRecord.read(run_dir)
        except RecordError:
            record = None
        failure = (record.failure if record is not None else None) or {}
        print(f"  {failure.get('message') or outcome.summary}".rstrip())
        if failure.get("log"):
            print(f"  log: {failure['log']}")
    for line in details:
        print(f"  {line}")
    for line in _attempt_lines(run_dir):
        print(f"  {line}")


def _attempt_lines(run_dir: Path) -> list[str]:
    """The run's attempts (the final record's, or the markers of a run still going) when there were restarts."""
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    entries = record.attempts if record is not None and record.final and record.attempts else \
        attempts.collect(run_dir)
    return attempts.describe(entries) if len(entries) > 1 else []


def _console_ranks(run_dir: Path) -> list[int]:
    import yaml

    from .entrypoint import layout_of
    from .live import console_ranks

    config = yaml.safe_load((run_dir / rundir.CONFIG).read_text()) or {}
    return console_ranks(config, layout_of(config).world_size)


def _tail(run_dir: Path, lines: int) -> int:
    """``--tail N``: the last N lines of each console rank's log."""
    try:
        ranks = _console_ranks(run_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"wf_launch.status: {run_dir} is not a run directory ({exc})", file=sys.stderr)
        return 2
    for rank in ranks:
        path = rundir.rank_log(run_dir, rank)
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:] if lines else []
        except OSError:
            text = ["(no log yet)"]
        print(f"==> {path} <==")
        print("\n".join(text))
    return 0


def _final(run_dir: Path, strict: bool = False) -> RunOutcome | None:
    """The outcome in the run's final record; None without one (or, unless ``strict``, when it is unreadable)."""
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        if strict:
            raise
        return None
    return RunOutcome.of(record, run_dir) if record is not None and record.final else None


def _ended(run_dir: Path, launcher: Any | None, strict: bool = False) -> RunOutcome | None:
    """The run's outcome once it ended: from its detached launcher, else from a final record.

    A local run whose launcher is gone without writing a final record (killed with
    SIGKILL) has ended too, as 'unknown': following it would otherwise never end.
    ``strict``: an unreadable record raises :class:`RecordError` instead of reading as none.
    """
    if launcher is not None:
        return launcher.status(run_dir)[1]
    outcome = _final(run_dir, strict)
    if outcome is not None or rundir.launch_alive(run_dir):
        return outcome
    return _final(run_dir, strict) or RunOutcome(Status.UNKNOWN, run_dir,
                                         f"the launch of {run_dir} is gone and left no final record")


def _follow(run_dir: Path, timeout_s: float, backlog: int = FOLLOW_BACKLOG) -> int:
    """``--follow``: the live view of a run until it ended (or ``timeout_s`` passes); Ctrl-C only stops following.

    It shows the last ``backlog`` lines each console rank already wrote, then new ones.
    Exit code: the run's, once it ended; 0 when it still runs at the timeout; 130 after Ctrl-C.
    """
    from loguru import logger

    from .live import LiveView, final_line
    from .ranklog import setup_launcher_logging

    setup_launcher_logging(None)
    launcher = launcher_of(run_dir)
    try:
        view = LiveView([run_dir], write=logger.info, state_of=getattr(launcher, "live_state", None),
                        backlog=backlog)
    except (OSError, ValueError) as exc:
        print(f"wf_launch.status: {exc}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + timeout_s
    outcome = None
    try:
        while time.monotonic() < deadline:
            view.tick()
            outcome = _ended(run_dir, launcher)
            if outcome is not None:
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        view.close()
        logger.info(f"stopped following; the run goes on (cancel it: python -m wf_launch.status --cancel {run_dir})")
        return 130
    view.close()
    if outcome is None:
        logger.info(f"still running after {timeout_s:g} s; detaching")
        return 0
    logger.info(final_line(outcome))
    if outcome.exit_code and outcome.summary:
        print(outcome.summary, file=sys.stderr)
    return outcome.exit_code


def _stacks(run_dir: Path) -> int:
    """``--stacks``: signal the run's ranks to dump their stacks and print them grouped."""
    import yaml

    from .entrypoint import layout_of
    from .ranklog import rank_label
    from .stacks import live_autopsy

    try:
        config = yaml.safe_load((run_dir / rundir.CONFIG).read_text()) or {}
        layout = layout_of(config)
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as exc:
        print(f"wf_launch.status: {run_dir} is not a run directory ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    launcher = launcher_of(run_dir)
    signal_ranks = getattr(launcher, "signal_ranks", None)
    try:
        answered, lines = live_autopsy(run_dir, layout.world_size, lambda r: rank_label(r, layout.coords(r)),
                                       signal_ranks)
    except ValueError as exc:
        print(f"wf_launch.status: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if answered else 1


def main(argv: list[str] | None = None) -> int:
    """Show (and finalize) the state of the detached run or sweep at DIR; ``--cancel`` cancels it."""
    ap = argparse.ArgumentParser(prog="python -m wf_launch.status", description=main.__doc__)
    ap.add_argument("dir", type=Path, help="a run directory or a sweep directory")
    ap.add_argument("--cancel", action="store_true", help="cancel every run still running, wait for the end")
    ap.add_argument("--wait", action="store_true", help="wait until every run has ended")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds --wait / --cancel wait (default 600), and --follow follows (default: until the end)")
    ap.add_argument("--follow", action="store_true",
                    help="attach to a running run (local or detached): its state, console ranks' lines and "
                         "progress, live, until it ends")
    ap.add_argument("--tail", type=int, default=None, metavar="N",
                    help="print the last N lines of each console rank's log (with --follow: show the last N "
                         "lines already written, default 10, then follow)")
    ap.add_argument("--stacks", action="store_true",
                    help="dump every rank's Python stacks now and group them by where the ranks are "
                         "(a local or SLURM run that looks stuck)")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        print(f"wf_launch.status: {str(args.dir)!r} is not a directory", file=sys.stderr)
        return 2
    if args.stacks:
        return _stacks(args.dir.absolute())
    if args.tail is not None and args.tail < 0:
        print(f"wf_launch.status: --tail={args.tail} is not allowed: expected a number of lines >= 0",
              file=sys.stderr)
        return 2
    if args.follow:
        return _follow(args.dir.absolute(), math.inf if args.timeout is None else args.timeout,
                       FOLLOW_BACKLOG if args.tail is None else args.tail)
    if args.tail is not None:
        return _tail(args.dir.absolute(), args.tail)
    runs, is_sweep = find_runs(args.dir.absolute())
    if not runs:
        local = _local_runs(args.dir.absolute())
        if local and not (args.wait or args.cancel):
            return _show_local(local)
        why = ("its runs are local: their launcher waits for them (Ctrl-C there stops them)" if local else
               f"no {rundir.CONFIG} there or in its sub-directories")
        print(f"wf_launch.status: no detached run in {str(args.dir)!r} to wait for or cancel ({why})" if local else
              f"wf_launch.status: no run in {str(args.dir)!r} ({why})", file=sys.stderr)
        return 2
    try:
        return _show(args, runs, is_sweep)
    except ValueError as exc:  # e.g. a job id in a run's files that is not a scheduler's id
        print(f"wf_launch.status: {exc}", file=sys.stderr)
        return 2


def _local_runs(path: Path) -> list[Path]:
    """Run directories at ``path`` (itself, or the points of a sweep) that a launcher without status/cancel made."""
    candidates = [path] if (path / rundir.CONFIG).is_file() else \
        [d for d in _subdirs(path) if (d / rundir.CONFIG).is_file()]
    return [d for d in candidates if launcher_of(d) is None]


def _show_local(run_dirs: list[Path]) -> int:
    """State, failure and attempts of runs whose launcher waits for them (local): read from their records."""
    codes = []
    for run_dir in run_dirs:
        try:
            outcome = _ended(run_dir, None, strict=True)
        except RecordError as exc:
            print(f"{run_dir}: unreadable: {exc}")
            continue
        _print_state(run_dir, "local run", "running" if outcome is None else "ended", outcome, [])
        if outcome is not None and outcome.exit_code:
            codes.append(outcome.exit_code)
    return codes[0] if codes else 0


def _show(args: argparse.Namespace, runs: dict[Path, Any], is_sweep: bool) -> int:
    if args.cancel:
        for run_dir, launcher in runs.items():
            if launcher.cancel(run_dir) is not None:
                print(f"cancelling {_label(run_dir, launcher)} ({run_dir})", file=sys.stderr)
    deadline = time.monotonic() + (600 if args.timeout is None else args.timeout)
    unreadable: dict[Path, str] = {}
    while True:
        states = {}
        for run_dir, launcher in runs.items():
            try:
                states[run_dir] = launcher.status(run_dir)
            except RecordError as exc:  # one bad record never stops the others being shown
                unreadable[run_dir] = str(exc)
        if (not (args.wait or args.cancel) or all(o for _, o in states.values())
                or time.monotonic() > deadline):
            break
        time.sleep(0.5)
    for run_dir, (state, outcome) in states.items():
        _print_run(run_dir, runs[run_dir], state, outcome)
    for run_dir, why in unreadable.items():
        print(f"{run_dir}: unreadable: {why}")
    if is_sweep:
        from .sweep_report import collect_points, write_report

        written = write_report(args.dir, collect_points(args.dir))
        print(f"sweep report: {written['md']}")
    codes = [o.exit_code for _, o in states.values() if o and o.exit_code]
    return codes[0] if codes else 0


if __name__ == "__main__":
    sys.exit(main())
