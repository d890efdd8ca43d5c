"""User tasks for the run-identity, tracker and console tests
(``task.modules=[wf_identity_tasks]``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from wf_launch import TaskConfig, TaskContext, register_task


@dataclass
class FailAlikeConfig(TaskConfig):
    """Every rank raises ``ValueError('bad shape')`` at the same line; the ranks in ``odd`` raise a
    TypeError."""

    odd: list[int] | None = None


def _check_shape(rank: int) -> None:
    raise ValueError(f"bad shape {[4, 4]}")


@register_task("fail_alike", config=FailAlikeConfig)
def fail_alike(ctx: TaskContext) -> dict[str, Any]:
    ctx.groups["world"].barrier()
    if ctx.rank in (ctx.cfg.odd or []):
        raise TypeError(f"rank {ctx.rank} got a str where a tensor was expected")
    _check_shape(ctx.rank)
    return {}


@dataclass
class WhoamiConfig(TaskConfig):
    """Returns the run id the rank sees; ``fail_attempt`` (>= 0): every rank of that attempt
    raises."""

    fail_attempt: int = -1


@register_task("whoami", config=WhoamiConfig)
def whoami(ctx: TaskContext) -> dict[str, Any]:
    attempt = int(os.environ.get("WF_ATTEMPT", "0"))
    ctx.groups["world"].barrier()
    if attempt == ctx.cfg.fail_attempt:
        raise RuntimeError(f"attempt {attempt} fails, as asked")
    return {
        "rank": ctx.rank,
        "run_id": ctx.run_id,
        "env": os.environ.get("WF_RUN_ID"),
        "attempt": attempt,
    }


@dataclass
class ChattyConfig(TaskConfig):
    """``steps`` steps of ``step_sleep_s``, progress with a loss every step and a log line every
    ``say_every``."""

    steps: int = 30
    step_sleep_s: float = 0.1
    say_every: int = 3


@register_task("chatty", config=ChattyConfig)
def chatty(ctx: TaskContext) -> dict[str, Any]:
    cfg = ctx.cfg
    for step in range(1, cfg.steps + 1):
        time.sleep(cfg.step_sleep_s)
        ctx.progress(step, cfg.steps, loss=round(2.0 / step, 4))
        if step % cfg.say_every == 0:
            ctx.log.info(f"chatty step {step}")
    ctx.groups["world"].barrier()
    return {"steps": cfg.steps}


@dataclass
class SlowStepsConfig(TaskConfig):
    """``steps`` steps of ``step_sleep_s``, polling the stop flag after each (a task slow to reach
    its next boundary)."""

    steps: int = 5
    step_sleep_s: float = 20.0


@register_task("slow_steps", config=SlowStepsConfig)
def slow_steps(ctx: TaskContext) -> dict[str, Any]:
    ctx.stop.every = 1
    for step in range(1, ctx.cfg.steps + 1):
        ctx.progress(step, ctx.cfg.steps)
        if ctx.should_stop():
            return {"stopped_at": step}
        time.sleep(ctx.cfg.step_sleep_s)
    return {"stopped_at": None}
