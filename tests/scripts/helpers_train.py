"""A torchrun script that uses wf_launch's helpers: progress, a stop flag, checkpoints, a reported
result.

    torchrun --nproc-per-node 2 helpers_train.py --steps 8          # the helpers are no-ops: it
    just trains
    python -m wf_launch task=script task.path=helpers_train.py 'task.args=[--steps,8]'
    engine.dp_size=2
    python -m wf_launch.drill task=script task.path=helpers_train.py
    'task.args=[--steps,12,--step-sleep,0.3]' \\
        engine.dp_size=2 --inject kill9@4,sigterm@8

Every step's data comes from the step number, so a run resumed from a checkpoint sees
the batches it would have seen. Under wf_launch: ``checkpoint.load`` resumes from the
newest checkpoint, ``should_stop()`` turns SIGTERM / a preemption into a checkpoint and
a clean end, and rank 0 reports ``final_loss`` and ``weights_sha256`` (what the drill
compares). Rank 0 also writes them to ``--out`` when given (any launcher). ``progress`` is
saved with scope ``replicated``, so the run resumes at another layout too (docs/scripts.md).
"""

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from wf_launch import checkpoint, progress, report_result, should_stop

SCOPES = {"progress": "replicated"}
"""``progress`` is the same on every rank: one copy, which loads at any layout."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--fail-at", type=int, default=0, help="rank 0 raises at this step")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    state = {"model": net, "optim": opt, "progress": {"step": 0, "losses": []}}
    checkpoint.load(state)  # None on a first start (and outside wf_launch)
    step = state["progress"]["step"]
    while step < args.steps:
        g = torch.Generator().manual_seed(7919 * step + rank)
        x = torch.randn(16, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.mean(dim=1, keepdim=True).cos())
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        step += 1
        state["progress"]["step"] = step
        state["progress"]["losses"].append(round(total.item() / world, 8))
        progress(step, args.steps, loss=total.item() / world)
        time.sleep(args.step_sleep)
        if step == args.fail_at and rank == 0:
            raise RuntimeError(f"step {step} fails, as asked (--fail-at)")
        if should_stop():
            checkpoint.save(step, state, scopes=SCOPES)
            break
        if step % 2 == 0:
            checkpoint.save(step, state, scopes=SCOPES)
    digest = hashlib.sha256(
        b"".join(p.detach().numpy().tobytes() for p in net.parameters())
    ).hexdigest()
    summary = {
        "final_loss": state["progress"]["losses"][-1],
        "weights_sha256": digest,
        "steps_done": step,
    }
    report_result(summary)
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
