"""``python -m wf_launch.status DIR`` / ``wf-launch-status DIR``: a SLURM run's or sweep's state.

DIR is a run directory (holding ``slurm_job.json``) or a sweep directory (whose points
hold one). For each run: the job's state from ``sacct`` and each rank's outcome; a job
that has ended gets its final ``result.json`` (cancelled, timeout, failed with the root
cause) if no one wrote it yet. For a sweep the sweep report is rewritten too.
``--cancel`` cancels every job still running and waits until SLURM has ended it;
``--wait`` waits until every job has ended. Exit code: 0 while all are ok or running,
else the first non-zero exit code of an ended run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from . import rundir
from .launchers import slurm


def find_runs(path: Path) -> tuple[list[Path], bool]:
    """The SLURM run directories at ``path`` and whether ``path`` is a sweep directory."""
    if (path / slurm.JOB_FILE).is_file():
        return [path], False
    runs = sorted((d for d in path.iterdir() if (d / slurm.JOB_FILE).is_file()),
                  key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))
    return runs, True


def refresh(run_dir: Path) -> tuple[str, slurm.RunOutcome | None]:
    """The job's state now, and its final outcome once it has ended (finalizing ``result.json``)."""
    job = slurm.read_job(run_dir) or {}
    state = slurm.job_state(job["job_id"])
    if slurm.is_terminal(state) and not slurm.in_queue(job["job_id"]):
        return state, slurm.finalize(run_dir, state)
    return state, None


def _print_run(run_dir: Path, state: str, outcome: slurm.RunOutcome | None) -> None:
    job = slurm.read_job(run_dir) or {}
    verdict = f" -> {outcome.status} (exit {outcome.exit_code})" if outcome else ""
    print(f"{run_dir}: SLURM job {job.get('job_id')} {state}{verdict}")
    if outcome and outcome.exit_code:
        result = rundir.read_json(run_dir / rundir.RESULT) or {}
        failure = result.get("failure") or {}
        print(f"  {failure.get('message') or outcome.summary}".rstrip())
        if failure.get("log"):
            print(f"  log: {failure['log']}")
    for rank, text in slurm.rank_outcomes(run_dir).items():
        print(f"  rank {rank}: {text}")


def main(argv: list[str] | None = None) -> int:
    """Show (and finalize) the state of the SLURM run or sweep at DIR; ``--cancel`` cancels it."""
    ap = argparse.ArgumentParser(prog="python -m wf_launch.status", description=main.__doc__)
    ap.add_argument("dir", type=Path, help="a run directory (with slurm_job.json) or a sweep directory")
    ap.add_argument("--cancel", action="store_true", help="scancel every job still running, wait for the end")
    ap.add_argument("--wait", action="store_true", help="wait until every job has ended")
    ap.add_argument("--timeout", type=float, default=600, help="seconds --wait / --cancel wait (default 600)")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        print(f"wf_launch.status: {str(args.dir)!r} is not a directory", file=sys.stderr)
        return 2
    runs, is_sweep = find_runs(args.dir.absolute())
    if not runs:
        print(f"wf_launch.status: no SLURM run in {str(args.dir)!r} (no {slurm.JOB_FILE} there or in its "
              "sub-directories)", file=sys.stderr)
        return 2
    if args.cancel:
        for run_dir in runs:
            job_id = slurm.cancel(run_dir)
            print(f"cancelling SLURM job {job_id} ({run_dir})", file=sys.stderr)
    deadline = time.monotonic() + args.timeout
    while True:
        states = {run_dir: refresh(run_dir) for run_dir in runs}
        if not (args.wait or args.cancel) or all(o for _, o in states.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for run_dir, (state, outcome) in states.items():
        _print_run(run_dir, state, outcome)
    if is_sweep:
        from .sweep_report import collect_points, write_report

        written = write_report(args.dir, collect_points(args.dir))
        print(f"sweep report: {written['md']}")
    codes = [o.exit_code for _, o in states.values() if o and o.exit_code]
    return codes[0] if codes else 0


if __name__ == "__main__":
    sys.exit(main())
