"""wf_launch.checkpoint.Checkpointer on real multi-process gloo groups (FSDP2 on CPU).

Ranks run through ``run_ranks``, which leaves every rank through ``os._exit`` after
flushing its result, so FSDP2's occasional abort at interpreter exit (see
/work/shared/notes/torch-quirks.md) cannot fail these tests.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest
import torch
from multirank import run_ranks
from torch import nn

from wf_launch.checkpoint import COMMIT_FILE, Checkpointer, complete_checkpoints

DIM, LAYERS, BATCH = 16, 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _build(rank: int):
    from worldfoundry.core.distributed.fsdp import fsdp2_wrap

    torch.manual_seed(1234)
    model = MLP()
    ema = copy.deepcopy(model).requires_grad_(False)
    fsdp2_wrap(model)
    fsdp2_wrap(ema)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    torch.manual_seed(100 + rank)  # per-rank global RNG (noise below)
    data = torch.Generator().manual_seed(7 + rank)  # per-rank seeded data stream
    return model, ema, opt, data


def _train(model, ema, opt, data, steps: int, progress: dict) -> None:
    from worldfoundry.core.distributed.ema import DTensorFastEmaModelUpdater

    updater = DTensorFastEmaModelUpdater()
    for _ in range(steps):
        x = torch.randn(BATCH, DIM, generator=data)
        y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(BATCH, 1)  # global RNG: noise
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        updater.update_average(model, ema, beta=0.9)
        progress["step"] += 1
        progress["seen"] += BATCH


def _snapshot(model, ema, opt, progress) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from worldfoundry.core.distributed.ema import get_local_tensor_if_dtensor

    def local(sd):
        return {
            k: get_local_tensor_if_dtensor(v).clone() if isinstance(v, torch.Tensor) else v
            for k, v in sd.items()
        }

    osd = get_optimizer_state_dict(model, opt)
    return _portable(
        {
            "model": local(model.state_dict()),
            "ema": local(ema.state_dict()),
            "optim": {k: local(v) for k, v in osd["state"].items()},
            "lr": [g["lr"] for g in osd["param_groups"]],
            "progress": dict(progress),
            "draw": torch.rand(8),  # the global RNG after training
        }
    )


def _portable(obj) -> bytes:
    """Tensors cross the result queue as bytes (a shared-memory handle dies with the rank)."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unport(data: bytes):
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


def _run_straight(rank: int, world: int, steps: int) -> dict:
    model, ema, opt, data = _build(rank)
    progress = {"step": 0, "seen": 0}
    _train(model, ema, opt, data, 2 * steps, progress)
    return _snapshot(model, ema, opt, progress)


def _run_first_half(rank: int, world: int, run_dir: str, steps: int, async_save: bool) -> None:
    model, ema, opt, data = _build(rank)
    progress = {"step": 0, "seen": 0}
    ckpt = Checkpointer(run_dir, keep=2, async_save=async_save)
    assert ckpt.load({"model": model}) is None  # fresh start
    _train(model, ema, opt, data, steps, progress)
    ckpt.save(steps, {"model": model, "ema": ema, "optim": opt, "data": data, "progress": progress})
    _train(model, ema, opt, data, 1, progress)  # work after the save must not leak into it
    ckpt.close()


def _run_second_half(rank: int, world: int, run_dir: str, steps: int) -> dict:
    model, ema, opt, data = _build(rank)
    torch.manual_seed(999)  # scramble the RNG: load must restore it
    progress = {"step": -1, "seen": -1}
    state = {"model": model, "ema": ema, "optim": opt, "data": data, "progress": progress}
    step = Checkpointer(run_dir).load(state)
    assert step == steps and state["progress"] is progress and progress["step"] == steps
    _train(model, ema, opt, data, steps, progress)
    return _snapshot(model, ema, opt, progress)


def _assert_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True])
def test_fsdp2_resume_is_bitwise_identical(tmp_path: Path, async_save: bool) -> None:
    steps = 3
    straight = [_unport(r) for r in run_ranks(_run_straight, 2, steps)]
    run_ranks(_run_first_half, 2, str(tmp_path), steps, async_save)
    [(saved, path)] = complete_checkpoints(tmp_path)
    assert saved == steps and path.name == "step_00000003" and (path / COMMIT_FILE).is_file()
    assert sorted(p.name for p in path.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    resumed = [_unport(r) for r in run_ranks(_run_second_half, 2, str(tmp_path), steps)]
    for rank in range(2):
        _assert_equal(straight[rank], resumed[rank], f"rank{rank}")
    assert not torch.equal(
        straight[0]["draw"], straight[1]["draw"]
    )  # per-rank RNG really is per rank


def _plain_roundtrip(rank: int, world: int, run_dir: str, saves: list[int], keep: int) -> dict:
    model = nn.Linear(3, 3)
    ckpt = Checkpointer(run_dir, keep=keep)
    for s in saves:
        with torch.no_grad():
            model.weight.fill_(s)
        ckpt.save(s, {"model": model, "meta": {"step": s, "rank": rank}})
    fresh, meta = nn.Linear(3, 3), {}
    step = ckpt.load({"model": fresh, "meta": meta})
    return {"step": step, "meta": meta, "w": float(fresh.weight[0, 0])}


@pytest.mark.slow
def test_keep_only_the_newest(tmp_path: Path) -> None:
    res = run_ranks(_plain_roundtrip, 2, str(tmp_path), [1, 2, 3, 4, 5], 2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 5]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000004",
        "step_00000005",
    ]
    for rank, r in enumerate(res):
        assert r == {
            "step": 5,
            "meta": {"step": 5, "rank": rank},
            "w": 5.0,
        }  # per-rank state back to its rank


@pytest.mark.slow
def test_uncommitted_checkpoints_are_ignored_and_cleaned(tmp_path: Path) -> None:
    run_ranks(_plain_roundtrip, 2, str(tmp_path), [1, 2], 5)
    root = tmp_path / "checkpoints"
    # a crash mid-save: a half-written temp dir, and a renamed step dir whose COMMIT was never
    # written
    (root / ".step_00000007.tmp-deadbeef").mkdir()
    (root / ".step_00000007.tmp-deadbeef" / "__0_0.distcp").write_bytes(b"partial")
    half = root / "step_00000009"
    import shutil

    shutil.copytree(root / "step_00000002", half)
    (half / COMMIT_FILE).unlink()
    res = run_ranks(_plain_roundtrip, 2, str(tmp_path), [], 5)
    assert [r["step"] for r in res] == [2, 2] and res[0]["w"] == 2.0
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001", "step_00000002"]


def _async_timing(rank: int, world: int, run_dir: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(12)))  # ~50 MB fp32
    ckpts = {
        mode: Checkpointer(os.path.join(run_dir, str(mode)), keep=1, async_save=mode)
        for mode in (False, True)
    }
    for ckpt in ckpts.values():
        ckpt.save(0, {"model": model})  # warm-up (async: the checkpoint group, the staging buffers)
        ckpt.wait()
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in (1, 2, 3, 4):  # interleaved, so that a burst of load on the host hits both modes
        for mode, ckpt in ckpts.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ckpt.save(step, {"model": model})
            times[mode].append(time.perf_counter() - t0)
            with torch.no_grad():  # the "next step" mutates the weights while the async write runs
                for p in model.parameters():
                    p.add_(1.0)
            ckpt.wait()
            with torch.no_grad():
                for p in model.parameters():
                    p.sub_(1.0)
    for ckpt in ckpts.values():
        ckpt.close()
    fresh = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(12)))
    step = Checkpointer(os.path.join(run_dir, "True")).load({"model": fresh})
    same = all(
        torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values())
    )
    return {"sync": min(times[False]), "async": min(times[True]), "step": step, "same": same}


@pytest.mark.slow
def test_async_save_commits_later_and_does_not_block_the_step(tmp_path: Path) -> None:
    res = run_ranks(_async_timing, 2, str(tmp_path), timeout=180)
    for r in res:
        assert (
            r["step"] == 4 and r["same"]
        )  # the snapshot was taken at save(): later updates did not leak in
    assert [s for s, _ in complete_checkpoints(tmp_path / "True")] == [4]
    # blocked time of the async save vs the synchronous save of the same tensors (best of 4, the
    # two modes interleaved), as a ratio only
    assert max(r["async"] for r in res) < 0.6 * min(r["sync"] for r in res), res


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep=0"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="keep=True"):
        Checkpointer(tmp_path, keep=True)
    with pytest.raises(ValueError, match="async_save='yes'"):
        Checkpointer(tmp_path, async_save="yes")
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(ValueError, match="step=-1"):
        ckpt.save(-1, {})
    with pytest.raises(ValueError, match="step=1.5"):
        ckpt.save(1.5, {})
    with pytest.raises(ValueError, match="state must be a dict"):
        ckpt.save(1, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="state must be a dict"):
        ckpt.load(None)
    with pytest.raises(ValueError, match=r"state\['fn'\] is of type function"):
        ckpt.save(1, {"fn": lambda: 0})
    with pytest.raises(ValueError, match=r"state\['cfg'\]\['x'\] is of type object"):
        ckpt.save(1, {"cfg": {"x": object()}})
    with pytest.raises(
        ValueError, match=r"state\['opt'\] is an optimizer whose parameters belong to no"
    ):
        ckpt.save(1, {"opt": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)})
    with pytest.raises(
        ValueError,
        match=r"scopes\['data'\]='x' is not allowed: choose one of \['replicated', 'dp', 'rank'\]",
    ):
        ckpt.save(1, {"data": {"a": 1}}, scopes={"data": "x"})
    with pytest.raises(
        ValueError, match=r"scopes\['model'\]: 'model' is a module or optimizer: DCP shards it"
    ):
        ckpt.save(1, {"model": nn.Linear(2, 2)}, scopes={"model": "replicated"})
    with pytest.raises(
        ValueError, match=r"scopes\['gone'\]: no entry 'gone' in state \(entries: \['data'\]\)"
    ):
        ckpt.save(1, {"data": 1}, scopes={"gone": "rank"})
    with pytest.raises(ValueError, match=r"remap\['data'\]=3 must be callable"):
        ckpt.load({"data": 1}, remap={"data": 3})
    with pytest.raises(ValueError, match=r"seed='0' must be an int"):
        Checkpointer(tmp_path, seed="0")
    assert not (tmp_path / "checkpoints").exists()  # nothing was written


def test_single_process_roundtrip_without_a_group(tmp_path: Path) -> None:
    model, gen = nn.Linear(2, 2), torch.Generator().manual_seed(3)
    ckpt = Checkpointer(tmp_path, keep=1)
    assert ckpt.load({"model": model}) is None
    ckpt.save(4, {"model": model, "gen": gen, "n": 7})
    expect = torch.rand(3, generator=gen), torch.rand(3)
    state = {"model": nn.Linear(2, 2), "gen": torch.Generator(), "n": 0}
    assert ckpt.load(state) == 4 and state["n"] == 7
    assert torch.equal(state["model"].weight, model.weight)
    got = torch.rand(3, generator=state["gen"]), torch.rand(3)
    assert all(torch.equal(a, b) for a, b in zip(expect, got))


def _async_dies_before_commit(rank: int, world: int, run_dir: str) -> list:
    model = nn.Linear(3, 3)
    ckpt = Checkpointer(run_dir, keep=3, async_save=True)
    seen = []
    for s in (1, 2):
        with torch.no_grad():
            model.weight.fill_(s)
        ckpt.save(s, {"model": model, "meta": {"step": s, "rank": rank}})
        seen.append(
            [step for step, _ in complete_checkpoints(run_dir)]
        )  # the previous one commits here
    future, _, _ = ckpt._pending
    future.result()  # step 2's files are written, then the job "dies" before anything commits it
    return seen


@pytest.mark.slow
def test_async_save_is_committed_only_by_the_next_call(tmp_path: Path) -> None:
    seen = run_ranks(_async_dies_before_commit, 2, str(tmp_path))
    assert seen[0] == [
        [],
        [1],
    ]  # save(2) committed step 1 first; step 1 was not committed by its own save
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1]
    res = run_ranks(_plain_roundtrip, 2, str(tmp_path), [], 3)
    assert [r["step"] for r in res] == [1, 1] and res[0][
        "w"
    ] == 1.0  # the written-but-uncommitted 2 is ignored
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]


def _mismatched_steps(rank: int, world: int, run_dir: str) -> str:
    try:
        Checkpointer(run_dir).save(rank, {"model": nn.Linear(2, 2)})
    except ValueError as e:
        return str(e)
    return "no error"


def _load_one(rank: int, world: int, run_dir: str) -> str:
    try:
        Checkpointer(run_dir).load({"model": nn.Linear(3, 3), "meta": {}})
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_collective_errors_reach_every_rank(tmp_path: Path) -> None:
    msgs = run_ranks(_mismatched_steps, 2, str(tmp_path / "a"))
    assert all("every rank must save the same step" in m for m in msgs), msgs
    run_ranks(_plain_roundtrip, 2, str(tmp_path / "b"), [1], 2)
    [msg] = run_ranks(
        _load_one, 1, str(tmp_path / "b")
    )  # 'meta' is per rank: it cannot follow a layout change
    assert "entry 'meta' has scope 'rank'" in msg and "saved at tp=1 cp=1 pp=1 dp=2" in msg, msg
    assert "this run's layout is tp=1 cp=1 pp=1 dp=1" in msg, msg


def test_a_parameter_that_never_had_optimizer_state_still_loads(tmp_path: Path) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(2, 2), nn.Linear(2, 2)

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.used(torch.ones(1, 2)).sum().backward()
    opt.step()  # 'unused' gets no gradient, so AdamW keeps no state for it
    Checkpointer(tmp_path).save(1, {"model": model, "optim": opt})
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert Checkpointer(tmp_path).load({"model": fresh, "optim": fresh_opt}) == 1
    assert torch.equal(
        fresh_opt.state[fresh.used.weight]["exp_avg"], opt.state[model.used.weight]["exp_avg"]
    )
    assert not fresh_opt.state[fresh.unused.weight][
        "exp_avg"
    ].any()  # a fresh state: what a first update starts from
