"""Task ``train``: matches a single-process run, and an interrupted run resumes bitwise.

Multi-rank checks run the real CLI: kill -9 of a rank with ``launcher.max_restarts=1`` (the
restarted ranks resume from the newest checkpoint), and SIGTERM to one rank (the stop flag:
every rank saves and returns; a new start from that checkpoint finishes the run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_helpers import leftover_processes, result, run_cli, start_cli

from wf_launch.checkpoint import complete_checkpoints
from wf_launch.config import ConfigError, EngineConfig
from wf_launch.tasks.train import TrainConfig, make_batch, state_sha256

SAME = ("weights_sha256", "ema_sha256", "final_loss", "loss_curve")


# ------------------------------------------------------------------ single process


@pytest.mark.parametrize(
    "task, engine, fragment",
    [
        ({"steps": 0}, {}, "task.steps=0 is not allowed: expected an integer >= 1"),
        ({"micro_batches": 0}, {}, "task.micro_batches=0 is not allowed"),
        (
            {"micro_batches": 1},
            {"pp_size": 2},
            "task.micro_batches=1 is not allowed: GPipe needs at least one",
        ),
        (
            {"checkpoint_every": -1},
            {},
            "task.checkpoint_every=-1 is not allowed: expected an integer >= 0",
        ),
        ({"keep": 0}, {}, "task.keep=0 is not allowed"),
        ({"lr": 0.0}, {}, "task.lr=0.0 is not allowed: expected a number > 0"),
        ({"step_sleep_s": -1.0}, {}, "task.step_sleep_s=-1.0 is not allowed"),
        ({"loss": "l1"}, {}, "task.loss='l1' is not allowed: choose one of ['flow', 'denoise']"),
        (
            {"depth": 1},
            {"pp_size": 2, "dp_size": 1},
            "task.depth=1 is not allowed: every pipeline stage needs",
        ),
        (
            {"frames": 3, "height": 2},
            {"cp_size": 2},
            "engine.cp_size=2 is not allowed: the sequence of 3 patch frames x 1",
        ),
        ({"heads": 5}, {}, "task.heads=5 is not allowed"),
        ({"global_batch": -1}, {}, "task.global_batch=-1 is not allowed: expected an integer >= 0"),
        (
            {"global_batch": 6},
            {"dp_size": 4},
            "task.global_batch=6 is not allowed: a multiple of engine.dp_size * "
            "task.batch = 4 * 2 = 8",
        ),
        (
            {"global_batch": 4},
            {"pp_size": 2, "dp_size": 2},
            "task.global_batch=4 is not allowed: >= engine.dp_size * "
            "task.batch * engine.pp_size = 8",
        ),
        ({"save_final": "yes"}, {}, "task.save_final='yes' is not allowed"),
    ],
)
def test_bad_values_name_the_field(
    task: dict[str, Any], engine: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_task_config({"name": "train", **task}, EngineConfig(**engine))
    assert fragment in str(err.value)


def test_samples_are_a_pure_function_of_seed_step_and_index_whatever_the_split() -> None:
    cfg = TrainConfig()
    a, b = make_batch(cfg, 3, 0, 4), make_batch(cfg, 3, 0, 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # two replicas of 2 samples (dp=2) or one of 4 (dp=1): the same samples in the same order
    halves = [make_batch(cfg, 3, 0, 2), make_batch(cfg, 3, 2, 2)]
    assert all(torch.equal(x, torch.cat([h[i] for h in halves])) for i, x in enumerate(a))
    for other in (
        make_batch(cfg, 4, 0, 4),
        make_batch(cfg, 3, 1, 4),
        make_batch(TrainConfig(seed=1), 3, 0, 4),
    ):
        assert not torch.equal(a[1], other[1])


def test_the_global_batch_is_fixed_and_each_layout_derives_its_micro_batches() -> None:
    cfg = TrainConfig(batch=2, micro_batches=2)
    assert (
        cfg.default_global_batch(4) == 16
        and TrainConfig(global_batch=12).default_global_batch(4) == 12
    )
    assert [cfg.micro_batches_at(16, dp, 1) for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(
        ConfigError,
        match=r"task.global_batch=16 is not allowed: a multiple of engine.dp_size \* "
        r"task.batch = 3 \* 2 = 6",
    ):
        cfg.micro_batches_at(16, 3, 1)
    with pytest.raises(
        ConfigError,
        match=r"task.global_batch=16 is not allowed: >= engine.dp_size \* task.batch "
        r"\* engine.pp_size = 32",
    ):
        cfg.micro_batches_at(16, 8, 2)


def test_a_resumed_run_keeps_its_global_batch_and_refuses_another() -> None:
    from types import SimpleNamespace

    from wf_launch.tasks.train import _global_batch

    def trainer(cfg: TrainConfig, saved: int | None, dp: int) -> Any:
        return SimpleNamespace(
            cfg=cfg, place=SimpleNamespace(dp_size=dp), progress={"data": {"global_batch": saved}}
        )

    assert (
        _global_batch(trainer(TrainConfig(), None, 4)) == 16
    )  # a fresh start: dp * batch * micro_batches
    assert (
        _global_batch(trainer(TrainConfig(), 16, 2)) == 16
    )  # resumed at dp=2: the run's 16, not 2 * 2 * 2
    assert _global_batch(trainer(TrainConfig(global_batch=16), 16, 2)) == 16
    with pytest.raises(
        ConfigError,
        match="task.global_batch=8 is not allowed: the run being resumed trains with a "
        "global batch of 16",
    ):
        _global_batch(trainer(TrainConfig(global_batch=8), 16, 2))


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


def _kill_rank_after_first_commit(
    proc: Any, run_dir: Path, rank: int, timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout
    pid_file = run_dir / "logs" / f"rank{rank}.pid"
    while not complete_checkpoints(run_dir):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint was committed"
        time.sleep(0.05)
    os.kill(json.loads(pid_file.read_text())["pid"], signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "engine, kill",
    [
        (["engine.cp_size=2", "engine.dp_size=2"], True),
        (
            ["engine.pp_size=2", "engine.dp_size=2"],
            False,
        ),  # kill -9 at pp2 x dp2: tests/test_drill.py
    ],
    ids=["cp2-dp2-async-kill", "pp2-dp2"],
)
def test_matches_single_process_and_a_killed_run_resumes_bitwise(
    tmp_path: Path, engine: list[str], kill: bool
) -> None:
    straight = tmp_path / "straight"
    proc = run_cli(
        ["task=train", *SMALL, *engine, "task.check_reference=true"], straight, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    want = result(straight)["results"]["0"]
    assert want["reference_ok"] is True, want
    assert want["reference_max_abs_err"] <= want["reference_atol"]
    assert want["steps_done"] == 6 and len(want["loss_curve"]) == 6 and want["tokens_per_s"] > 0
    assert want["attempts"] == [{"attempt": 0, "resumed_from": None}]
    if not kill:
        return

    killed = tmp_path / "killed"
    proc = start_cli(
        [
            "task=train",
            *SMALL,
            *engine,
            "task.checkpoint_every=2",
            "task.step_sleep_s=0.5",
            "task.async_save=true",
            "launcher.max_restarts=1",
        ],
        killed,
    )
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


def _wait_for_step(proc: Any, run_dir: Path, rank: int, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    progress = run_dir / "logs" / f"rank{rank}.progress.json"
    while True:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"rank {rank} never reached step {step}"
        try:
            if json.loads(progress.read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_saves_and_returns_and_a_start_from_its_checkpoint_ends_bitwise_equal(
    tmp_path: Path,
) -> None:
    args = ["task=train", "task.steps=6", "task.batch=1", "engine.dp_size=2"]
    proc = run_cli(args, tmp_path / "straight", timeout=300)
    assert proc.returncode == 0, proc.stderr
    want = result(tmp_path / "straight")["results"]["0"]

    stopped = tmp_path / "stopped"
    proc = start_cli([*args, "task.step_sleep_s=0.5"], stopped)
    try:
        _wait_for_step(proc, stopped, rank=1, step=2)
        os.kill(json.loads((stopped / "logs" / "rank1.pid").read_text())["pid"], signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    got = result(stopped)["results"]["0"]
    assert got["stopped"] is True and 2 < got["steps_done"] < 6, got
    assert [s for s, _ in complete_checkpoints(stopped)] == [got["steps_done"]]
    assert got["loss_curve"] == want["loss_curve"][: got["steps_done"]]

    resumed = tmp_path / "resumed"  # a requeued job: the same checkpoints, a new start
    resumed.mkdir()
    shutil.copytree(stopped / "checkpoints", resumed / "checkpoints")
    proc = run_cli(args, resumed, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = result(resumed)["results"]["0"]
    assert res["stopped"] is False and res["steps_done"] == 6
    assert {k: res[k] for k in SAME} == {k: want[k] for k in SAME}
    assert res["attempts"] == [
        {"attempt": 0, "resumed_from": None},
        {"attempt": 1, "resumed_from": got["steps_done"]},
    ]
