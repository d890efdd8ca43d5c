"""User tasks for the SLURM launcher tests (``task.modules=[wf_slurm_test_tasks]``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from wf_launch import TaskContext, register_task


def _state_file(ctx: TaskContext):
    return ctx.run_dir / f"state_rank{ctx.rank}.json"


@register_task("resumable")
def resumable(ctx: TaskContext) -> dict[str, Any]:
    """Steps until preempted on its first run; resumes from the state its hook saved."""
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    saved = json.loads(_state_file(ctx).read_text()) if _state_file(ctx).exists() else None
    if restart == 0:
        ctx.steps = 0
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            ctx.steps += 1
            time.sleep(0.2)
        raise RuntimeError("no preemption signal within 200 s")
    ctx.groups["world"].barrier()
    return {"restart": restart, "resumed_steps": (saved or {}).get("steps", -1)}


def _save(ctx: TaskContext) -> None:
    """Every rank saves its own state when SLURM warns of the time limit."""
    tmp = _state_file(ctx).with_suffix(".tmp")
    tmp.write_text(
        json.dumps({"rank": ctx.rank, "steps": getattr(ctx, "steps", 0), "time": time.time()})
    )
    os.replace(tmp, _state_file(ctx))


resumable.on_preempt = _save


@register_task("fsdp_step")
def fsdp_step(ctx: TaskContext) -> dict[str, Any]:
    """One FSDP2 forward and backward of a model with an embedding: the case whose interpreter exit
    can abort on gloo (shared/notes/torch-quirks.md), for the exit loops of
    scripts/launch_loops.py."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 32))
    fully_shard(model)
    loss = model(torch.randint(0, 64, (4, 8))).square().mean()
    loss.backward()
    return {"loss": float(loss)}
