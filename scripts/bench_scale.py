"""Launch cost as the world grows: wf_launch ``task=noop`` against the bare elastic fork launcher and torchrun.

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

    python scripts/bench_scale.py [--sizes 8 16 32 64 128] [--repeats 3] [--chart docs/img/scale.png]
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

from _bench import timed

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--torchrun-max", type=int, default=32)
    ap.add_argument("--chart", type=Path, default=None)
    args = ap.parse_args()
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    work = tempfile.mkdtemp(prefix="wf_bench_scale_")
    env_note = f"{os.cpu_count()} cores, python {sys.version.split()[0]}"
    rows = []
    for n in args.sizes:
        ours = [sys.executable, "-m", "wf_launch", "task=noop", f"engine.dp_size={n}", "launcher.oversubscribe=true"]
        bare = [sys.executable, str(HERE / "elastic_fork_equivalent.py"), str(n)]
        theirs = [torchrun, "--standalone", f"--nproc-per-node={n}", str(HERE / "torchrun_equivalent.py")]
        a, b, c, init = [], [], [], []
        for i in range(args.repeats):
            run_dir = Path(work) / f"n{n}-{i}"
            a.append(timed([*ours, f"hydra.run.dir={run_dir}"], work))
            ranks = json.loads((run_dir / "result.json").read_text())["timings"]["ranks"]
            init += [r["init_s"] for r in ranks.values()]
            b.append(timed(bare, work))
            if n <= args.torchrun_max:
                c.append(timed(theirs, work))
            print(f"  {n:4d} ranks, round {i + 1}: wf_launch {a[-1]:.2f}s  elastic {b[-1]:.2f}s"
                  + (f"  torchrun {c[-1]:.2f}s" if c else ""), flush=True)
        row = {"ranks": n, "wf_launch": statistics.median(a), "elastic": statistics.median(b),
               "torchrun": statistics.median(c) if c else None, "init_median": statistics.median(init),
               "init_max": max(init)}
        rows.append(row)
    print(f"\n{args.repeats} alternating rounds per size, medians, {env_note}")
    print(f"{'ranks':>5}  {'wf_launch':>9}  {'elastic':>8}  {'torchrun':>8}  {'wf/elastic':>10}  {'wf/torchrun':>11}"
          f"  {'init_s med':>10}  {'init_s max':>10}")
    for r in rows:
        tr = f"{r['torchrun']:.2f}" if r["torchrun"] else "-"
        ratio_tr = f"{r['wf_launch'] / r['torchrun']:.2f}x" if r["torchrun"] else "-"
        print(f"{r['ranks']:>5}  {r['wf_launch']:>8.2f}s  {r['elastic']:>7.2f}s  {tr:>8}  "
              f"{r['wf_launch'] / r['elastic']:>9.2f}x  {ratio_tr:>11}  {r['init_median']:>9.3f}s  {r['init_max']:>9.3f}s")
    print("goals: wf_launch <= 0.10x torchrun at 32 ranks, <= 1.30x elastic at every size")
    if args.chart:
        _chart(rows, args.chart, env_note)
        print(f"chart: {args.chart}")
    shutil.rmtree(work, ignore_errors=True)


def _chart(rows: list[dict], path: Path, note: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    ranks = [r["ranks"] for r in rows]
    left.plot(ranks, [r["wf_launch"] for r in rows], "o-", label="wf_launch task=noop")
    left.plot(ranks, [r["elastic"] for r in rows], "s--", label="bare elastic_launch (fork), same groups")
    tr = [(r["ranks"], r["torchrun"]) for r in rows if r["torchrun"]]
    if tr:
        left.plot(*zip(*tr), "^:", label="torchrun --standalone")
    left.set(xscale="log", xlabel="ranks", ylabel="wall time of the command (s)", title="Launch to exit")
    left.set_xticks(ranks, [str(n) for n in ranks])
    left.minorticks_off()
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.plot(ranks, [r["init_median"] for r in rows], "o-", label="median rank")
    right.plot(ranks, [r["init_max"] for r in rows], "s--", label="slowest rank")
    right.set(xscale="log", xlabel="ranks", ylabel="dist_init per rank (s)", title="Group creation (all groups)")
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
