"""Time from submit until every rank is in its task: wf_launch's SLURM launcher against bare
submitit.

Needs a running cluster (``SLURM_CONF``; ``scripts/slurm_cluster.sh start --nodes 2``). Per
repetition, alternating, the same job shape runs three ways:

- ``wf_launch``: ``python -m wf_launch launcher=slurm task=noop`` (``launcher.wait=false``); the
  time is the slowest rank's ``task_entry_s`` (task entry, after ``dist_init``, relative to the
  submit time the launcher records) read from ``result.json``.
- ``bare``: a submitit job whose function records ``time.time()`` when it starts.
- ``bare+pg``: the same, after ``import torch`` and a gloo ``init_process_group`` (what a
  hand-written distributed job does before its first step).

Each is measured from just before submit. Prints medians and the ratios.

    .venv/bin/python scripts/bench_slurm.py --nodes 2 --tasks-per-node 2 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def bare_entry(with_pg: bool) -> float:
    """A bare submitit task: when its function starts (optionally after torch + a process group)."""
    if not with_pg:
        return time.time()
    from datetime import timedelta

    import submitit
    import torch.distributed as dist

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    t = time.time()
    dist.destroy_process_group()
    return t


def run_bare(folder: Path, nodes: int, tpn: int, with_pg: bool) -> float:
    import submitit

    ex = submitit.SlurmExecutor(folder=folder)
    ex.update_parameters(nodes=nodes, ntasks_per_node=tpn, cpus_per_task=1, time=10)
    t0 = time.time()
    job = ex.submit(bare_entry, with_pg)
    return max(job.results()) - t0


def run_wf(root: Path, nodes: int, tpn: int) -> float:
    run_dir = root / f"wf-{time.time_ns()}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=slurm",
            "task=noop",
            f"engine.dp_size={nodes * tpn}",
            f"launcher.nodes={nodes}",
            f"launcher.tasks_per_node={tpn}",
            "launcher.wait=false",
            "launcher.time_min=10",
            f"hydra.run.dir={run_dir}",
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    subprocess.run(
        [sys.executable, "-m", "wf_launch.status", "--wait", str(run_dir)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok", result
    return max(r["task_entry_s"] for r in result["timings"]["ranks"].values())


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--tasks-per-node", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not os.environ.get("SLURM_CONF"):
        print(
            "bench_slurm: set SLURM_CONF (source .slurm/env.sh after scripts/slurm_cluster.sh "
            "start)",
            file=sys.stderr,
        )
        return 2
    times: dict[str, list[float]] = {"wf_launch": [], "bare": [], "bare+pg": []}
    with tempfile.TemporaryDirectory(prefix="bench-slurm-") as tmp:
        root = Path(tmp)
        for rep in range(args.reps):
            order = list(times) if rep % 2 == 0 else list(reversed(times))
            for name in order:
                if name == "wf_launch":
                    t = run_wf(root, args.nodes, args.tasks_per_node)
                else:
                    t = run_bare(
                        root / f"{name}-{rep}", args.nodes, args.tasks_per_node, name == "bare+pg"
                    )
                times[name].append(t)
                print(f"rep {rep} {name:9s} {t:6.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    shape = f"{args.nodes} node(s) x {args.tasks_per_node} task(s)"
    print(f"\nsubmit -> every rank in its task, median of {args.reps}, {shape}:")
    for name, value in med.items():
        print(
            f"  {name:9s} {value:6.2f} s   (min {min(times[name]):.2f}, max {max(times[name]):.2f})"
        )
    print(
        f"ratio wf_launch / bare+pg: {med['wf_launch'] / med['bare+pg']:.2f}x   "
        f"wf_launch / bare: {med['wf_launch'] / med['bare']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
