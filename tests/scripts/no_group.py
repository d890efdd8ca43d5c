"""A script that never starts a process group: each rank works alone and writes what it saw.

torchrun --nproc-per-node 2 no_group.py --out-dir DIR
"""

import argparse
import json
import os
import sys
from pathlib import Path

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
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--cp", type=int, default=None)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen = {k: v for k, v in os.environ.items() if k in TORCHRUN_VARS or k.startswith("WF_")}
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "env": seen,
                "cwd": os.getcwd(),
                "argv": sys.argv,
                "file": os.path.abspath(__file__),
            }
        )
    )
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} worked alone", flush=True)


if __name__ == "__main__":
    main()
