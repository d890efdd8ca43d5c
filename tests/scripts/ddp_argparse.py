"""A plain torchrun training script: argparse, a gloo process group, DDP, a few SGD steps.

    torchrun --nproc-per-node 2 ddp_argparse.py --steps 5 --lr 0.1 --out result.json
    python -m wf_launch.run --nproc-per-node 2 ddp_argparse.py --steps 5 --lr 0.1 --out result.json
    python -m wf_launch task=script task.path=ddp_argparse.py 'task.args=[--steps,5]'
    engine.dp_size=2

Nothing in it knows about wf_launch. Rank 0 writes the final loss, the weights' hash and
what it saw of the launch (its argv, environment and working directory) to ``--out``.
"""

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(8, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 1)
        )
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        print(f"rank {rank} step {step} loss {total.item() / world:.6f}", flush=True)
    digest = hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in model.module.parameters())
    ).hexdigest()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "final_loss": total.item() / world,
                    "weights_sha256": digest,
                    "argv": sys.argv,
                    "cwd": os.getcwd(),
                    "file": os.path.abspath(__file__),
                    "env": {k: os.environ.get(k) for k in TORCHRUN_VARS},
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
