"""The layout tuner against an exhaustive sweep: does it find the fastest layout, and in how much of
the time?

For each world size, ``task=train`` with ``--also task.micro_batches=1,2``:

- the *exhaustive sweep*: one ``python -m wf_launch -m`` over every valid layout (the tuner's own
pruning by
  validation decides which), each point run to the full length (``task.steps``); each point's steady
  ``tokens_per_s`` is measured from its ``ctx.progress`` timestamps exactly as the tuner measures a
  trial
  (the median over its steps after the warm-up);
- the *tunes*: ``python -m wf_launch.tune task=train world_size=W task.steps=F --also
task.micro_batches=1,2``
  with its default settings.

Rounds alternate (an exhaustive sweep, then ``--tunes-per-round`` tunes, ...), so machine noise hits
both alike. A tune *agrees* when its winner is the exhaustive sweeps' best layout (steady
tokens_per_s, median over the sweeps) or within 5% of its throughput. Printed per world size: the
agreement (goal: >= 9 of 10 tunes) and the time ratio, the median tune's wall time over the median
exhaustive sweep's (goal: <= 0.40x). Every run's directory and ``bench_tune.json`` stay in
``--dir``.

    python scripts/bench_tune.py [--worlds 8,4] [--tunes-per-round 5] [--rounds 2] [--steps
    8:80,4:150]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ALSO = ("task.micro_batches", ["1", "2"])
WARMUP = 2


def _run(cmd: list[str], cwd: Path, log: Path) -> float:
    """Wall seconds of ``cmd`` (its output to ``log``); exits if it fails."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def _valid_points(world: int, overrides: list[str]) -> list[dict[str, Any]]:
    """The points the tuner would measure (validation prunes the rest), as its trial dicts."""
    from wf_launch.drivers.tune.prune import VALID, compose, prune
    from wf_launch.drivers.tune.space import build_space

    points = build_space(world, [ALSO])
    combos = sorted({p.also for p in points})
    configs = dict(
        zip(combos, compose([[*overrides, *(f"{k}={v}" for k, v in c)] for c in combos]))
    )
    return [v.point.to_json() for v in prune(points, configs, None) if v.status == VALID]


def _key(point: dict[str, Any]) -> str:
    return point["label"]


def exhaustive(
    world: int, steps: int, overrides: list[str], points: list[dict[str, Any]], d: Path
) -> dict:
    """One sweep over every valid point at full length: its wall time and each point's steady
    tokens_per_s."""
    from wf_launch.drivers.tune.measure import measure_point
    from wf_launch.drivers.tune.rounds import job_dirs, sweep_argv, write_trial_configs
    from wf_launch.rank.progress import STEPS_ENV
    from wf_launch.rundir import files

    write_trial_configs(d, points)
    argv = sweep_argv(d, 0, [p["id"] for p in points], steps, overrides, "steps")
    os.environ[STEPS_ENV] = "1"
    try:
        wall = _run(argv, d.parent, d / "sweep.log")
    finally:
        os.environ.pop(STEPS_ENV, None)
    dirs = job_dirs(files.tune_round_dir(d, 0))
    values = {}
    for p in points:
        m = measure_point(dirs[p["id"]], p["id"], 0, "tokens_per_s", WARMUP, steps)
        values[_key(p)] = m.value if m.ok else None
    return {"wall_s": wall, "tokens_per_s": values}


def tune(world: int, steps: int, overrides: list[str], d: Path) -> dict:
    """One tune with the default settings: its wall time and its winner."""
    cmd = [
        sys.executable,
        "-m",
        "wf_launch.tune",
        *overrides,
        f"world_size={world}",
        f"task.steps={steps}",
        "--also",
        f"{ALSO[0]}={','.join(ALSO[1])}",
        "--dir",
        str(d),
    ]
    wall = _run(cmd, d.parent, d.parent / f"{d.name}.log")
    state = json.loads((d / "tune.json").read_text())
    winner = next(p for p in state["space"] if p["id"] == state["winner"])
    return {
        "wall_s": wall,
        "winner": _key(winner),
        "trials": sum(len(r["trials"]) for r in state["rounds"]),
        "rounds": [len(r["trials"]) for r in state["rounds"]],
    }


def _verdict(world: int, steps: int, sweeps: list[dict], tunes: list[dict]) -> dict:
    layouts = sweeps[0]["tokens_per_s"].keys()
    steady = {
        k: statistics.median(
            [s["tokens_per_s"][k] for s in sweeps if s["tokens_per_s"].get(k)] or [0.0]
        )
        for k in layouts
    }
    best = max(steady, key=lambda k: steady[k])
    for t in tunes:
        t["exact"] = t["winner"] == best
        t["agrees"] = steady.get(t["winner"], 0.0) >= 0.95 * steady[best]
        t["of_best"] = steady.get(t["winner"], 0.0) / steady[best]
    ratio = statistics.median(t["wall_s"] for t in tunes) / statistics.median(
        s["wall_s"] for s in sweeps
    )
    return {
        "world_size": world,
        "steps": steps,
        "layouts": len(steady),
        "best": best,
        "best_tokens_per_s": steady[best],
        "steady": steady,
        "agree": sum(t["agrees"] for t in tunes),
        "exact": sum(t["exact"] for t in tunes),
        "tunes": tunes,
        "sweeps": sweeps,
        "time_ratio": ratio,
        "noise_floor": _noise_floor(sweeps),
    }


def _noise_floor(sweeps: list[dict]) -> list[float]:
    """How each exhaustive sweep's own best fares in every other sweep (its throughput there over
    that sweep's best): 1.0 when the machine is quiet enough for the sweeps to agree; below 0.95,
    noise alone would fail the agreement criterion."""
    out = []
    for i, a in enumerate(sweeps):
        best = max(
            (k for k, v in a["tokens_per_s"].items() if v), key=lambda k: a["tokens_per_s"][k]
        )
        for j, b in enumerate(sweeps):
            if i != j and b["tokens_per_s"].get(best):
                out.append(
                    b["tokens_per_s"][best] / max(v for v in b["tokens_per_s"].values() if v)
                )
    return out


def bench_world(world: int, steps: int, args: argparse.Namespace, root: Path) -> dict:
    overrides = ["task=train", *args.overrides]
    points = _valid_points(world, [*overrides, f"task.steps={steps}"])
    print(f"world_size={world}: {len(points)} valid layouts, full length {steps} steps", flush=True)
    sweeps, tunes = [], []
    for r in range(args.rounds):
        load = os.getloadavg()[0]
        sweeps.append(
            exhaustive(
                world,
                steps,
                [*overrides, f"task.steps={steps}"],
                points,
                root / f"w{world}-exhaustive{r}",
            )
        )
        print(
            f"  round {r}: exhaustive sweep {sweeps[-1]['wall_s']:.0f} s (load {load:.1f})",
            flush=True,
        )
        for _ in range(args.tunes_per_round):
            n = len(tunes)
            load = os.getloadavg()[0]
            tunes.append(tune(world, steps, overrides, root / f"w{world}-tune{n}"))
            t = tunes[-1]
            print(
                f"  round {r}: tune {n}: {t['wall_s']:.0f} s, {t['trials']} trials {t['rounds']}, "
                "winner "
                f"{t['winner']} (load {load:.1f})",
                flush=True,
            )
    return _verdict(world, steps, sweeps, tunes)


def _report(v: dict) -> str:
    sweeps = [s["wall_s"] for s in v["sweeps"]]
    tunes = [t["wall_s"] for t in v["tunes"]]
    others = ", ".join(f"{t['of_best']:.0%}" for t in v["tunes"] if not t["exact"]) or "-"
    lines = [
        f"world_size={v['world_size']} ({v['layouts']} valid layouts x {v['steps']} steps): best "
        f"{v['best']} at {v['best_tokens_per_s']:.0f} tokens/s",
        f"  winner agrees in {v['agree']}/{len(v['tunes'])} tunes ({v['exact']} the best itself; "
        "the others "
        f"at {others} of its throughput)  (goal >= 9/10)",
        f"  time: tune median {statistics.median(tunes):.0f} s (min {min(tunes):.0f}, max "
        f"{max(tunes):.0f}) vs "
        f"exhaustive median {statistics.median(sweeps):.0f} s = {v['time_ratio']:.2f}x  (goal <= "
        "0.40x)",
    ]
    floor = v.get("noise_floor") or []
    if floor:
        lines.append(
            "  noise floor: each exhaustive sweep's best runs at "
            f"{', '.join(f'{x:.0%}' for x in floor)} of "
            "the other sweeps' best (below 95%: the machine's noise alone fails the 5% criterion)"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--worlds", default="8,4", help="world sizes (default 8,4)")
    ap.add_argument(
        "--steps", default="8:80,4:150", help="full length per world size, WORLD:STEPS,..."
    )
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    ap.add_argument(
        "--tunes-per-round",
        type=int,
        default=5,
        help="tunes after each exhaustive sweep (default 5)",
    )
    ap.add_argument(
        "--dir", type=Path, default=None, help="where the runs go (default bench_tune/TIMESTAMP)"
    )
    ap.add_argument("overrides", nargs="*", help="more overrides of the task (e.g. task.hidden=64)")
    ap.add_argument(
        "--report",
        type=Path,
        default=None,
        help="print the verdict of an earlier run's "
        "bench_tune.json (its measurements are kept), run nothing",
    )
    args = ap.parse_args()
    if args.report is not None:
        for v in json.loads(args.report.read_text()):
            print(_report(_verdict(v["world_size"], v["steps"], v["sweeps"], v["tunes"])))
        return
    steps = {int(w): int(s) for w, s in (item.split(":") for item in args.steps.split(","))}
    root = (args.dir or Path("bench_tune") / time.strftime("%Y%m%d-%H%M%S")).absolute()
    root.mkdir(parents=True, exist_ok=True)
    print(
        f"bench_tune: {root}; {os.cpu_count()} cores, python {sys.version.split()[0]}", flush=True
    )
    results = []
    for world in (int(w) for w in args.worlds.split(",")):
        results.append(bench_world(world, steps[world], args, root))
        (root / "bench_tune.json").write_text(json.dumps(results, indent=2))
    print()
    for v in results:
        print(_report(v))


if __name__ == "__main__":
    main()
