"""A task whose step time is a known function of its layout, for the tuner's tests
(``task=clockwork``).

Every rank sleeps :func:`step_seconds` per step and reports ``ctx.progress``; rank 0
returns ``tokens_per_step``, so the tuner's metric ``tokens_per_s`` is
:func:`tokens_per_s` exactly (sleeps are not CPU-bound: a loaded machine shifts them
by milliseconds). Validation refuses ``cp`` that does not divide ``seq`` and
``pp > micro_batches``; :meth:`ClockworkConfig.estimate_memory_gb` is another known
function. Layout keys (``tp1-cp2-pp1-dp1-mb2``) in ``raise_at`` / ``oom_at`` /
``stall_at`` make that layout raise, run out of memory or stop making progress.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from wf_launch import TaskConfig, TaskContext, register_task
from wf_launch.config import EngineConfig, config_error, positive_int

UNIT_S = 0.03
FAIL_ENV = "WF_CLOCKWORK_FAIL"
"""A layout key: that layout raises while this variable names it (a failure that a rerun does not
repeat)."""


def step_seconds(tp: int, cp: int, pp: int, dp: int, mb: int, unit: float = UNIT_S) -> float:
    """The step time of a layout, by construction."""
    return unit * (mb * (1.0 + 0.6 * (tp - 1)) + 0.8 * (cp - 1) + 0.4 * (pp - 1) + 0.15 * dp)


def tokens_per_step(dp: int, mb: int) -> int:
    return 1000 * dp * mb


def tokens_per_s(tp: int, cp: int, pp: int, dp: int, mb: int, unit: float = UNIT_S) -> float:
    return tokens_per_step(dp, mb) / step_seconds(tp, cp, pp, dp, mb, unit)


def memory_gb(tp: int, cp: int, pp: int, dp: int, mb: int) -> float:
    """The estimate, by construction: activations per micro-batch split by cp and pp, plus 0.5
    GB."""
    return 0.5 + 2.0 * mb / (cp * pp)


def layout_key(tp: int, cp: int, pp: int, dp: int, mb: int) -> str:
    return f"tp{tp}-cp{cp}-pp{pp}-dp{dp}-mb{mb}"


@dataclass
class ClockworkConfig(TaskConfig):
    """``steps`` steps of :func:`step_seconds` each; ``seq`` must split over cp; ``report=false``:
    no metric."""

    steps: int = 20
    micro_batches: int = 1
    seq: int = 2
    unit_s: float = UNIT_S
    report: bool = True
    raise_at: list[str] = field(default_factory=list)
    oom_at: list[str] = field(default_factory=list)
    stall_at: list[str] = field(default_factory=list)

    def validate(self, engine: EngineConfig | None = None) -> None:
        positive_int("task.steps", self.steps)
        positive_int("task.micro_batches", self.micro_batches)
        if engine is not None:
            if self.seq % engine.cp_size:
                raise config_error(
                    "engine.cp_size", engine.cp_size, f"must divide task.seq={self.seq}"
                )
            if engine.pp_size > self.micro_batches:
                raise config_error(
                    "task.micro_batches",
                    self.micro_batches,
                    f"an integer >= engine.pp_size={engine.pp_size}",
                )

    def estimate_memory_gb(self, layout: dict[str, Any]) -> float:
        return memory_gb(layout["tp"], layout["cp"], layout["pp"], layout["dp"], self.micro_batches)


@register_task("clockwork", config=ClockworkConfig)
def clockwork(ctx: TaskContext) -> dict[str, Any]:
    cfg: ClockworkConfig = ctx.cfg
    sizes = {d: ctx.groups[d].world_size for d in ("tp", "cp", "pp", "dp")}
    key = layout_key(**sizes, mb=cfg.micro_batches)
    step_s = step_seconds(**sizes, mb=cfg.micro_batches, unit=cfg.unit_s)
    ctx.groups["world"].barrier()
    t0 = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        if os.environ.get(FAIL_ENV) == key:
            raise RuntimeError(f"clockwork: layout {key} fails while {FAIL_ENV} names it")
        if key in cfg.raise_at and step == 2:
            raise ValueError(f"clockwork: layout {key} refuses at step 2, as asked")
        if key in cfg.oom_at and step == 2:
            raise MemoryError(f"clockwork: layout {key} ran out of memory, as asked")
        if key in cfg.stall_at and step == 3:
            time.sleep(3600)
        time.sleep(step_s)
        ctx.progress(step, cfg.steps)
    elapsed = time.perf_counter() - t0
    ctx.groups["world"].barrier()
    if not ctx.is_main or not cfg.report:
        return {"layout_key": key}
    return {
        "layout_key": key,
        "tokens_per_step": tokens_per_step(sizes["dp"], cfg.micro_batches),
        "tokens_per_s": tokens_per_step(sizes["dp"], cfg.micro_batches) * cfg.steps / elapsed,
    }


@register_task(
    "train_peak",
    config=__import__("wf_launch.tasks.train", fromlist=["TrainConfig"]).TrainConfig,
    preload=__import__("wf_launch.tasks.train", fromlist=["PRELOAD"]).PRELOAD,
)
def train_peak(ctx: TaskContext) -> dict[str, Any]:
    """``task=train``, then every rank's peak resident memory (``ru_maxrss``), gathered to rank
    0."""
    import resource

    import torch.distributed as dist

    from wf_launch.tasks.train import train

    out = train(ctx)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    peaks: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(peaks, peak_gb, group=ctx.groups["world"].cpu_group)
    if ctx.is_main:
        out.update(peak_rss_gb=max(peaks), peak_rss_by_rank=peaks)
    return out
