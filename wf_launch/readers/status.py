"""``python -m wf_launch.status DIR`` / ``wf-launch-status DIR``: a run's or a sweep's state, after
or while it runs.

DIR is a run directory or a sweep directory (whose points are run directories). A run
directory's ``config.yaml`` names its launcher; the launcher's hooks
(:class:`~wf_launch.launchers.LauncherHooks`) say the rest. Runs of a
:class:`~wf_launch.launchers.DetachedLauncher` (``launcher=slurm``, or a third-party
one registered through the ``wf_launch.launchers`` entry points) are asked for the
scheduler's state and, once the run ended, their final ``result.json`` (written by the
launcher's ``status`` if no one wrote it yet); other runs (``launcher=local``) are read
from their records. For a sweep the sweep report is rewritten too. ``--cancel`` cancels
every detached run still running and waits until it ended; ``--wait`` waits until every
run has ended. Exit code: 0 while all are ok or running, else the first non-zero exit
code of an ended run.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from ..config.layout import rank_label, run_layout
from ..launchers import DetachedLauncher, get_launcher
from ..observe.console import setup_launcher_logging
from ..observe.live import LiveView, console_ranks, final_line
from ..observe.stacks import live_autopsy, rank_ranges
from ..rundir import attempts, files
from ..rundir.claim import launch_alive
from ..rundir.io import open_regular
from ..rundir.outcome import RunOutcome
from ..rundir.record import RecordError, RunRecord, Status
from ..rundir.text import printable
from .sweep.points import collect_points
from .sweep.report import write_report

__all__ = ["FOLLOW_BACKLOG", "launcher_of", "main", "runs_at", "tail_lines"]

FOLLOW_BACKLOG = 10
"""Lines of each console rank's log already written that ``--follow`` shows before new ones."""

UNREADABLE_RUN = (ValueError, OSError)
"""What reading a malformed run raises (RecordError, UnreadableFile and read_job's errors are
ValueErrors):
that run is shown as unreadable and the others go on."""


def _say(line: str, multiline: bool = False, err: bool = False) -> None:
    """Print ``line`` with every control character a run's files may hold escaped (never raw to the
    terminal)."""
    print(printable(line, multiline), file=sys.stderr if err else sys.stdout)


def launcher_of(run_dir: Path) -> Any | None:
    """The launcher that ran ``run_dir`` (named in its ``config.yaml``), with its hooks; None when
    unknown."""
    name = files.launcher_name(run_dir)
    if not isinstance(name, str):
        return None
    try:
        return get_launcher(name)
    except Exception:
        return None


def _detached(launcher: Any) -> bool:
    return isinstance(launcher, DetachedLauncher)


def _subdirs(path: Path) -> list[Path]:
    """The directories in ``path``, a sweep's numbered points first and in order."""
    return sorted(
        (d for d in path.iterdir() if d.is_dir() and not d.is_symlink()),
        key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name),
    )


def runs_at(path: Path) -> tuple[dict[Path, Any], bool]:
    """The runs at ``path`` (run dir -> its launcher) and whether ``path`` is a sweep directory."""
    if files.config_path(path).is_file():
        launcher = launcher_of(path)
        return ({path: launcher} if launcher is not None else {}), False
    return {d: launcher for d in _subdirs(path) if (launcher := launcher_of(d)) is not None}, True


def _print_state(
    run_dir: Path, label: str, state: str, outcome: RunOutcome | None, details: list[str]
) -> None:
    """The run's state line, its failure and log, launcher details and attempts (every line made
    printable)."""
    verdict = f" -> {outcome.status} (exit {outcome.exit_code})" if outcome else ""
    lines = [f"{run_dir}: {label} {state}{verdict}"]
    if outcome and outcome.exit_code:
        try:
            record = RunRecord.read(run_dir)
        except RecordError:
            record = None
        failure = (record.failure if record is not None else None) or {}
        lines.append(f"  {failure.get('message') or outcome.summary}".rstrip())
        if failure.get("log"):
            lines.append(f"  log: {failure['log']}")
    lines += [f"  {line}" for line in (*details, *_attempt_lines(run_dir))]
    _say("\n".join(lines), multiline=True)


def _attempt_lines(run_dir: Path) -> list[str]:
    """The run's attempts (the final record's, or the markers of a run still going) when there were
    restarts, and a line for each attempt marker that cannot be read."""
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    problems: list[str] = []
    entries = (
        record.attempts
        if record is not None and record.final and record.attempts
        else attempts.collect(run_dir, problems)
    )
    return [*(attempts.describe(entries) if len(entries) > 1 else []), *problems]


_MAX_LINE = 16 << 10
"""The most of one log line ``--tail`` prints."""


def tail_lines(path: Path, lines: int, block: int = 1 << 16, max_bytes: int = 1 << 20) -> list[str]:
    """The last ``lines`` lines of the file at ``path``, read backwards from its end (a log may hold
    a GB); never more than ``max_bytes`` of it (a last line longer than that is shown cut)."""
    if lines <= 0:
        return []
    fd = open_regular(path)
    with open(fd, "rb") as f:
        start = end = f.seek(0, 2)
        blocks: list[bytes] = []
        newlines = 0
        while start > 0 and newlines <= lines and end - start < max_bytes:
            size = min(block, start)
            start -= size
            f.seek(start)
            blocks.append(f.read(size))
            newlines += blocks[-1].count(b"\n")
    text = b"".join(reversed(blocks)).decode(errors="replace").splitlines()
    return text[-lines:]


def _tail(run_dir: Path, lines: int) -> int:
    """``--tail N``: the last N lines of each console rank's log (ranks without a log yet are named
    once)."""

    try:
        config = files.read_config(run_dir, strict=True)
        ranks = console_ranks(config, run_layout(config).world_size)
    except (OSError, ValueError) as exc:
        _say(f"wf_launch.status: {run_dir} is not a run directory ({exc})", err=True)
        return 2
    logs = files.rank_files(run_dir, "log")
    for rank in sorted(set(ranks) & set(logs)):
        try:
            text = tail_lines(logs[rank], lines)
        except (OSError, ValueError) as exc:
            text = [f"(unreadable: {exc})"]
        _say(f"==> {logs[rank]} <==")
        for line in text:
            _say(
                line
                if len(line) <= _MAX_LINE
                else f"{line[:_MAX_LINE]}... ({len(line)} characters, cut)"
            )
    missing = sorted(set(ranks) - set(logs))
    if missing:
        _say(f"(no log yet: rank{'s' if len(missing) > 1 else ''} {rank_ranges(missing)})")
    return 0


def _final(run_dir: Path, strict: bool = False) -> RunOutcome | None:
    """The outcome in the run's final record; None without one (or, unless ``strict``, when it is
    unreadable)."""
    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        if strict:
            raise
        return None
    return RunOutcome.of(record, run_dir) if record is not None and record.final else None


def _ended(run_dir: Path, launcher: Any | None, strict: bool = False) -> RunOutcome | None:
    """The run's outcome once it ended: from its detached launcher, else from a final record.

    A run whose launcher is gone without writing a final record (killed with SIGKILL)
    has ended too, as 'unknown': following it would otherwise never end.
    ``strict``: an unreadable record raises :class:`RecordError` instead of reading as none.
    """
    if _detached(launcher):
        return launcher.status(run_dir)[1]
    outcome = _final(run_dir, strict)
    alive = launcher.is_live(run_dir) if launcher is not None else launch_alive(run_dir)
    if outcome is not None or alive:
        return outcome
    return _final(run_dir, strict) or RunOutcome(
        Status.UNKNOWN, run_dir, f"the launch of {run_dir} is gone and left no final record"
    )


def _follow(run_dir: Path, timeout_s: float, backlog: int = FOLLOW_BACKLOG) -> int:
    """``--follow``: the live view of a run until it ended (or ``timeout_s`` passes); Ctrl-C only
    stops following.

    It shows the last ``backlog`` lines each console rank already wrote, then new ones.
    Exit code: the run's, once it ended; 0 when it still runs at the timeout; 130 after Ctrl-C.
    """
    from loguru import logger

    setup_launcher_logging(None)
    launcher = launcher_of(run_dir)
    try:
        view = LiveView(
            [run_dir],
            write=logger.info,
            state_of=launcher.live_state if launcher else None,
            backlog=backlog,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        _say(
            f"wf_launch.status: {run_dir} is not a run directory ({type(exc).__name__}: {exc})",
            err=True,
        )
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
        logger.info(
            "stopped following; the run goes on (cancel it: python -m wf_launch.status --cancel "
            f"{run_dir})"
        )
        return 130
    except UNREADABLE_RUN as exc:
        view.close()
        _say(f"wf_launch.status: {run_dir}: unreadable: {exc}", err=True)
        return 2
    view.close()
    if outcome is None:
        logger.info(f"still running after {timeout_s:g} s; detaching")
        return 0
    logger.info(printable(final_line(outcome)))
    if outcome.exit_code and outcome.summary:
        _say(outcome.summary, multiline=True, err=True)
    return outcome.exit_code


def _stacks(run_dir: Path) -> int:
    """``--stacks``: signal the run's ranks (through its launcher) to dump their stacks, and print
    them grouped."""

    launcher = launcher_of(run_dir)
    try:
        layout = run_layout(files.read_config(run_dir, strict=True))
    except (OSError, ValueError) as exc:
        _say(
            f"wf_launch.status: {run_dir} is not a run directory ({type(exc).__name__}: {exc})",
            err=True,
        )
        return 2
    if launcher is None:
        _say(f"wf_launch.status: {run_dir}: its launcher is not known here", err=True)
        return 2
    try:
        answered, lines = live_autopsy(
            run_dir,
            layout.world_size,
            lambda r: rank_label(r, layout.coords(r)),
            launcher.signal_ranks,
        )
    except UNREADABLE_RUN as exc:
        _say(f"wf_launch.status: {exc}", err=True)
        return 2
    _say("\n".join(lines), multiline=True)
    return 0 if answered else 1


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m wf_launch.status", description=main.__doc__)
    ap.add_argument("dir", type=Path, help="a run directory or a sweep directory")
    ap.add_argument(
        "--cancel", action="store_true", help="cancel every run still running, wait for the end"
    )
    ap.add_argument("--wait", action="store_true", help="wait until every run has ended")
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds --wait / --cancel wait (default 600), and --follow follows (default: "
        "until the end)",
    )
    ap.add_argument(
        "--follow",
        action="store_true",
        help="attach to a running run (local or detached): its state, console ranks' lines and "
        "progress, live, until it ends",
    )
    ap.add_argument(
        "--tail",
        type=int,
        default=None,
        metavar="N",
        help="print the last N lines of each console rank's log (with --follow: show the last N "
        "lines already written, default 10, then follow)",
    )
    ap.add_argument(
        "--stacks",
        action="store_true",
        help="dump every rank's Python stacks now and group them by where the ranks are "
        "(a local or SLURM run that looks stuck)",
    )
    return ap


def _refusal(args: argparse.Namespace) -> str | None:
    """Why the command line cannot be served (exit 2), or None."""
    if not args.dir.is_dir():
        return f"{str(args.dir)!r} is not a directory"
    if args.tail is not None and args.tail < 0:
        return f"--tail={args.tail} is not allowed: expected a number of lines >= 0"
    return None


def _watch(args: argparse.Namespace, run_dir: Path) -> int | None:
    """``--stacks``, ``--follow`` or ``--tail``: that view's exit code; None for the state view."""
    if args.stacks:
        return _stacks(run_dir)
    if args.follow:
        timeout = math.inf if args.timeout is None else args.timeout
        return _follow(run_dir, timeout, FOLLOW_BACKLOG if args.tail is None else args.tail)
    if args.tail is not None:
        return _tail(run_dir, args.tail)
    return None


def main(argv: list[str] | None = None) -> int:
    """Show (and finalize) the state of the run or sweep at DIR; ``--cancel`` cancels it."""
    args = _parser().parse_args(argv)
    refused = _refusal(args)
    if refused is not None:
        print(f"wf_launch.status: {refused}", file=sys.stderr)
        return 2
    watched = _watch(args, args.dir.absolute())
    return _show_state(args) if watched is None else watched


def _show_state(args: argparse.Namespace) -> int:
    """The state of every run at DIR (detached ones asked of their scheduler), the sweep report
    rewritten; ``--cancel`` / ``--wait`` act on the detached runs."""
    runs, is_sweep = runs_at(args.dir.absolute())
    if not runs:
        print(
            f"wf_launch.status: no run in {str(args.dir)!r} (no {files.CONFIG} there or in its "
            "sub-directories)",
            file=sys.stderr,
        )
        return 2
    detached = {d: launcher for d, launcher in runs.items() if _detached(launcher)}
    if (args.wait or args.cancel) and not detached:
        print(
            f"wf_launch.status: no detached run in {str(args.dir)!r} to wait for or cancel (its "
            "runs are local: their launcher waits for them, Ctrl-C there stops them)",
            file=sys.stderr,
        )
        return 2
    codes = _show_detached(args, detached) if detached else []
    if not (args.wait or args.cancel):
        codes += _show_waited({d: launcher for d, launcher in runs.items() if d not in detached})
    if is_sweep:
        _say(f"sweep report: {write_report(args.dir, collect_points(args.dir))['md']}")
    return codes[0] if codes else 0


def _show_waited(runs: dict[Path, Any]) -> list[int]:
    """State, failure and attempts of runs whose launcher waits for them (local): read from their
    records."""
    codes = []
    for run_dir, launcher in runs.items():
        try:
            outcome = _ended(run_dir, launcher, strict=True)
            _print_state(
                run_dir,
                launcher.status_label(run_dir),
                "running" if outcome is None else "ended",
                outcome,
                launcher.status_details(run_dir),
            )
        except UNREADABLE_RUN as exc:
            _say(f"{run_dir}: unreadable: {exc}")
            continue
        if outcome is not None and outcome.exit_code:
            codes.append(outcome.exit_code)
    return codes


def _cancel(runs: dict[Path, Any]) -> list[int]:
    """Cancel each detached run; exit code 2 for each that cannot be (its record is malformed)."""
    refused = []
    for run_dir, launcher in runs.items():
        try:
            if launcher.cancel(run_dir) is not None:
                _say(f"cancelling {launcher.status_label(run_dir)} ({run_dir})", err=True)
        except UNREADABLE_RUN as exc:  # e.g. a job id that is not a scheduler's id: never passed on
            _say(f"wf_launch.status: cannot cancel {run_dir}: {exc}", err=True)
            refused.append(2)
    return refused


def _states(
    runs: dict[Path, Any], until_ended: bool, timeout_s: float
) -> tuple[dict[Path, Any], dict[Path, str]]:
    """({run: (state, outcome)}, {run: why unreadable}), asked of each scheduler; with
    ``until_ended``, asked again until every run has ended or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    unreadable: dict[Path, str] = {}
    while True:
        states = {}
        for run_dir, launcher in runs.items():
            try:
                states[run_dir] = launcher.status(run_dir)
            except UNREADABLE_RUN as exc:  # one bad record never stops the others being shown
                unreadable[run_dir] = str(exc)
        ended = all(o for _, o in states.values())
        if not until_ended or ended or time.monotonic() > deadline:
            return states, unreadable
        time.sleep(0.5)


def _show_detached(args: argparse.Namespace, runs: dict[Path, Any]) -> list[int]:
    """Ask each detached run's scheduler (``--cancel`` first; ``--wait`` until all ended); print
    them."""
    refused = _cancel(runs) if args.cancel else []
    timeout = 600 if args.timeout is None else args.timeout
    states, unreadable = _states(runs, bool(args.wait or args.cancel), timeout)
    for run_dir, (state, outcome) in states.items():
        launcher = runs[run_dir]
        try:
            details = launcher.status_details(run_dir)
            _print_state(run_dir, launcher.status_label(run_dir), state, outcome, details)
        except UNREADABLE_RUN as exc:
            unreadable[run_dir] = str(exc)
    for run_dir, why in unreadable.items():
        _say(f"{run_dir}: unreadable: {why}")
    return [*refused, *(o.exit_code for _, o in states.values() if o and o.exit_code)]


if __name__ == "__main__":
    sys.exit(main())
