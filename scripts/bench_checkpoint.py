"""Benchmark wf_launch.checkpoint.Checkpointer (DCP) against torch.save of the same per-rank
tensors.

Starts ``--ranks`` fork-started gloo ranks on this machine, FSDP2-shards a stack of
``--layers`` square Linear layers (``--dim``; the defaults make ~151 MB of fp32
weights in all) and, interleaved round by round so machine load hits every variant
alike, times on every rank:

- ``torch.save``: each rank writes its local shards to its own file (fsync'd, as DCP does);
- ``Checkpointer.save`` synchronous: DCP write, barrier, rename, COMMIT;
- ``Checkpointer.save`` with ``async_save=True``: the time the caller is blocked
  (staging to CPU memory and the per-rank file), then the ``wait()`` that commits.

A round's time is the slowest rank's. Reported as ratios of this run (best of the
rounds): DCP save throughput / torch.save throughput (goal >= 0.7) and async blocked
time / synchronous save time (goal <= 0.2). No absolute time is asserted.

    python scripts/bench_checkpoint.py [--ranks 2] [--layers 9] [--dim 2048] [--rounds 5] [--dir
    DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out_dir: str, queue) -> None:
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
        from torch import nn
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        from wf_launch.checkpoint import Checkpointer
        from worldfoundry.core.distributed.ema import get_local_tensor_if_dtensor
        from worldfoundry.core.distributed.fsdp import fsdp2_wrap

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)

        class Stack(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.layers = nn.ModuleList(
                    nn.Linear(args.dim, args.dim) for _ in range(args.layers)
                )

        torch.manual_seed(0)
        model = Stack()
        fsdp2_wrap(model)
        local = {k: get_local_tensor_if_dtensor(v) for k, v in get_model_state_dict(model).items()}
        nbytes = sum(t.numel() * t.element_size() for t in local.values())

        def barrier_time(fn) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        def torch_save(i: int) -> None:
            path = os.path.join(out_dir, f"torch_save_{i}_rank{rank}.pt")
            with open(path, "wb") as f:
                torch.save(local, f)
                f.flush()
                os.fsync(f.fileno())

        sync = Checkpointer(os.path.join(out_dir, "sync"), keep=1)
        asyn = Checkpointer(os.path.join(out_dir, "async"), keep=1, async_save=True)
        state = {"model": model}
        sync.save(0, state)  # warm-up: first-touch, DCP imports, the async checkpoint group
        asyn.save(0, state)
        asyn.wait()
        rows: dict[str, list[float]] = {
            "torch.save": [],
            "sync": [],
            "async blocked": [],
            "async wait": [],
        }
        for i in range(1, args.rounds + 1):
            rows["torch.save"].append(barrier_time(lambda: torch_save(i)))
            os.remove(os.path.join(out_dir, f"torch_save_{i}_rank{rank}.pt"))
            rows["sync"].append(barrier_time(lambda: sync.save(i, state)))
            rows["async blocked"].append(barrier_time(lambda: asyn.save(i, state)))
            rows["async wait"].append(barrier_time(asyn.wait))
        asyn.close()
        queue.put((rank, True, (nbytes, rows)))
        dist.destroy_process_group()
    except BaseException as e:
        import traceback

        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        queue.close()
        queue.join_thread()
        os._exit(0)  # FSDP2 on gloo can abort at interpreter exit (docs: torch quirks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--dir", default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # forked ranks hang if the parent ran multi-threaded ops
    out_dir = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.ranks, port, args, out_dir, queue))
        for r in range(args.ranks)
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
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(out_dir, ignore_errors=True)

    total_bytes = sum(nbytes for nbytes, _ in results.values())
    names = list(results[0][1])
    per_round = {
        n: [max(results[r][1][n][i] for r in results) for i in range(args.rounds)] for n in names
    }
    best = {n: min(v) for n, v in per_round.items()}
    median = {n: statistics.median(v) for n, v in per_round.items()}
    print(
        f"torch {torch.__version__}, {args.ranks} gloo ranks (1 thread each), FSDP2 {args.layers}x"
        f"Linear({args.dim},{args.dim}): {total_bytes / 1e6:.0f} MB fp32 in all, "
        f"{total_bytes / args.ranks / 1e6:.0f} MB per rank; {args.rounds} interleaved rounds; "
        f"written under {args.dir or tempfile.gettempdir()}"
    )
    print(f"{'variant':24s} {'best s':>8s} {'median s':>9s} {'MB/s (best)':>12s}")
    for n in names:
        print(f"{n:24s} {best[n]:8.3f} {median[n]:9.3f} {total_bytes / best[n] / 1e6:12.0f}")
    print(
        f"DCP save throughput vs torch.save: {best['torch.save'] / best['sync']:.2f}x "
        f"(medians {median['torch.save'] / median['sync']:.2f}x; goal >= 0.7)"
    )
    print(
        f"async save: step blocked {best['async blocked'] / best['sync']:.2f}x of the synchronous "
        "save "
        f"(medians {median['async blocked'] / median['sync']:.2f}x; goal <= 0.2)"
    )


if __name__ == "__main__":
    main()
