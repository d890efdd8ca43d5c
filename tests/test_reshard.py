"""Checkpoints that reshard: saved at one layout, loaded at another, on real gloo groups (FSDP2 on
CPU).

Each case saves a pipeline-staged, FSDP2-sharded model, its EMA, AdamW state and
per-rank entries at one layout (asynchronously where marked), then loads the checkpoint
at another layout (dp, cp, pp, world size) in a fresh process group. Resharding moves
data and does no arithmetic, so the loaded full state (gathered per global parameter
name) must equal the saved one bitwise: weights, EMA, every optimizer statistic. The
per-rank entries follow their scope; a per-rank entry that cannot follow the layout
change is refused on every rank, naming the entry and both layouts. ``export`` (the real
CLI, no process group) writes exactly the weights gathered in-process (the pp2 x dp2 case).
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_helpers import cli_env
from multirank import run_ranks
from torch import nn

from wf_launch.checkpoint import Checkpointer, CheckpointRefused

pytestmark = pytest.mark.slow
DIM, DEPTH = 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Stage(nn.Module):
    """Blocks ``ids`` of a DEPTH-block model (+ the head on the last stage), named as the full model
    names them."""

    def __init__(self, ids: list[int], last: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        full = nn.ModuleList(Block() for _ in range(DEPTH))
        head = nn.Linear(DIM, 1)
        self.ids = ids
        self.blocks = nn.ModuleList(full[i] for i in ids)
        self.head = head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def global_name(self, name: str) -> str:
        if name.startswith("blocks."):
            _, local, rest = name.split(".", 2)
            return f"blocks.{self.ids[int(local)]}.{rest}"
        return name


def _setup(cp: int, pp: int, dp: int) -> tuple[Any, Stage, Stage, torch.optim.Optimizer]:
    """This rank's stage, FSDP2 over its stage's dp x cp ranks; the layout (given to the
    Checkpointer)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from worldfoundry.core.distributed.fsdp import fsdp2_wrap
    from worldfoundry.core.distributed.topology import Layout

    layout = Layout(cp * pp * dp, cp_size=cp, pp_size=pp, dp_size=dp)
    rank = dist.get_rank()
    shard = None
    for members in layout.groups("dp-cp"):  # every rank creates every group, in the same order
        group = dist.new_group(members)
        if rank in members:
            shard = group
    stage_id = layout.coords(rank)["pp"]
    per = DEPTH // pp
    model = Stage(list(range(stage_id * per, (stage_id + 1) * per)), stage_id == pp - 1)
    ema = copy.deepcopy(model).requires_grad_(False)
    mesh = DeviceMesh.from_group(shard, "cpu", mesh_dim_names=("dp_cp",))
    fsdp2_wrap(model, mesh=mesh)
    fsdp2_wrap(ema, mesh=mesh)
    return layout, model, ema, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: Stage, ema: Stage, opt: torch.optim.Optimizer, steps: int) -> None:
    from worldfoundry.core.distributed.ema import DTensorFastEmaModelUpdater

    updater = DTensorFastEmaModelUpdater()
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(steps):
        model(torch.randn(4, DIM, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        updater.update_average(model, ema, beta=0.9)


def _full(model: Stage, ema: Stage, opt: torch.optim.Optimizer) -> bytes:
    """This rank's stage, in full tensors under global names: weights, EMA, optimizer state
    (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    def full(t: Any) -> Any:
        return (
            t.full_tensor().clone()
            if hasattr(t, "full_tensor")
            else t.clone()
            if torch.is_tensor(t)
            else t
        )

    osd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    out = {
        "model": {model.global_name(k): full(v) for k, v in model.named_parameters()},
        "ema": {ema.global_name(k): full(v) for k, v in ema.named_parameters()},
        "optim": {
            _global_optim_key(model, k): full(v) for k, v in osd.items() if k.startswith("state.")
        },
    }
    buf = io.BytesIO()
    torch.save(out, buf)
    return buf.getvalue()


def _global_optim_key(model: Stage, key: str) -> str:
    head, rest = key.split(".", 1)
    fqn, stat = rest.rsplit(".", 1)
    return f"{head}.{model.global_name(fqn)}.{stat}"


def _save_at(
    rank: int, world: int, run_dir: str, sizes: tuple[int, int, int], async_save: bool
) -> bytes:
    layout, model, ema, opt = _setup(*sizes)
    _train(model, ema, opt, 2)
    dp = layout.coords(rank)["dp"]
    state = {
        "model": model,
        "ema": ema,
        "optim": opt,
        "progress": {"step": 2, "seen": [1, 2]},
        "data": torch.Generator().manual_seed(100 + dp),
        "mine": {"rank": rank},
    }
    ckpt = Checkpointer(run_dir, keep=2, async_save=async_save, seed=5, layout=layout)
    ckpt.save(2, state, scopes={"progress": "replicated", "data": "dp"})
    full = _full(
        model, ema, opt
    )  # after the save returned: an async snapshot must not see later changes
    _train(model, ema, opt, 1)
    ckpt.close()
    return full


def _load_at(
    rank: int, world: int, run_dir: str, sizes: tuple[int, int, int], remap: bool
) -> dict[str, Any]:
    layout, model, ema, opt = _setup(*sizes)
    state = {
        "model": model,
        "ema": ema,
        "optim": opt,
        "progress": {},
        "data": torch.Generator().manual_seed(7),
    }
    fns = {"data": lambda saved, dp, dp_size: saved[dp % len(saved)]} if remap else None
    ckpt = Checkpointer(run_dir, seed=5, layout=layout)
    try:  # with the per-rank entry 'mine': a layout change cannot serve it
        ckpt.load({**state, "mine": {}}, remap=fns)
        refused = "loaded"
    except CheckpointRefused as exc:
        refused = str(exc)
    step = ckpt.load(state, remap=fns)
    report = ckpt.last_load
    return {
        "refused": refused,
        "step": step,
        "full": _full(model, ema, opt),
        "progress": state["progress"],
        "data": state["data"].get_state().tolist(),
        "rng": report.rng,
        "rederived": report.rederived,
        "remapped": report.remapped,
        "changed": report.changed,
        "dp": layout.coords(rank)["dp"],
        "draw": torch.rand(1).item(),
    }


def _merged(parts: list[bytes]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {"model": {}, "ema": {}, "optim": {}}
    for part in parts:
        for kind, tensors in torch.load(io.BytesIO(part), weights_only=True).items():
            for name, t in tensors.items():
                if name in out[kind]:  # replicas must agree
                    assert torch.equal(out[kind][name], t), f"{kind}.{name} differs between ranks"
                out[kind][name] = t
    return out


def _assert_same_state(
    saved: dict[str, dict[str, torch.Tensor]], loaded: dict[str, dict[str, torch.Tensor]]
) -> None:
    for kind in ("model", "ema", "optim"):
        assert sorted(saved[kind]) == sorted(loaded[kind]), kind
        for name, t in saved[kind].items():
            assert torch.equal(t, loaded[kind][name]), f"{kind}.{name} changed across the reshard"
    assert any(".blocks.3." in k for k in saved["optim"]) and len(saved["model"]) == 4 * DEPTH + 2


def _describe(sizes: tuple[int, int, int]) -> str:
    cp, pp, dp = sizes
    return f"tp=1 cp={cp} pp={pp} dp={dp} (order tp-cp-pp-dp, {cp * pp * dp} ranks)"


def _assert_export(run_dir: Path, gathered: dict[str, dict[str, torch.Tensor]]) -> None:
    """``python -m wf_launch.checkpoint export`` (no process group) writes exactly the weights
    gathered in-process (the command in a subprocess for the model; its ``main`` in this process for
    the EMA)."""
    from wf_launch.readers.checkpoint import main

    for flag, kind in (([], "model"), (["--ema"], "ema")):
        out = run_dir / f"{kind}.pt"
        if kind == "model":
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "wf_launch.checkpoint",
                    "export",
                    str(run_dir),
                    "--out",
                    str(out),
                    *flag,
                ],
                capture_output=True,
                text=True,
                env=cli_env(),
                timeout=120,
            )
            assert proc.returncode == 0, proc.stderr
            assert f"exported entry '{kind}' of step 2 (saved at tp=1 cp=1 pp=2 dp=2" in proc.stdout
        else:
            assert main(["export", str(run_dir), "--out", str(out), *flag]) == 0
        exported = torch.load(out, weights_only=True)
        assert sorted(exported) == sorted(gathered[kind])
        assert all(
            type(t) is torch.Tensor and torch.equal(t, gathered[kind][k])
            for k, t in exported.items()
        )


def _generator_state(seed: int) -> list[int]:
    return (
        torch.Generator().manual_seed(seed).get_state().tolist()
    )  # plain ints cross the result queue


# (saved at cp, pp, dp), (loaded at cp, pp, dp), async save, remap the dp-scoped generator
CASES = [
    ((1, 1, 4), (1, 1, 2), True, False),  # dp4 -> dp2: a smaller world
    ((1, 1, 2), (1, 1, 4), False, True),  # dp2 -> dp4: a larger world
    ((2, 1, 2), (1, 1, 4), True, False),  # cp2 x dp2 -> dp4: FSDP2 on another mesh
    ((1, 2, 2), (1, 1, 4), True, True),  # pp2 x dp2 -> pp1 x dp4: the stages merge (and export)
    ((1, 1, 4), (1, 2, 2), False, False),  # and back: pp1 x dp4 -> pp2 x dp2
]


@pytest.mark.parametrize(
    "before, after, async_save, remap",
    CASES,
    ids=["dp4-dp2", "dp2-dp4", "cp2dp2-dp4", "pp2dp2-dp4", "dp4-pp2dp2"],
)
def test_a_checkpoint_loads_bitwise_at_another_layout(
    tmp_path: Path,
    before: tuple[int, int, int],
    after: tuple[int, int, int],
    async_save: bool,
    remap: bool,
) -> None:
    run_dir = str(tmp_path)
    saved = _merged(
        run_ranks(
            _save_at, before[0] * before[1] * before[2], run_dir, before, async_save, timeout=90
        )
    )
    world_after = after[0] * after[1] * after[2]
    got = run_ranks(_load_at, world_after, run_dir, after, remap, timeout=90)
    for r in got:  # every rank refuses the per-rank entry, naming it, its scope and both layouts
        assert "entry 'mine' has scope 'rank'" in r["refused"], r["refused"]
        assert (
            f"saved at {_describe(before)} and this run's layout is {_describe(after)}"
            in r["refused"]
        )
    _assert_same_state(saved, _merged([r["full"] for r in got]))
    for r in got:
        assert (
            r["step"] == 2 and r["changed"] and r["progress"] == {"step": 2, "seen": [1, 2]}
        )  # replicated
        assert r["rng"].startswith("re-derived from seed 5, step 2 and rank")
    assert (
        len({r["draw"] for r in got}) == world_after
    )  # re-derived per rank: every rank draws its own numbers
    if before == (1, 2, 2):
        _assert_export(tmp_path, saved)
    dp_changed = before[2] != after[2]
    for r in got:
        if not dp_changed:  # the same dp index: the replica's own saved stream
            assert r["data"] == _generator_state(100 + r["dp"]) and not r["rederived"]
        elif remap:  # the task's mapping of the saved replicas
            assert r["remapped"] == ["data"] and r["data"] == _generator_state(
                100 + r["dp"] % before[2]
            )
        else:  # re-derived: the value the task built for the new layout stays
            assert r["rederived"] == ["data"] and r["data"] == _generator_state(7)
