"""Throughput of the CP / PP helpers against the raw torch.distributed calls that move the same
bytes.

Each world size runs as fork-started gloo ranks (``tests/multirank.py``), one torch thread per rank,
every thread of rank r pinned to core ``r mod cores`` (``--no-pin`` lets the scheduler place them):
as on a real node, where each rank owns its cores. Unpinned on a 2-core machine the scheduler
migrates the ranks' main, gloo worker and gloo I/O threads between cores and the control column
below strays by 10-30%, more than the effects measured. Sizes are the FULL tensor in MiB (float32,
shape ``(1, S, 1024)``, sequence dim 1):

Every helper returns a NEW tensor, so its honest raw baseline is the raw call
that moves the same bytes INTO A NEW TENSOR (allocation included: on CPU a fresh
multi-MiB buffer costs page faults that a reused one does not). Where a helper
also has a reuse-the-buffer form, that form is compared with the raw call into a
preallocated buffer.

* ``cat_outputs_cp``: the gathered result is SIZE; each rank contributes SIZE/n.
  ``cat/raw``: ``all_gather_into_tensor`` (``all_gather_single``) of the
  contiguous SIZE/n shard into a freshly allocated SIZE buffer.
  ``cat(out=)/raw``: ``cat_outputs_cp(..., out=buf)`` against the same raw
  collective into a preallocated buffer. ``cat/list+cat``: against the upstream
  way, ``all_gather`` into n separate tensors, then ``torch.cat``.
* ``broadcast_split_tensor``: the source holds SIZE; each rank ends with its
  SIZE/n shard, and receivers pass ``None`` (they do not know the shape).
  ``bst/raw``: raw ``broadcast`` of the shape, then ``scatter`` of the n
  contiguous shards into a fresh shard buffer: the cheapest raw calls that do
  the same job (a scatter moves (n-1)/n * SIZE out of the source; a broadcast
  would move (n-1) * SIZE). For reference: ``bst/scatter-only`` is the helper
  against a bare ``scatter`` into a preallocated buffer whose shape receivers got
  for free (the price of the shape header and allocation), and
  ``bcast+slice/scatter`` is raw broadcast-of-SIZE-then-slice against ``bst/raw``'s
  baseline (why the helper scatters).
* PP send/receive: every rank sends a SIZE message to its ring successor and
  receives one from its predecessor. ``pp/raw``: ``queue_irecv_prev`` +
  ``isend_next`` + ``queue_irecv_prev_data`` (fresh receive buffer) against raw
  ``irecv`` into a fresh buffer + ``isend``, waiting on both.
  ``pp(irecv_prev)/raw``: ``irecv_prev(buf)`` + ``isend_next`` against raw
  ``irecv``/``isend`` with the same preallocated buffer.
* ``control``: the raw all-gather timed against itself under two names. It
  should read 1.000; how far it strays is this run's noise floor, the margin
  within which no other cell's distance from 1 means anything.

``broadcast_split_tensor`` is called with the same shape every time, as in a
denoising loop, so after two calls it runs its steady-state path (header and
scatter posted together, see its docstring); the raw baseline cannot, since raw
receivers only learn the shape from the header.

Every sample times ``inner`` back-to-back calls after a barrier on every rank
(``inner`` calibrated so a sample lasts about ``--sample-ms``); the sample's
time is the slowest rank's (all-reduce MAX outside the timed region). Each
column's helper and baseline are timed as an adjacent pair (helper first in even
rounds, baseline first in odd ones), so both halves of a pair see the same
machine: on a small shared machine load comes in bursts longer than a sample,
and pairs taken far apart in time disagree by more than the effects measured.
The ratio reported is the median over rounds of (raw time / helper time), i.e.
helper throughput / raw throughput (>= 1 means the helper is at least as fast).

    .venv/bin/python scripts/bench_collectives.py            # 2/4/8 ranks, 1/16/64 MiB
    .venv/bin/python scripts/bench_collectives.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch

torch.set_num_threads(1)

from multirank import run_ranks

ROW = 1024  # float32 elements per sequence position (4 KiB)


def _timed(fn: Callable[[], object], inner: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item() / inner


def _compare(
    pairs: dict[str, tuple[Callable[[], object], Callable[[], object]]],
    target_s: float,
    repeats: int,
) -> dict[str, list[tuple[float, float]]]:
    """Time every (helper, raw) pair ``repeats`` times as adjacent samples; returns (helper, raw)
    seconds.

    ``inner`` (calls per sample) is calibrated once so the slowest function's sample
    takes about ``target_s``; it is the same on every rank (all-reduced).
    """
    import torch.distributed as dist

    fns = [fn for pair in pairs.values() for fn in pair]
    for fn in fns:
        fn()
        fn()
    probe = max(_timed(fn, 1) for fn in fns)
    inner = torch.tensor([max(1, min(64, round(target_s / max(probe, 1e-6))))])
    dist.all_reduce(inner, op=dist.ReduceOp.MAX)
    n = int(inner)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in pairs}
    for i in range(repeats):
        for name, (helper, raw) in pairs.items():
            if i % 2 == 0:
                h = _timed(helper, n)
                r = _timed(raw, n)
            else:
                r = _timed(raw, n)
                h = _timed(helper, n)
            times[name].append((h, r))
    return times


def _pin(rank: int) -> None:
    """Pin every thread of this rank (and threads it starts later) to core ``rank % cores``."""
    cores = sorted(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), {cores[rank % len(cores)]})


def _rank_main(
    rank: int, world: int, sizes: list[float], repeats: int, target_s: float, pin: bool
) -> list[dict]:
    import torch.distributed as dist

    if pin:
        _pin(rank)

    from worldfoundry.core.distributed import (
        broadcast_split_tensor,
        cat_outputs_cp,
        destroy_model_parallel,
        get_cp_group,
        init_pp_scheduler,
        initialize_model_parallel,
    )

    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    rows: list[dict] = []
    initialize_model_parallel(cp_size=world)
    pg = get_cp_group().device_group
    for mib in sizes:
        seq = max(world, int(mib * 2**20) // (4 * ROW) // world * world)
        full_bytes = seq * ROW * 4
        full = torch.randn(1, seq, ROW)
        shard = full.narrow(1, rank * (seq // world), seq // world).contiguous()
        out_buf = torch.empty(world * shard.shape[1], 1, ROW)
        recv_shard = torch.empty_like(shard)
        pieces = [p.contiguous() for p in full.chunk(world, dim=1)]
        bcast_buf = full.clone()

        shape_buf = torch.tensor(full.shape)

        def list_gather_cat() -> torch.Tensor:
            parts = [torch.empty_like(shard) for _ in range(world)]
            dist.all_gather(parts, shard, group=pg)
            return torch.cat(parts, dim=1)

        def raw_gather_fresh() -> torch.Tensor:
            fresh = torch.empty(world * shard.shape[1], 1, ROW)
            gather_single(fresh, shard.view(-1, 1, ROW), group=pg)
            return fresh

        def raw_shape_scatter() -> torch.Tensor:
            dist.broadcast(shape_buf, src=0, group=pg)
            n = int(shape_buf[1]) // world
            fresh = torch.empty(1, n, ROW)
            dist.scatter(
                fresh,
                [full.narrow(1, r * n, n).contiguous() for r in range(world)]
                if rank == 0
                else None,
                src=0,
                group=pg,
            )
            return fresh

        def raw_broadcast_slice() -> torch.Tensor:
            dist.broadcast(bcast_buf, src=0, group=pg)
            return bcast_buf.narrow(1, rank * (seq // world), seq // world).contiguous()

        out_view = out_buf.view(1, -1, ROW)

        def cat() -> torch.Tensor:
            return cat_outputs_cp(shard, 1, pg)

        def bst() -> torch.Tensor:
            return broadcast_split_tensor(full if rank == 0 else None, 1, pg)

        def raw_scatter_pre() -> None:
            dist.scatter(recv_shard, pieces if rank == 0 else None, src=0, group=pg)

        pairs = {
            "cat/raw": (cat, raw_gather_fresh),
            "cat(out=)/raw": (
                lambda: cat_outputs_cp(shard, 1, pg, out=out_view),
                lambda: gather_single(out_buf, shard.view(-1, 1, ROW), group=pg),
            ),
            "cat/list+cat": (cat, list_gather_cat),
            "bst/raw": (bst, raw_shape_scatter),
            "bst/scatter-only": (bst, raw_scatter_pre),
            "bcast+slice/scatter": (raw_broadcast_slice, raw_shape_scatter),
            "control": (raw_gather_fresh, raw_gather_fresh),
        }
        check = cat_outputs_cp(shard, 1, pg)
        assert torch.equal(check, full), "cat_outputs_cp returned wrong data"
        assert torch.equal(bst(), pieces[rank]), "broadcast_split_tensor returned wrong data"
        times = _compare(pairs, target_s, repeats)
        rows.append({"op": "cp", "mib": mib, "bytes": full_bytes, "times": times})
    destroy_model_parallel()

    initialize_model_parallel(pp_size=world)
    sched = init_pp_scheduler()
    prev, nxt = sched.prev_rank, sched.next_rank
    ppg = sched.group.device_group
    for mib in sizes:
        seq = max(1, int(mib * 2**20) // (4 * ROW))
        msg = torch.full((1, seq, ROW), float(rank))
        buf = torch.empty_like(msg)

        def helper_ring() -> torch.Tensor:
            sched.queue_irecv_prev(msg.shape, msg.dtype)
            work = sched.isend_next(msg)
            got = sched.queue_irecv_prev_data()
            work.wait()
            return got

        def raw_ring() -> torch.Tensor:
            fresh = torch.empty_like(msg)
            r = dist.irecv(fresh, src=prev, group=ppg)
            s = dist.isend(msg, dst=nxt, group=ppg)
            r.wait()
            s.wait()
            return fresh

        def helper_ring_pre() -> torch.Tensor:
            r = sched.irecv_prev(buf)
            s = sched.isend_next(msg)
            r.wait()
            s.wait()
            return buf

        def raw_ring_pre() -> torch.Tensor:
            r = dist.irecv(buf, src=prev, group=ppg)
            s = dist.isend(msg, dst=nxt, group=ppg)
            r.wait()
            s.wait()
            return buf

        assert helper_ring()[0, 0, 0].item() == float(prev), "PP ring delivered the wrong message"
        times = _compare(
            {
                "pp/raw": (helper_ring, raw_ring),
                "pp(irecv_prev)/raw": (helper_ring_pre, raw_ring_pre),
            },
            target_s,
            repeats,
        )
        rows.append({"op": "pp", "mib": mib, "bytes": seq * ROW * 4, "times": times})
    destroy_model_parallel()
    return rows if rank == 0 else []


def _ratio(samples: list[tuple[float, float]]) -> float:
    return statistics.median(r / h for h, r in samples)


def _mbps(nbytes: int, samples: list[tuple[float, float]]) -> float:
    return nbytes / 2**20 / statistics.median(h for h, _ in samples)


COLUMNS = [
    ("cat/raw", "cp"),
    ("cat(out=)/raw", "cp"),
    ("cat/list+cat", "cp"),
    ("bst/raw", "cp"),
    ("pp/raw", "pp"),
    ("pp(irecv_prev)/raw", "pp"),
    ("bst/scatter-only", "cp"),
    ("bcast+slice/scatter", "cp"),
    ("control", "cp"),
]
GOALS = {
    "cat/raw": 0.95,
    "cat(out=)/raw": 0.95,
    "bst/raw": 0.95,
    "pp/raw": 0.95,
    "pp(irecv_prev)/raw": 0.95,
    "cat/list+cat": 1.0,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ranks", type=int, nargs="+", default=[2, 4, 8], help="world sizes (gloo ranks)"
    )
    ap.add_argument(
        "--sizes", type=float, nargs="+", default=[1, 16, 64], help="full tensor sizes in MiB"
    )
    ap.add_argument(
        "--repeats", type=int, default=15, help="adjacent (helper, raw) pairs per column (median)"
    )
    ap.add_argument(
        "--sample-ms", type=float, default=20.0, help="target duration of one timed sample"
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2/4 ranks, 1/16 MiB, 7 repeats, 10 ms samples (under a minute)",
    )
    ap.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let the scheduler place ranks (default: rank r pinned to core r mod cores)",
    )
    ap.add_argument(
        "--timeout", type=float, default=900, help="seconds per world size before ranks are killed"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.sizes, args.repeats, args.sample_ms = [2, 4], [1, 16], 7, 10.0
    if args.repeats < 1 or any(r < 2 for r in args.ranks) or any(s <= 0 for s in args.sizes):
        ap.error("need --repeats >= 1, --ranks >= 2 and --sizes > 0")

    placement = (
        f"rank r pinned to core r mod {len(os.sched_getaffinity(0))}" if args.pin else "unpinned"
    )
    print(
        f"torch {torch.__version__}, gloo, {placement}, float32 (1, S, {ROW}) along dim 1, "
        f"{args.repeats} "
        "adjacent pairs per cell; ratio = helper throughput / raw throughput (median of raw time "
        "/ helper time); "
        "MiB/s = full tensor size / median helper time"
    )
    header = (
        f"{'ranks':>5} {'MiB':>5} | "
        + " ".join(f"{c:>{max(7, len(c))}}" for c, _ in COLUMNS)
        + f" | {'cat MiB/s':>9} {'bst MiB/s':>9} {'pp MiB/s':>8}"
    )
    print(header + "\n" + "-" * len(header), flush=True)
    worst: dict[str, float] = {}
    pooled: dict[str, list[float]] = {col: [] for col, _ in COLUMNS}
    for world in args.ranks:
        rows = run_ranks(
            _rank_main,
            world,
            args.sizes,
            args.repeats,
            args.sample_ms / 1e3,
            args.pin,
            timeout=args.timeout,
        )[0]
        by_size: dict[float, dict[str, dict]] = {}
        for row in rows:
            by_size.setdefault(row["mib"], {})[row["op"]] = row
        for mib, ops in by_size.items():
            vals = {col: _ratio(ops[op]["times"][col]) for col, op in COLUMNS}
            for k, v in vals.items():
                worst[k] = min(worst.get(k, float("inf")), v)
            for col, op in COLUMNS:
                pooled[col] += [r / h for h, r in ops[op]["times"][col]]
            cp, pp = ops["cp"]["times"], ops["pp"]["times"]
            print(
                f"{world:>5} {mib:>5g} | "
                + " ".join(f"{vals[c]:>{max(7, len(c))}.3f}" for c, _ in COLUMNS)
                + f" | {_mbps(ops['cp']['bytes'], cp['cat/raw']):>9.0f}"
                f" {_mbps(ops['cp']['bytes'], cp['bst/raw']):>9.0f}"
                f" {_mbps(ops['pp']['bytes'], pp['pp/raw']):>8.0f}",
                flush=True,
            )
    print(
        "-" * len(header)
        + f"\n{'all':>5} {'':>5} | "
        + " ".join(f"{statistics.median(pooled[c]):>{max(7, len(c))}.3f}" for c, _ in COLUMNS)
        + "   (median of every pair of the column, all cells pooled)"
    )
    print("worst per column: " + ", ".join(f"{k} {v:.3f}" for k, v in worst.items()))
    print(
        "goals: "
        + ", ".join(f"{k} >= {v:g}" for k, v in GOALS.items())
        + " (bst/scatter-only and bcast+slice/scatter are for reference; control, the raw "
        "all-gather "
        "against itself, shows this run's noise floor)"
    )
    missed = [k for k, v in GOALS.items() if worst[k] < v]
    print("goals missed in some cell: " + (", ".join(missed) if missed else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
