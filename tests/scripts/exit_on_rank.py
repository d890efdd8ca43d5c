"""A torchrun script one of whose ranks calls ``sys.exit(CODE)`` while the others wait in a barrier.

torchrun --nproc-per-node 2 exit_on_rank.py --rank 1 --code 3
"""

import argparse
import sys

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--code", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == args.rank:
        print(f"rank {args.rank} gives up with exit code {args.code}", flush=True)
        sys.exit(args.code)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
