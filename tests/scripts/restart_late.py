"""A torchrun script whose rank 1 is killed after its first attempt joined, and re-joins late on the
restart.

    torchrun --nproc-per-node 2 --max-restarts 1 restart_late.py    # fails with torch 2.13's
    torchrun

torchrun keeps one store for its workers across restarts, with the first attempt's keys in it: rank
0 of the restart reads rank 1's old gloo address ("connectFullMesh ... Connection refused").
wf_launch gives every attempt a fresh store, so the restart joins.
"""

import os
import time

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(2)  # rank 1 comes late to the restart: rank 0 looks for its address first
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print("attempt", attempt, "rank", rank, "sum", t.item(), flush=True)
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), 9)
dist.barrier()
dist.destroy_process_group()
