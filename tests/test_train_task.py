"""Task ``train``: matches a single-process run, and an interrupted run resumes bitwise.

Multi-rank checks run the real CLI (kill -9 of a rank, ``launcher.max_restarts=1``: the
restarted ranks resume from the newest checkpoint) and the task on forked gloo ranks
(a stop requested on one rank, the way a signal does, agreed by every rank).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_helpers import leftover_processes, result, run_cli, start_cli
from multirank import run_ranks

from wf_launch.checkpoint import complete_checkpoints
from wf_launch.config import ConfigError, EngineConfig
from wf_launch.tasks.train import TrainConfig, make_batch, state_sha256

SAME = ("weights_sha256", "ema_sha256", "final_loss", "loss_curve")


# ------------------------------------------------------------------ single process

@pytest.mark.parametrize("task, engine, fragment", [
    ({"steps": 0}, {}, "task.steps=0 is not allowed: expected an integer >= 1"),
    ({"micro_batches": 0}, {}, "task.micro_batches=0 is not allowed"),
    ({"micro_batches": 1}, {"pp_size": 2}, "task.micro_batches=1 is not allowed: GPipe needs at least one"),
    ({"checkpoint_every": -1}, {}, "task.checkpoint_every=-1 is not allowed: expected an integer >= 0"),
    ({"keep": 0}, {}, "task.keep=0 is not allowed"),
    ({"lr": 0.0}, {}, "task.lr=0.0 is not allowed: expected a number > 0"),
    ({"step_sleep_s": -1.0}, {}, "task.step_sleep_s=-1.0 is not allowed"),
    ({"loss": "l1"}, {}, "task.loss='l1' is not allowed: choose one of ['flow', 'denoise']"),
    ({"depth": 1}, {"pp_size": 2, "dp_size": 1}, "task.depth=1 is not allowed: every pipeline stage needs"),
    ({"frames": 3, "height": 2}, {"cp_size": 2}, "engine.cp_size=2 is not allowed: the sequence of 3 patch frames x 1"),
    ({"heads": 5}, {}, "task.heads=5 is not allowed"),
])
def test_bad_values_name_the_field(task: dict[str, Any], engine: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_task_config({"name": "train", **task}, EngineConfig(**engine))
    assert fragment in str(err.value)


def test_batches_are_a_pure_function_of_seed_step_replica_and_micro_batch() -> None:
    cfg = TrainConfig()
    a, b = make_batch(cfg, 3, 1, 0), make_batch(cfg, 3, 1, 0)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for other in (make_batch(cfg, 4, 1, 0), make_batch(cfg, 3, 0, 0), make_batch(cfg, 3, 1, 1)):
        assert not torch.equal(a[1], other[1])


def test_state_hash_ignores_order_and_sees_every_bit() -> None:
    w = {"b": torch.ones(2, 3), "a": torch.arange(4.0)}
    assert state_sha256(w) == state_sha256(dict(reversed(w.items())))
    flipped = {**w, "a": w["a"].clone()}
    flipped["a"].view(torch.int32)[0] ^= 1
    assert state_sha256(flipped) != state_sha256(w)


@pytest.mark.slow
def test_cli_refuses_bad_values_before_any_rank_starts(tmp_path: Path) -> None:
    proc = run_cli(["task=train", "task.micro_batches=1", "engine.pp_size=2"], tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    assert "task.micro_batches=1 is not allowed" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()


# ------------------------------------------------------------------ multi-rank, real CLI

SMALL = ["task.steps=6", "task.batch=1"]


def _kill_rank_after_first_commit(proc: Any, run_dir: Path, rank: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    pid_file = run_dir / "logs" / f"rank{rank}.pid"
    while not complete_checkpoints(run_dir):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint was committed"
        time.sleep(0.05)
    os.kill(json.loads(pid_file.read_text())["pid"], signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("engine, async_save", [
    (["engine.cp_size=2", "engine.dp_size=2"], True),
    (["engine.pp_size=2", "engine.dp_size=2"], False),
], ids=["cp2-dp2-async", "pp2-dp2"])
def test_matches_single_process_and_a_killed_run_resumes_bitwise(tmp_path: Path, engine: list[str],
                                                                  async_save: bool) -> None:
    straight = tmp_path / "straight"
    proc = run_cli(["task=train", *SMALL, *engine, "task.check_reference=true"], straight, timeout=300)
    assert proc.returncode == 0, proc.stderr
    want = result(straight)["results"]["0"]
    assert want["reference_ok"] is True, want
    assert want["reference_max_abs_err"] <= want["reference_atol"]
    assert want["steps_done"] == 6 and len(want["loss_curve"]) == 6 and want["tokens_per_s"] > 0
    assert want["attempts"] == [{"attempt": 0, "resumed_from": None}]

    killed = tmp_path / "killed"
    proc = start_cli(["task=train", *SMALL, *engine, "task.checkpoint_every=2", "task.step_sleep_s=0.5",
                      f"task.async_save={str(async_save).lower()}", "launcher.max_restarts=1"], killed)
    try:
        _kill_rank_after_first_commit(proc, killed, rank=1)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    got = result(killed)["results"]["0"]
    assert {k: got[k] for k in SAME} == {k: want[k] for k in SAME}
    first, second = got["attempts"]
    assert first == {"attempt": 0, "resumed_from": None}
    assert second["attempt"] == 1 and second["resumed_from"] in (2, 4)
    assert leftover_processes(str(killed)) == []


# ------------------------------------------------------------------ multi-rank, the stop flag

def _run_train(rank: int, world_size: int, engine: dict[str, Any], task: dict[str, Any], run_dir: str,
               stop_at: int | None) -> Any:
    """One rank of task ``train``; rank 1 asks to stop after step ``stop_at`` (as a signal would)."""
    from loguru import logger

    from wf_launch.tasks.context import build_context
    from wf_launch.tasks.registry import get_task
    from worldfoundry.core.distributed import destroy_model_parallel, dist_init

    eng = {"distributed_backend": "gloo", "distributed_timeout_minutes": 1.0, **engine}
    device = dist_init({"engine_config": eng})
    try:
        ctx = build_context({"engine": eng, "task": {"name": "train", **task}}, Path(run_dir), device, logger)

        def report(step: int, total: int | None = None, **metrics: Any) -> None:
            if step == stop_at and rank == 1:
                ctx.stop.request("test")

        ctx.reporter = report
        value = get_task("train")(ctx)
        ctx.checkpoint.close()
        ctx.stop.drain()
        return value
    finally:
        destroy_model_parallel()


@pytest.mark.slow
def test_a_stop_saves_returns_and_the_next_start_resumes_bitwise(tmp_path: Path) -> None:
    engine, task = {"dp_size": 2}, {"steps": 5, "batch": 1}

    def launch(run_dir: Path, stop_at: int | None) -> dict[str, Any]:
        return run_ranks(_run_train, 2, engine, task, str(run_dir), stop_at, init=False, timeout=180)[0]

    want = launch(tmp_path / "straight", None)
    stopped = launch(tmp_path / "stopped", 2)
    assert stopped["stopped"] is True and stopped["steps_done"] == 3  # asked during step 2, agreed after 3
    assert [s for s, _ in complete_checkpoints(tmp_path / "stopped")] == [3]
    resumed = launch(tmp_path / "stopped", None)
    assert resumed["stopped"] is False and resumed["steps_done"] == 5
    assert {k: resumed[k] for k in SAME} == {k: want[k] for k in SAME}
    assert resumed["attempts"] == [{"attempt": 0, "resumed_from": None}, {"attempt": 1, "resumed_from": 3}]
