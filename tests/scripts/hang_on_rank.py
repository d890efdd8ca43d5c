"""A torchrun script one of whose ranks never reaches the all_reduce its peers wait in.

The group's timeout is ``--timeout-s``: the waiting ranks give up after it (0: no timeout of the
script's own, the default one).

    torchrun --nproc-per-node 2 hang_on_rank.py --rank 1 --timeout-s 5
"""

import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def slow_data_loader(seconds: float) -> None:
    time.sleep(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--sleep-s", type=float, default=120.0)
    args = parser.parse_args()
    if args.timeout_s > 0:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    else:
        dist.init_process_group("gloo")
    if dist.get_rank() == args.rank:
        slow_data_loader(args.sleep_s)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
