"""A torchrun script's launch: ``python -m wf_launch.run --nproc-per-node N SCRIPT`` against
``torchrun`` on it.

Both sides run the same unmodified script (default ``scripts/torchrun_equivalent.py``: init
gloo, one barrier, destroy) on N ranks; each wall time is the whole command, interpreter
start-up included. Runs alternate (wf_launch.run, torchrun, wf_launch.run, ...) so machine
noise hits both alike; the ratio of medians is printed. Goal: <= 0.4x torchrun.

    python scripts/bench_script_launch.py [--nproc 8] [--repeats 5] [--script PATH] [--fresh]
    [--with-noop]

``--fresh`` measures ``task.fresh_interpreter=true`` (every rank in a new interpreter) instead.
``--with-noop`` adds ``python -m wf_launch task=noop engine.dp_size=N`` to every round (a registered
task doing the same: the launch overhead of scripts against that of tasks, same baseline).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _bench import timed

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--script", type=Path, default=HERE / "torchrun_equivalent.py")
    ap.add_argument("--fresh", action="store_true", help="task.fresh_interpreter=true")
    ap.add_argument(
        "--with-noop", action="store_true", help="also time task=noop on the same ranks"
    )
    ap.add_argument("script_args", nargs="*", help="the script's arguments (after --)")
    args = ap.parse_args()
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    work = tempfile.mkdtemp(prefix="wf_bench_script_")
    script = str(args.script.resolve())
    extra = ["--set", "task.fresh_interpreter=true"] if args.fresh else []
    ours = [sys.executable, "-m", "wf_launch.run", f"--nproc-per-node={args.nproc}", *extra]
    theirs = [torchrun, "--standalone", f"--nproc-per-node={args.nproc}", script, *args.script_args]
    timed([*ours, "--run-dir", f"{work}/warm", script, *args.script_args], work)
    timed(theirs, work)
    noop = [sys.executable, "-m", "wf_launch", "task=noop", f"engine.dp_size={args.nproc}"]
    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    for i in range(args.repeats):
        a.append(timed([*ours, "--run-dir", f"{work}/run{i}", script, *args.script_args], work))
        b.append(timed(theirs, work))
        if args.with_noop:
            c.append(timed([*noop, f"hydra.run.dir={work}/noop{i}"], work))
        print(
            f"  round {i + 1}: wf_launch.run {a[-1]:.2f}s  torchrun {b[-1]:.2f}s"
            + (f"  task=noop {c[-1]:.2f}s" if c else ""),
            flush=True,
        )
    ma, mb = statistics.median(a), statistics.median(b)
    how = "fresh interpreter per rank" if args.fresh else "forked ranks"
    print(
        f"\n{args.nproc} ranks, {Path(script).name}, {args.repeats} alternating rounds, {how}, "
        f"{os.cpu_count()} cores, python {sys.version.split()[0]}"
    )
    print(f"python -m wf_launch.run  median {ma:.2f}s  (min {min(a):.2f}s)")
    print(f"torchrun                 median {mb:.2f}s  (min {min(b):.2f}s)")
    if c:
        print(
            f"task=noop (reference)    median {statistics.median(c):.2f}s  (min {min(c):.2f}s): "
            f"{statistics.median(c) / mb:.2f}x torchrun"
        )
    print(f"ratio wf_launch.run / torchrun = {ma / mb:.2f}x  (goal <= 0.40x)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
