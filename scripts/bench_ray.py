"""Ray launch overhead: ``python -m wf_launch launcher=ray task=noop`` against a bare Ray script
doing the same, and against ``launcher=local``.

All three start WORLD gloo ranks, run one barrier and tear down; each wall time is the whole
command, interpreter start-up included. The Ray commands go to an existing cluster (``--address``,
or one this script starts with ``scripts/ray_cluster.sh`` and stops after): ``launcher=ray`` creates
one placement group and one actor per rank, as does ``scripts/ray_bare_equivalent.py`` (its gloo
group made by hand). Rounds alternate (wf_launch ray, bare Ray, wf_launch local, ...) so machine
noise hits all alike; the ratios of the medians are printed, and the median of each round's own
ratio (paired: steadier when the machine's load changes between rounds). Goal: launcher=ray <= 1.3x
the bare Ray script.

    python scripts/bench_ray.py [--repeats 5] [--world 8] [--address HOST:PORT]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _bench import timed

HERE = Path(__file__).resolve().parent


def _free_port_block(nodes: int) -> int:
    """A head port whose block (scripts/ray_cluster.sh's port plan) can be bound now."""
    import random
    import socket

    def bindable(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                return False
        return True

    for _ in range(200):
        base = random.randrange(20000, 31000 - 200 * (nodes + 1)) // 10 * 10
        fixed = [
            base,
            base + 1,
            base + 2,
            *(base + 10 * i + k for i in range(1, nodes + 1) for k in range(6)),
        ]
        if all(map(bindable, fixed)):
            return base
    raise SystemExit("no free block of ports for a Ray cluster in 20000-31000")


def _cluster(work: str, world: int) -> tuple[str, str]:
    """Start a 2-node cluster with room for ``world`` one-CPU ranks; (address, its state dir)."""
    state = f"{work}/cluster"
    cpus = str(max(2, (world + 1) // 2))
    out = subprocess.run(
        [
            "bash",
            str(HERE / "ray_cluster.sh"),
            "start",
            "--nodes",
            "2",
            "--cpus",
            cpus,
            "--port",
            str(_free_port_block(2)),
            "--dir",
            state,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(f"could not start a Ray cluster:\n{out.stderr}")
    os.environ["RAY_AUTH_TOKEN_PATH"] = f"{state}/auth_token"  # the cluster's own token
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # it listens on 127.0.0.1 only
    return out.stdout.strip().splitlines()[-1].partition("=")[2], state


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument(
        "--address", default=None, help="an existing cluster (default: start a 2-node one here)"
    )
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="wf_bench_ray_")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    address, state = (args.address, None) if args.address else _cluster(work, args.world)
    try:
        ray = [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=ray",
            f"launcher.address={address}",
            f"engine.dp_size={args.world}",
            "task=noop",
            "engine.distributed_backend=gloo",
            "launcher.console_ranks=[]",
        ]
        bare = [sys.executable, str(HERE / "ray_bare_equivalent.py"), address, str(args.world)]
        local = [
            sys.executable,
            "-m",
            "wf_launch",
            f"engine.dp_size={args.world}",
            "task=noop",
            "engine.distributed_backend=gloo",
            "launcher.console_ranks=[]",
        ]
        timed([*ray, f"hydra.run.dir={work}/warm-ray"], work)
        timed(bare, work)
        a: list[float] = []
        b: list[float] = []
        c: list[float] = []
        for i in range(args.repeats):
            a.append(timed([*ray, f"hydra.run.dir={work}/ray{i}"], work))
            b.append(timed(bare, work))
            c.append(timed([*local, f"hydra.run.dir={work}/local{i}"], work))
            print(
                f"  round {i + 1}: launcher=ray {a[-1]:.2f}s  bare Ray {b[-1]:.2f}s  "
                f"launcher=local {c[-1]:.2f}s",
                flush=True,
            )
        ma, mb, mc = statistics.median(a), statistics.median(b), statistics.median(c)
        print(
            f"\n{args.world} ranks, task=noop, {args.repeats} alternating rounds, "
            f"{os.cpu_count()} cores, "
            f"cluster {address}"
        )
        print(f"launcher=ray          median {ma:.2f}s  (min {min(a):.2f}s)")
        print(f"bare Ray script       median {mb:.2f}s  (min {min(b):.2f}s)")
        print(f"launcher=local        median {mc:.2f}s  (min {min(c):.2f}s)")
        paired = statistics.median(x / y for x, y in zip(a, b))
        print(
            f"ratio launcher=ray / bare Ray = {ma / mb:.2f}x of the medians, {paired:.2f}x the "
            "median of the "
            f"rounds' own ratios (goal <= 1.30x)"
        )
        print(f"ratio launcher=ray / launcher=local = {ma / mc:.2f}x")
    finally:
        if state is not None:
            subprocess.run(
                ["bash", str(HERE / "ray_cluster.sh"), "stop", "--dir", state],
                capture_output=True,
                timeout=300,
            )
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
