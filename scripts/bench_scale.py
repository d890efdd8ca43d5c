"""Launch cost as the world grows: wf_launch ``task=noop`` against the bare elastic fork launcher
and torchrun.

For each world size (8, 16, 32, 64, 128 by default) the three commands run in
alternating rounds, each timed as a whole command (interpreter start-up
included):

* wf_launch: ``python -m wf_launch task=noop engine.dp_size=N``;
* elastic: ``scripts/elastic_fork_equivalent.py N`` (torch's ``elastic_launch`` with
  fork and the same group walk, no wf_launch: the floor wf_launch builds on);
* torchrun: ``torchrun --standalone --nproc-per-node=N scripts/torchrun_equivalent.py``
  (up to ``--torchrun-max`` ranks; about 35 s at 32 on 2 cores).

Also printed: each wf_launch rank's ``init_s`` (``dist_init``: default group plus
every named group) from ``result.json``, median and max, to show how group
creation grows with the world. Goals: wf_launch <= 0.1x torchrun at 32 ranks and
<= 1.3x elastic at every size. ``--chart PATH`` draws the growth curve.

A command still running after ``--stall-s`` seconds is killed and counted as a
stall (medians are over the runs that finished). The bare elastic launcher has
no fork gate, so it can stall at 64+ ranks (see "Start-up never stalls" in
docs/benchmarks.md); a wf_launch stall is a bug.

    python scripts/bench_scale.py [--sizes 8 16 32 64 128] [--repeats 3] [--chart
    docs/img/scale.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from _bench import timed_or_stalled

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torchrun-max", type=int, default=32)
    ap.add_argument("--chart", type=Path, default=None)
    ap.add_argument("--stall-s", type=float, default=300.0)
    ap.add_argument(
        "--redraw",
        type=Path,
        default=None,
        help="draw --chart again from the rows a run saved (JSON)",
    )
    args = ap.parse_args()
    if args.redraw:
        saved = json.loads(args.redraw.read_text())
        _chart(saved["rows"], args.chart or args.redraw.with_suffix(".png"), saved["note"])
        return
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    work = tempfile.mkdtemp(prefix="wf_bench_scale_")
    env_note = f"{os.cpu_count()} cores, python {sys.version.split()[0]}"
    rows = []
    for n in args.sizes:
        ours = [
            sys.executable,
            "-m",
            "wf_launch",
            "task=noop",
            f"engine.dp_size={n}",
            "launcher.oversubscribe=true",
        ]
        bare = [sys.executable, str(HERE / "elastic_fork_equivalent.py"), str(n)]
        theirs = [
            torchrun,
            "--standalone",
            f"--nproc-per-node={n}",
            str(HERE / "torchrun_equivalent.py"),
        ]
        a, b, c, init = [], [], [], []
        for i in range(args.repeats):
            run_dir = Path(work) / f"n{n}-{i}"
            a.append(timed_or_stalled([*ours, f"hydra.run.dir={run_dir}"], work, args.stall_s))
            if a[-1] is not None:
                ranks = json.loads((run_dir / "result.json").read_text())["timings"]["ranks"]
                init += [r["init_s"] for r in ranks.values()]
            b.append(timed_or_stalled(bare, work, args.stall_s))
            if n <= args.torchrun_max:
                c.append(timed_or_stalled(theirs, work, args.stall_s))
            print(
                f"  {n:4d} ranks, round {i + 1}: wf_launch {_secs(a[-1])}  elastic {_secs(b[-1])}"
                + (f"  torchrun {_secs(c[-1])}" if c else ""),
                flush=True,
            )
        row = {
            "ranks": n,
            "wf_launch": _median(a),
            "elastic": _median(b),
            "torchrun": _median(c),
            "stalls": {
                k: v.count(None)
                for k, v in (("wf_launch", a), ("elastic", b), ("torchrun", c))
                if None in v
            },
            "init_median": statistics.median(init) if init else None,
            "init_max": max(init, default=None),
        }
        rows.append(row)
    print(f"\n{args.repeats} alternating rounds per size, medians, {env_note}")
    print(
        f"{'ranks':>5}  {'wf_launch':>9}  {'elastic':>8}  {'torchrun':>8}  {'wf/elastic':>10}  "
        f"{'wf/torchrun':>11}"
        f"  {'init_s med':>10}  {'init_s max':>10}  stalled (of {args.repeats}, killed at "
        f"{args.stall_s:.0f} s)"
    )
    for r in rows:
        stalls = ", ".join(f"{k} {v}" for k, v in r["stalls"].items()) or "-"
        print(
            f"{r['ranks']:>5}  {_secs(r['wf_launch']):>9}  {_secs(r['elastic']):>8}  "
            f"{_secs(r['torchrun']):>8}  "
            f"{_ratio(r['wf_launch'], r['elastic']):>10}  "
            f"{_ratio(r['wf_launch'], r['torchrun']):>11}  "
            f"{_secs(r['init_median'], 3):>10}  {_secs(r['init_max'], 3):>10}  {stalls}"
        )
    print("goals: wf_launch <= 0.10x torchrun at 32 ranks, <= 1.30x elastic at every size")
    if args.chart:
        _chart(rows, args.chart, env_note)
        args.chart.with_suffix(".json").write_text(
            json.dumps({"note": env_note, "rows": rows}, indent=1) + "\n"
        )
        print(
            f"chart: {args.chart} (rows: {args.chart.with_suffix('.json')}, --redraw draws it "
            "again)"
        )
    shutil.rmtree(work, ignore_errors=True)


def _median(values: list[float | None]) -> float | None:
    done = [v for v in values if v is not None]
    return statistics.median(done) if done else None


def _secs(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}s"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}x"


def _line(left: object, rows: list[dict], key: str, style: str, label: str) -> None:
    points = [(r["ranks"], r[key]) for r in rows if r[key] is not None]
    if points:
        left.plot(*zip(*points), style, label=label)


def _chart(rows: list[dict], path: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ranks = [r["ranks"] for r in rows]
    _line(left, rows, "wf_launch", "o-", "wf_launch task=noop")
    _line(left, rows, "elastic", "s--", "bare elastic_launch (fork), same groups")
    _line(left, rows, "torchrun", "^:", "torchrun --standalone")
    left.set(
        xscale="log", xlabel="ranks", ylabel="wall time of the command (s)", title="Launch to exit"
    )
    left.set_xticks(ranks, [str(n) for n in ranks])
    left.minorticks_off()
    left.grid(alpha=0.3)
    left.legend(fontsize=8, loc="upper left")
    _line(right, rows, "init_median", "o-", "median rank")
    _line(right, rows, "init_max", "s--", "slowest rank")
    right.set(
        xscale="log",
        xlabel="ranks",
        ylabel="dist_init per rank (s)",
        title="Group creation (all groups)",
    )
    right.set_xticks(ranks, [str(n) for n in ranks])
    right.minorticks_off()
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(f"wf_launch scale ({note})", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
