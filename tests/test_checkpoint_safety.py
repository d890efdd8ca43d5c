"""Checkpoints are data and a save never loses one (issue 19, items 1, 7, 8, 9).

- Loading a checkpoint never runs code planted in it: not through DCP's ``.metadata``
  pickle, not through a pickled value inside a ``.distcp`` file.
- A crash at any moment of a save (a step saved a second time included) leaves a
  complete checkpoint to load: proved by killing the saving process at every file
  operation of a save, and with ``kill -9`` at random moments, in loops.
- Pruning follows commit order, not step numbers, and says when steps go backwards.
- The per-rank file is fsynced before ``COMMIT``; an unreadable newest checkpoint makes
  ``load`` fall back to the previous complete one and say why.

Single process, no process group (``Checkpointer`` works the same without one).
"""

from __future__ import annotations

import dataclasses
import io
import multiprocessing as mp
import os
import pickle
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from wf_launch.checkpoint import COMMIT_FILE, Checkpointer, complete_checkpoints

_FORK = mp.get_context("fork")


class _Planted:
    """Unpickling this runs a shell command (what an attacker would plant)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _model(value: float) -> nn.Linear:
    model = nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    return model


def _save(run_dir: Path, step: int, value: float, keep: int = 3, optim: bool = False) -> None:
    model = _model(value)
    state: dict = {"model": model, "meta": {"value": value}}
    if optim:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        state["optim"] = opt
    Checkpointer(run_dir, keep=keep).save(step, state)


def _load(run_dir: Path, keep: int = 3) -> tuple[int | None, float, dict]:
    model, meta = _model(-1.0), {}
    step = Checkpointer(run_dir, keep=keep).load({"model": model, "meta": meta})
    return step, float(model.weight[0, 0]), meta


# ------------------------------------------------------------------ item 1: a checkpoint is data


def test_a_planted_metadata_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    [(_, path)] = complete_checkpoints(tmp_path)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(Exception) as err:
        _load(tmp_path)
    assert not marker.exists(), "loading the checkpoint ran the planted command"
    assert str(path / ".metadata") in str(err.value)
    assert "posix.system" in str(err.value) or "os.system" in str(err.value)


def test_a_planted_pickle_inside_a_distcp_file_is_refused_and_never_runs(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    _save(tmp_path, 1, 1.0, optim=True)
    [(_, path)] = complete_checkpoints(tmp_path)
    metadata = pickle.loads((path / ".metadata").read_bytes())  # the test's own, trusted, read
    key = next(
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    )
    marker = tmp_path / "pwned"
    payload = io.BytesIO()
    torch.save(_Planted(marker), payload)
    (path / "evil.distcp").write_bytes(payload.getvalue())
    for index, info in list(metadata.storage_data.items()):
        if index.fqn == key:
            metadata.storage_data[index] = dataclasses.replace(
                info, relative_path="evil.distcp", offset=0, length=len(payload.getvalue())
            )
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    model = _model(-1.0)
    state = {"model": model, "meta": {}, "optim": torch.optim.AdamW(model.parameters(), lr=1e-3)}
    with pytest.raises(Exception) as err:
        Checkpointer(tmp_path).load(state)
    assert not marker.exists(), "loading the checkpoint ran the planted command"
    assert "evil.distcp" in str(err.value) or str(path) in str(err.value), str(err.value)


# ------------------------------------------------------------------ item 8: prune by commit order


def test_keep_follows_commit_order_and_a_backwards_step_is_reported(tmp_path: Path) -> None:
    from loguru import logger

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        _save(tmp_path, 30, 30.0, keep=1)
        _save(tmp_path, 5, 5.0, keep=1)
    finally:
        logger.remove(sink)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [5]
    assert _load(tmp_path, keep=1)[:2] == (5, 5.0)
    assert any("step 5" in line and "30" in line and "backwards" in line for line in lines), lines


def test_the_newest_commit_loads_even_with_a_smaller_step(tmp_path: Path) -> None:
    for step in (10, 20, 7):
        _save(tmp_path, step, float(step), keep=3)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [
        10,
        20,
        7,
    ]  # commit order, oldest first
    assert _load(tmp_path)[:2] == (7, 7.0)
    _save(tmp_path, 8, 8.0, keep=3)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [20, 7, 8]  # the oldest commit went


# ------------------------------------------------------------------ item 9: fsync, fall back


def test_the_rank_file_is_fsynced_before_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = os.fsync

    def recording_fsync(fd: int) -> None:
        try:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
        real(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    _save(tmp_path, 3, 3.0)
    [(_, path)] = complete_checkpoints(tmp_path)
    names = [Path(p).name for p in synced]
    rank_file = [i for i, n in enumerate(names) if n.startswith("rank_00000.pt")]
    commit = [i for i, n in enumerate(names) if n.startswith(COMMIT_FILE)]
    assert rank_file and commit and rank_file[0] < commit[0], names


@pytest.mark.parametrize("damage", ["rank file", "distcp", "metadata", "commit"])
def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous(
    tmp_path: Path, damage: str
) -> None:
    from loguru import logger

    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 2.0)
    newest = complete_checkpoints(tmp_path)[-1][1]
    target = {
        "rank file": newest / "rank_00000.pt",
        "metadata": newest / ".metadata",
        "commit": newest / COMMIT_FILE,
        "distcp": next(newest.glob("*.distcp")),
    }[damage]
    target.write_bytes(
        target.read_bytes()[: len(target.read_bytes()) // 2]
    )  # a torn write after a power loss
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        step, value, meta = _load(tmp_path)
    finally:
        logger.remove(sink)
    assert (step, value, meta) == (1, 1.0, {"value": 1.0})
    assert any("step 2" in line and "unreadable" in line and "step 1" in line for line in lines), (
        lines
    )


def test_every_checkpoint_unreadable_is_an_error_naming_each(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 2.0)
    for _, path in complete_checkpoints(tmp_path):
        (path / "rank_00000.pt").write_bytes(b"torn")
    with pytest.raises(RuntimeError, match=r"(?s)step 2.*step 1"):
        _load(tmp_path)


# ------------------------------------------------------------------ item 7: a crash never loses the
# checkpoint

_FS_OPS = (
    ("os", "replace"),
    ("os", "rename"),
    ("os", "fsync"),
    ("os", "unlink"),
    ("os", "mkdir"),
    ("os", "rmdir"),
    ("shutil", "rmtree"),
)


def _resave_killed_at(run_dir: str, op_number: int, value: float) -> None:
    """Child: save step 5 again, SIGKILL itself just before file operation number ``op_number``."""
    import importlib

    count = [0]

    def wrap(mod, name):
        real = getattr(mod, name)

        def op(*args, **kwargs):
            count[0] += 1
            if count[0] == op_number:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(mod, name, op)

    for module, name in _FS_OPS:
        wrap(importlib.import_module(module), name)
    _save(Path(run_dir), 5, value, keep=1)
    os._exit(0)


def _loads_a_complete_step_5(run_dir: Path, allowed: set[float]) -> None:
    step, value, meta = _load(run_dir, keep=1)
    assert step == 5 and value in allowed and meta == {"value": value}, (step, value, meta)


@pytest.mark.slow
def test_a_kill_at_every_file_operation_of_a_resave_leaves_a_complete_checkpoint(
    tmp_path: Path,
) -> None:
    template, run = tmp_path / "template", tmp_path / "run"
    _save(template, 5, 1.0, keep=1)
    killed_at = []
    for op_number in range(1, 200):
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(template, run)
        child = _FORK.Process(target=_resave_killed_at, args=(str(run), op_number, 2.0))
        child.start()
        child.join(60)
        if child.exitcode == 0:
            break  # the save finished before operation number op_number: every moment was tried
        assert child.exitcode == -signal.SIGKILL, child.exitcode
        killed_at.append(op_number)
        _loads_a_complete_step_5(run, {1.0, 2.0})
    assert len(killed_at) >= 10, killed_at
    print(f"killed at {len(killed_at)} file operations of a re-save")
    _loads_a_complete_step_5(run, {2.0})


def _resave_forever(run_dir: str) -> None:
    value = 2.0
    while True:
        _save(Path(run_dir), 5, value, keep=1)
        value = 5.0 - value  # 2.0, 3.0, 2.0, ...


@pytest.mark.slow
def test_kill_9_at_random_moments_of_repeated_resaves_never_loses_the_checkpoint(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _save(run, 5, 1.0, keep=1)
    started = time.perf_counter()
    _save(tmp_path / "timing", 5, 1.0, keep=1)
    save_s = time.perf_counter() - started
    rng = random.Random(7)
    for _ in range(25):
        child = _FORK.Process(target=_resave_forever, args=(str(run),))
        child.start()
        time.sleep(rng.uniform(0.05, 0.05 + 3 * save_s))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        _loads_a_complete_step_5(run, {1.0, 2.0, 3.0})
