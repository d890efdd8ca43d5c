"""User tasks that live outside the package, for the CLI tests
(``task.modules=[wf_test_tasks]``)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from wf_launch import TaskConfig, TaskContext, register_task


@dataclass
class MisbehaveConfig(TaskConfig):
    """Which rank misbehaves, and how: 'raise', 'raise_unrecordable', 'fill_disk',
    'raise_timeout_word', 'raise_first_attempt', 'kill', 'stuck', 'exit', 'sleep_all' or 'none'."""

    how: str = "raise"
    rank: int = 1
    sleep_s: float = 60.0


def _fill(path: os.PathLike) -> None:
    """Write ``path`` until the file system holding it is full."""
    with open(path, "ab", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:
            pass


@register_task("misbehave", config=MisbehaveConfig)
def misbehave(ctx: TaskContext) -> dict[str, Any]:
    """One rank misbehaves while its peers wait in a barrier."""
    cfg = ctx.task_config
    ctx.log.info("ready")
    if cfg["how"] == "stuck":
        # All start together, whatever the load: only the stuck rank is late. A barrier of its
        # own timeout, as the short engine timeout these tests set is for the stuck rank alone.
        dist.monitored_barrier(ctx.groups["world"].cpu_group, timeout=timedelta(minutes=5))
    if ctx.rank == cfg["rank"]:
        if cfg["how"] == "raise":
            raise ValueError(f"rank {ctx.rank} refuses: bad batch 17")
        if (
            cfg["how"] == "raise_unrecordable"
        ):  # its failure record cannot be written (as on a full disk)
            (ctx.run_dir / "logs" / f"rank{ctx.rank}.error.json").mkdir()
            raise ValueError(f"rank {ctx.rank} refuses: bad batch 17")
        if cfg["how"] == "fill_disk":  # nothing more can be written into the run directory
            _fill(ctx.run_dir / "filler")
            raise ValueError(f"rank {ctx.rank} refuses: bad batch 17")
        if cfg["how"] == "raise_timeout_word":
            raise ValueError(f"rank {ctx.rank}: bad timeout value 0")
        if (
            cfg["how"] == "raise_first_attempt"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        ):
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
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "coords": ctx.coords,
        "cp_ranks": ctx.groups["cp"].ranks,
        "has_pp": ctx.pp is not None,
        "run_dir": str(ctx.run_dir),
        "device": str(ctx.device),
        "started": ctx.config["engine"]["order"],
    }


@dataclass
class TickerConfig(TaskConfig):
    """``steps`` steps of ``step_sleep_s`` each, reporting progress and a loss; ``fail_rank`` (if >=
    0) then raises."""

    steps: int = 20
    step_sleep_s: float = 0.2
    fail_rank: int = -1
    hold_until: str = ""  # a file: the last step waits (up to 10 minutes) until it exists


@register_task("ticker", config=TickerConfig)
def ticker(ctx: TaskContext) -> dict[str, Any]:
    """A slow task that reports progress: something to watch live."""
    cfg = ctx.task_config
    for i in range(cfg["steps"]):
        time.sleep(cfg["step_sleep_s"])
        if i == cfg["steps"] - 1 and cfg["hold_until"]:
            deadline = time.monotonic() + 600
            while not Path(cfg["hold_until"]).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        ctx.progress(i + 1, cfg["steps"], loss=round(1.0 / (i + 1), 4))
        if i % 5 == 0:
            ctx.log.info(f"tick {i + 1}")
    if ctx.rank == cfg["fail_rank"]:
        raise ValueError(f"ticker: rank {ctx.rank} fails after {cfg['steps']} steps, as asked")
    ctx.groups["world"].barrier()
    return {"steps": cfg["steps"]}


@register_task("preloaded", preload=("wf_preloaded",))
def preloaded(ctx: TaskContext) -> dict[str, Any]:
    """Which process imported the module this task preloads: the launcher (forked ranks) or the rank
    itself."""
    import wf_preloaded

    return {
        "imported_by": wf_preloaded.IMPORTED_BY,
        "rank_pid": os.getpid(),
        "parent_pid": os.getppid(),
    }


@register_task("listeners")
def listeners(ctx: TaskContext) -> dict[str, Any]:
    """The addresses this rank's process listens on, once the groups are up (a real collective
    first)."""
    import psutil

    ctx.groups["world"].barrier()
    return {
        "listening": sorted(
            f"{c.laddr.ip}:{c.laddr.port}"
            for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        )
    }
