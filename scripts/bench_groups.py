"""Group creation: ``initialize_model_parallel`` against each rank creating only its own groups.

``initialize_model_parallel`` has every rank call ``new_group`` for every group of
every kind, in one order (O(world size) calls per rank, but a call for a group the
rank is not in is local and cheap). The alternative torch offers is
``use_local_synchronization=True``: each rank creates only its own groups. It is
not used because torch names such groups by their ranks and the number of live
groups, a name that repeats after a destroy, so re-initializing the same layout in
one process meets the previous groups' stale rendezvous keys. Both build the same
seven kinds (tp, cp, pp, dp, tp-cp, dp-cp, tp-pp) on fresh fork-started gloo
ranks for every sample; the time is the slowest rank's, strategies alternate, and
the ratio of medians is printed (< 1: ours is faster).

    .venv/bin/python scripts/bench_groups.py [--ranks 8 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch
import torch.distributed as dist
from multirank import run_ranks

from worldfoundry.core.distributed import groups
from worldfoundry.core.distributed.topology import COMBINED, DIMS, Layout


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _own_groups_only(layout: Layout, rank: int) -> None:
    made: set[tuple[int, ...]] = {tuple(range(layout.world_size))}
    for name in (*DIMS, *COMBINED):
        members = tuple(layout.group_of(rank, name))
        if members not in made:
            dist.new_group(list(members), use_local_synchronization=True)
            made.add(members)


def _sample(rank: int, world: int, strategy: str) -> float:
    sizes = {"tp": 2, "cp": 2, "pp": 2} if world >= 8 else {"tp": 1, "cp": 2, "pp": 2}
    dist.barrier()
    t0 = time.perf_counter()
    if strategy == "ours":
        groups.initialize_model_parallel(sizes["tp"], sizes["pp"], sizes["cp"])
    else:
        layout = Layout(world, tp_size=sizes["tp"], cp_size=sizes["cp"], pp_size=sizes["pp"])
        _own_groups_only(layout, rank)
    return _slowest(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{'ranks':>5} {'ours (ms)':>10} {'own-groups-only (ms)':>21} {'ratio':>6}")
    for world in args.ranks:
        samples: dict[str, list[float]] = {"ours": [], "local": []}
        for i in range(args.repeats):
            for strategy in ("ours", "local") if i % 2 == 0 else ("local", "ours"):
                samples[strategy].append(run_ranks(_sample, world, strategy, timeout=300)[0])
        mo, ml = (statistics.median(samples[k]) * 1e3 for k in ("ours", "local"))
        print(f"{world:>5} {mo:>10.1f} {ml:>21.1f} {mo / ml:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
