"""Launch overhead: ``python -m wf_launch ... task=noop`` against ``torchrun`` doing the same.

Both sides start 8 gloo ranks, run one barrier and tear down; each wall time is
the whole command, interpreter start-up included. Runs alternate (wf_launch,
torchrun, wf_launch, ...) so machine noise hits both alike; the ratio of medians
is printed. Goal: <= 0.30x torchrun (issue 28).

    python scripts/bench_launch.py [--repeats 5] [--cp 4 --pp 2]
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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    args = ap.parse_args()
    nproc = args.cp * args.pp
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    work = tempfile.mkdtemp(prefix="wf_bench_launch_")
    ours = [
        sys.executable,
        "-m",
        "wf_launch",
        f"engine.cp_size={args.cp}",
        f"engine.pp_size={args.pp}",
        "task=noop",
        "engine.distributed_backend=gloo",
    ]
    theirs = [
        torchrun,
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(HERE / "torchrun_equivalent.py"),
    ]
    env_note = f"{os.cpu_count()} cores, python {sys.version.split()[0]}"
    timed([*ours, f"hydra.run.dir={work}/warm"], work)
    timed(theirs, work)
    a: list[float] = []
    b: list[float] = []
    for i in range(args.repeats):
        a.append(timed([*ours, f"hydra.run.dir={work}/run{i}"], work))
        b.append(timed(theirs, work))
        print(f"  round {i + 1}: wf_launch {a[-1]:.2f}s  torchrun {b[-1]:.2f}s", flush=True)
    ma, mb = statistics.median(a), statistics.median(b)
    print(
        f"\n{nproc} ranks (cp={args.cp}, pp={args.pp}), {args.repeats} alternating rounds, "
        f"{env_note}"
    )
    print(f"wf_launch task=noop   median {ma:.2f}s  (min {min(a):.2f}s)")
    print(f"torchrun no-op        median {mb:.2f}s  (min {min(b):.2f}s)")
    print(f"ratio wf_launch / torchrun = {ma / mb:.2f}x  (goal <= 0.30x)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
