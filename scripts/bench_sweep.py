"""Layout sweep cost: one ``python -m wf_launch -m`` over 6 layouts against 6 ``torchrun`` commands.

The sweep is ``engine.cp_size=1,2,4 engine.pp_size=1,2 task=noop`` (worlds 1, 2, 2, 4, 4, 8:
init gloo, one barrier, teardown per point, plus the sweep report); the baseline runs
``torchrun --standalone --nproc-per-node=N scripts/torchrun_equivalent.py`` once per layout, one
after another, as a shell loop over layouts would. Each round times both whole
(interpreter start-up included), alternating so machine noise hits both alike; the
ratio of medians is printed. Goal: <= 0.4x.

    python scripts/bench_sweep.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _bench import timed

HERE = Path(__file__).resolve().parent
CP, PP = (1, 2, 4), (1, 2)


def _sweep(work: str, tag: str) -> float:
    sweep_dir = Path(work) / tag
    wall = timed(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "-m",
            f"engine.cp_size={','.join(map(str, CP))}",
            f"engine.pp_size={','.join(map(str, PP))}",
            "task=noop",
            "engine.distributed_backend=gloo",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        work,
    )
    with open(sweep_dir / "sweep_summary.csv", newline="") as f:
        statuses = [row["status"] for row in csv.DictReader(f)]
    if statuses != ["ok"] * len(CP) * len(PP):
        raise SystemExit(f"sweep points did not all succeed: {statuses}")
    return wall


def _torchruns(torchrun: str, work: str) -> float:
    return sum(
        timed(
            [
                torchrun,
                "--standalone",
                f"--nproc-per-node={cp * pp}",
                str(HERE / "torchrun_equivalent.py"),
            ],
            work,
        )
        for cp in CP
        for pp in PP
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    work = tempfile.mkdtemp(prefix="wf_bench_sweep_")
    try:
        _sweep(work, "warm")
        a: list[float] = []
        b: list[float] = []
        for i in range(args.repeats):
            a.append(_sweep(work, f"sweep{i}"))
            b.append(_torchruns(torchrun, work))
            print(
                f"  round {i + 1}: wf_launch sweep {a[-1]:.2f}s  6x torchrun {b[-1]:.2f}s",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ma, mb = statistics.median(a), statistics.median(b)
    worlds = [cp * pp for cp in CP for pp in PP]
    print(
        f"\n6 layouts (cp={CP} x pp={PP}, worlds {worlds}), {args.repeats} alternating rounds, "
        f"{os.cpu_count()} cores, python {sys.version.split()[0]}"
    )
    print(f"wf_launch -m sweep, task=noop   median {ma:.2f}s  (min {min(a):.2f}s)")
    print(f"6x torchrun no-op              median {mb:.2f}s  (min {min(b):.2f}s)")
    print(f"ratio sweep / torchrun = {ma / mb:.2f}x  (goal <= 0.40x)")


if __name__ == "__main__":
    main()
