"""``python -m wf_launch.checkpoint list|export`` on single-process checkpoints, bad inputs, and
format-1 checkpoints.

(The multi-rank export, against weights gathered in-process, is in tests/test_reshard.py.)
"""

from __future__ import annotations

import json
import pickle
import random
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from wf_launch.checkpoint import Checkpointer, complete_checkpoints
from wf_launch.readers.checkpoint import main


class Net(nn.Module):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(value)


def _save(run: Path, step: int, value: float) -> None:
    Checkpointer(run, keep=5).save(
        step, {"model": Net(value), "ema": Net(value / 2), "meta": {"v": value}}
    )


def test_export_writes_plain_full_tensors_of_the_chosen_step_and_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 3, 3.0)
    _save(tmp_path, 7, 7.0)
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "m.pt")]) == 0
    assert (
        "exported entry 'model' of step 7 (saved at tp=1 cp=1 pp=1 dp=1" in capsys.readouterr().out
    )
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert sorted(state) == ["body.bias", "body.weight", "head.bias", "head.weight"]
    assert all(
        type(t) is torch.Tensor and torch.equal(t, torch.full_like(t, 7.0)) for t in state.values()
    )
    assert (
        main(["export", str(tmp_path), "--step", "3", "--ema", "--out", str(tmp_path / "e.pt")])
        == 0
    )
    ema = torch.load(tmp_path / "e.pt", weights_only=True)
    assert all(torch.equal(t, torch.full_like(t, 1.5)) for t in ema.values())
    fresh = Net(0.0)
    fresh.load_state_dict(
        torch.load(tmp_path / "m.pt", weights_only=True)
    )  # loads into the full model as is


@pytest.mark.parametrize(
    "args, message",
    [
        (["--step", "5"], "--step 5: no complete checkpoint of that step; complete steps: [3]"),
        (
            ["--entry", "nope"],
            "--entry nope: no such module entry; module entries: ['ema', 'model']",
        ),
        (["--entry", "meta"], "--entry meta: no such module entry"),
    ],
)
def test_export_refuses_what_is_not_there(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 3, 3.0)
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "x.pt"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.pt").exists()


def test_export_of_a_run_without_checkpoints_or_a_tampered_one_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path / "missing"), "--out", "x.pt"]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--out", "x.pt"]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    _save(tmp_path, 1, 1.0)
    [(_, path)] = complete_checkpoints(tmp_path)
    (path / ".metadata").write_bytes(
        pickle.dumps(random.Random)
    )  # a global the reader does not admit
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "x.pt")]) == 2
    assert "refused to unpickle random.Random" in capsys.readouterr().err


def test_list_shows_every_checkpoint_in_commit_order_with_its_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save(tmp_path, 20, 1.0)
    _save(tmp_path, 10, 2.0)  # a lower step committed later: it is the newer checkpoint
    (
        tmp_path / "checkpoints" / ".step_00000030.tmp-0123456789abcdef"
    ).mkdir()  # a save a crash left
    assert main(["list", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "commit", "saved", "at", "size", "layout", "state"]
    assert [line.split()[:2] for line in lines[1:]] == [["20", "1"], ["10", "2"], ["30", "-"]]
    assert "tp=1 cp=1 pp=1 dp=1 (order tp-cp-pp-dp, 1 ranks)  complete" in lines[1]
    assert lines[3].endswith("incomplete (a save in progress, or one a crash left; never loaded)")
    assert main(["list", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["complete"], r["seq"]) for r in rows] == [
        (20, True, 1),
        (10, True, 2),
        (30, False, None),
    ]
    assert rows[0]["layout"] == {
        "tp": 1,
        "cp": 1,
        "pp": 1,
        "dp": 1,
        "order": "tp-cp-pp-dp",
        "world_size": 1,
    }


def test_a_format_1_checkpoint_still_loads_on_its_own_layout(tmp_path: Path) -> None:
    """A checkpoint written before layouts were recorded (nested optimizer state, per-rank entries,
    no format)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = Net(1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model.head(model.body(torch.ones(2, 3))).sum().backward()
    opt.step()
    directory = tmp_path / "checkpoints" / "step_00000004"
    dcp.save(
        {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=str(directory),
        no_dist=True,
    )
    torch.save(
        {
            "rank": 0,
            "world_size": 1,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "generators": {},
            "stateful": {},
            "plain": {"meta": {"v": 4}},
        },
        directory / "rank_00000.pt",
    )
    expect = torch.rand(3)
    (directory / "COMMIT").write_text(
        json.dumps({"step": 4, "world_size": 1, "time": time.time()}) + "\n"
    )
    fresh = Net(0.0)
    state = {"model": fresh, "optim": torch.optim.AdamW(fresh.parameters(), lr=0.1), "meta": {}}
    ckpt = Checkpointer(tmp_path)
    assert ckpt.load(state) == 4 and state["meta"] == {"v": 4}
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    assert state["optim"].param_groups[0]["lr"] == 0.5
    assert torch.equal(
        state["optim"].state[fresh.body.weight]["exp_avg"], opt.state[model.body.weight]["exp_avg"]
    )
    assert (
        torch.equal(torch.rand(3), expect) and not ckpt.last_load.changed
    )  # its RNG state came back
