"""Benchmark checkpoints across layouts: loading at a new layout vs at the layout that saved, and
export.

1. **Load at a new layout.** For each target layout T (``dp2``: 2 ranks; ``pp2xdp2``:
   4 ranks), two checkpoints of the same FSDP2-sharded model and AdamW state are saved:
   one at T itself, one at ``dp4`` (4 ranks). Then T's ranks load them in alternating
   rounds (``Checkpointer.load``: COMMIT, per-rank files, DCP's read of the overlapping
   shards, optimizer state set back). A round's time is the slowest rank's. Reported: the
   median over rounds of (load the dp4 checkpoint) / (load T's own) in the same round, and
   its range, goal <= 1.5x.
2. **Export.** ``python -m wf_launch.checkpoint export``'s work (consolidate the ``model``
   entry of the dp4 checkpoint into full tensors without a process group, then
   ``torch.save``) against ``torch.save`` of the same full state already in memory, in
   alternating rounds. Reported: export throughput / torch.save throughput (same bytes).

No absolute time is asserted; the machine may be shared (medians of alternating rounds).

    python scripts/bench_reshard.py [--layers 8] [--dim 2048] [--rounds 9] [--dir DIR]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = {"dp4": (4, 1, 4), "dp2": (2, 1, 2), "pp2xdp2": (4, 2, 2)}  # name: (world, pp, dp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stage(args: argparse.Namespace, pp: int, dp: int) -> Any:
    """This rank's pipeline stage of a stack of ``--layers`` Linear layers, FSDP2 over its dp ranks,
    and AdamW."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from worldfoundry.core.distributed import groups
    from worldfoundry.core.distributed.fsdp import fsdp2_wrap

    groups.initialize_model_parallel(pp_size=pp, dp_size=dp)
    stage_id = groups.get_layout().coords(torch.distributed.get_rank())["pp"]
    per = args.layers // pp
    ids = list(range(stage_id * per, (stage_id + 1) * per))

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(stage_id)
            self.layers = nn.ModuleList(nn.Linear(args.dim, args.dim) for _ in ids)

        def global_name(self, name: str) -> str:
            _, local, rest = name.split(".", 2)
            return f"layers.{ids[int(local)]}.{rest}"

    model = Stage()
    dp_group = groups.get_group("dp-cp")
    fsdp2_wrap(
        model, mesh=DeviceMesh.from_group(dp_group.device_group, "cpu", mesh_dim_names=("dp",))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, args.dim)
    for layer in model.layers:
        x = layer(x)
    x.sum().backward()
    opt.step()
    return model, opt


def _rank(
    rank: int, world: int, port: int, job: tuple[str, Any], args: argparse.Namespace, queue: Any
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        import torch
        import torch.distributed as dist
        from loguru import logger

        from wf_launch.checkpoint import Checkpointer

        logger.remove()  # the ranks' "loads at another layout" lines: not what is measured
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        kind, what = job
        _, pp, dp = LAYOUTS[what[0]]
        model, opt = _stage(args, pp, dp)
        state = {"model": model, "optim": opt}
        if kind == "save":
            Checkpointer(what[1]).save(1, state)
            queue.put((rank, True, None))
        else:
            rows: dict[str, list[float]] = {"same": [], "new": []}
            Checkpointer(what[1]).load(state)  # warm-up: DCP imports, first touch of the files
            for _ in range(args.rounds):
                for name, directory in (("same", what[1]), ("new", what[2])):
                    dist.barrier()
                    t0 = time.perf_counter()
                    Checkpointer(directory).load(state)
                    rows[name].append(time.perf_counter() - t0)
            queue.put((rank, True, rows))
        dist.destroy_process_group()
    except BaseException as e:
        import traceback

        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)  # FSDP2 on gloo can abort at interpreter exit (docs: torch quirks)


def _launch(world: int, job: tuple[str, Any], args: argparse.Namespace) -> dict[int, Any]:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world, port, job, args, queue)) for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rank, ok, value = queue.get(timeout=1800)
            if not ok:
                raise SystemExit(f"rank {rank} failed:\n{value}")
            results[rank] = value
        for p in procs:
            p.join()
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _export_rounds(
    directory: Path, out_dir: str, rounds: int
) -> tuple[list[float], list[float], list[float], int]:
    import torch

    from wf_launch.readers.checkpoint import consolidate
    from wf_launch.rundir.checkpoints import complete_checkpoints

    [(_, ckpt)] = complete_checkpoints(directory)
    gathered = consolidate(ckpt, "model")
    nbytes = sum(t.numel() * t.element_size() for t in gathered.values())
    export_s, save_s, read_s = [], [], []
    for i in range(rounds):
        t0 = time.perf_counter()
        state = consolidate(ckpt, "model")
        read_s.append(time.perf_counter() - t0)
        torch.save(state, os.path.join(out_dir, f"export{i}.pt"))
        export_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.save(gathered, os.path.join(out_dir, f"save{i}.pt"))
        save_s.append(time.perf_counter() - t0)
        for name in (f"export{i}.pt", f"save{i}.pt"):
            os.remove(os.path.join(out_dir, name))
    return export_s, save_s, read_s, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # forked ranks hang if the parent ran multi-threaded ops
    out = tempfile.mkdtemp(prefix="bench_reshard_", dir=args.dir)
    try:
        for name in LAYOUTS:
            _launch(LAYOUTS[name][0], ("save", (name, os.path.join(out, name))), args)
        weights = args.layers * (args.dim * args.dim + args.dim) * 4
        print(
            f"torch {torch.__version__}, gloo ranks (1 thread each), FSDP2 {args.layers}x "
            f"Linear({args.dim},"
            f"{args.dim}): {weights / 1e6:.0f} MB fp32 weights + AdamW state "
            f"({3 * weights / 1e6:.0f} MB loaded); "
            f"{args.rounds} alternating rounds; under {args.dir or tempfile.gettempdir()}"
        )
        for target in ("dp2", "pp2xdp2"):
            res = _launch(
                LAYOUTS[target][0],
                ("load", (target, os.path.join(out, target), os.path.join(out, "dp4"))),
                args,
            )
            per_round = {
                n: [max(r[n][i] for r in res.values()) for i in range(args.rounds)]
                for n in ("same", "new")
            }
            same, new = statistics.median(per_round["same"]), statistics.median(per_round["new"])
            paired = sorted(b / a for a, b in zip(per_round["same"], per_round["new"]))
            print(
                f"load at {target:8s}: saved at {target} {same:.3f} s, saved at dp4 {new:.3f} s "
                "(medians); new "
                f"layout / same layout, per round: median {statistics.median(paired):.2f}x (range "
                f"{paired[0]:.2f}-"
                f"{paired[-1]:.2f}; goal <= 1.5x)"
            )
        export_s, save_s, read_s, nbytes = _export_rounds(Path(out) / "dp4", out, args.rounds)
        e, s, r = statistics.median(export_s), statistics.median(save_s), statistics.median(read_s)
        print(
            f"export (dp4 checkpoint -> one torch.save file, {nbytes / 1e6:.0f} MB): {e:.3f} s "
            f"({r:.3f} s reading "
            f"the shards), {nbytes / e / 1e6:.0f} MB/s; torch.save of the gathered state {s:.3f} "
            "s, "
            f"{nbytes / s / 1e6:.0f} MB/s (medians): export throughput = {s / e:.2f}x torch.save's"
        )
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
