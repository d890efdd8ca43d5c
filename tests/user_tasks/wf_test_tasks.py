"""User tasks that live outside the package, for the CLI tests (``task.modules=[wf_test_tasks]``)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from wf_launch import TaskConfig, TaskContext, register_task


@dataclass
class MisbehaveConfig(TaskConfig):
    """Which rank misbehaves, and how: 'raise', 'raise_timeout_word', 'raise_first_attempt', 'kill', 'stuck', 'exit',
    'sleep_all' or 'none'."""

    how: str = "raise"
    rank: int = 1
    sleep_s: float = 60.0


@register_task("misbehave", config=MisbehaveConfig)
def misbehave(ctx: TaskContext) -> dict[str, Any]:
    """One rank misbehaves while its peers wait in a barrier."""
    cfg = ctx.task_config
    ctx.log.info("ready")
    if ctx.rank == cfg["rank"]:
        if cfg["how"] == "raise":
            raise ValueError(f"rank {ctx.rank} refuses: bad batch 17")
        if cfg["how"] == "raise_timeout_word":
            raise ValueError(f"rank {ctx.rank}: bad timeout value 0")
        if cfg["how"] == "raise_first_attempt" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            raise ValueError(f"rank {ctx.rank} fails its first attempt")
        if cfg["how"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg["how"] == "exit":
            raise SystemExit(3)
        if cfg["how"] == "stuck":
            time.sleep(cfg["sleep_s"])
    if cfg["how"] == "sleep_all":
        ctx.log.info("sleeping")
        time.sleep(cfg["sleep_s"])
    ctx.groups["world"].barrier()
    return {"rank": ctx.rank}


@register_task("echo")
def echo(ctx: TaskContext) -> dict[str, Any]:
    """Returns what a task sees, so tests can check the context."""
    print(f"hello from rank {ctx.rank}")
    return {
        "rank": ctx.rank, "world_size": ctx.world_size, "coords": ctx.coords,
        "cp_ranks": ctx.groups["cp"].ranks, "has_pp": ctx.pp is not None,
        "run_dir": str(ctx.run_dir), "device": str(ctx.device),
        "started": ctx.config["engine"]["order"],
    }


@dataclass
class DrillTrainConfig(TaskConfig):
    """A small resumable training loop for the drill tests (what ``task=train`` does, in miniature)."""

    steps: int = 24
    checkpoint_every: int = 4
    step_sleep_s: float = 0.1
    seed: int = 0


@register_task("drill_train", config=DrillTrainConfig)
def drill_train(ctx: TaskContext) -> dict[str, Any]:
    """Data-parallel SGD on a linear model over every rank; checkpoints, stops on ``ctx.should_stop()``, resumes."""
    import hashlib

    import torch
    import torch.distributed as dist

    cfg = ctx.cfg
    torch.manual_seed(cfg.seed)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    data = torch.Generator().manual_seed(cfg.seed + 1000 + ctx.rank)
    progress = {"step": 0, "loss": 0.0}
    state = {"model": model, "optim": opt, "data": data, "progress": progress}
    ctx.checkpoint.load(state)
    group = ctx.groups["world"].cpu_group
    while progress["step"] < cfg.steps:
        x = torch.randn(8, 16, generator=data)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
            p.grad /= ctx.world_size
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        progress["step"] += 1
        progress["loss"] = float(mean) / ctx.world_size
        ctx.progress(progress["step"], cfg.steps, loss=progress["loss"])
        time.sleep(cfg.step_sleep_s)
        stop = ctx.should_stop()
        if progress["step"] % cfg.checkpoint_every == 0 or stop:
            ctx.checkpoint.save(progress["step"], state)
        if stop:
            break
    weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    return {"steps_done": progress["step"], "final_loss": progress["loss"],
            "weights_sha256": hashlib.sha256(weights).hexdigest()}
