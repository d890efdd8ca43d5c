"""Built-in tasks (demo, layout, noop) on real gloo ranks, plus the demo model's single-process
pieces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from multirank import run_ranks

from wf_launch.config import ConfigError
from wf_launch.tasks._vdit import PatchGridSplit, patchify, stage_blocks, unpatchify
from wf_launch.tasks.demo import DemoTaskConfig, plan_split
from worldfoundry.core.distributed.topology import Layout

SMALL = {"height": 16, "width": 16, "warmup": 1, "repeats": 1}
"""Demo sizes for tests: 6 x 8 x 8 = 384 tokens, so 8 ranks fit on 2 cores in a few seconds."""


def _run_task(
    rank: int, world_size: int, name: str, engine: dict[str, Any], task: dict[str, Any]
) -> Any:
    """On one rank: dist_init, build the context, run task ``name``, tear down."""
    from loguru import logger

    from wf_launch.rank.task_context import build_context
    from wf_launch.rank.task_registry import get_task, load_task_modules
    from worldfoundry.core.distributed import destroy_model_parallel, dist_init

    eng = {
        "distributed_backend": "gloo",
        "distributed_timeout_minutes": 0.5,
        "tp_size": 1,
        "cp_size": 1,
        "pp_size": 1,
        "order": "tp-cp-pp-dp",
        **engine,
    }
    load_task_modules()
    device = dist_init({"engine_config": eng})
    try:
        ctx = build_context(
            {"engine": eng, "task": {"name": name, **task}}, Path("."), device, logger
        )
        return get_task(name)(ctx)
    finally:
        destroy_model_parallel()


def run_task(
    name: str,
    world_size: int,
    engine: dict[str, Any] | None = None,
    task: dict[str, Any] | None = None,
    **kw: Any,
) -> list[Any]:
    return run_ranks(
        _run_task,
        world_size,
        name,
        engine or {},
        task or {},
        init=False,
        timeout=kw.pop("timeout", 60),
        **kw,
    )


# ------------------------------------------------------------------ single process


def test_builtin_tasks_registered() -> None:
    from wf_launch.rank.task_registry import get_task, load_task_modules, registered_configs

    load_task_modules()
    for name in ("demo", "layout", "noop", "train"):
        assert callable(get_task(name))
    assert isinstance(registered_configs()["demo"], DemoTaskConfig)
    DemoTaskConfig.from_task_config({"name": "demo", "frames": 8})


def test_demo_config_is_a_structured_config() -> None:
    from omegaconf import OmegaConf

    node = OmegaConf.structured(DemoTaskConfig)
    node.patch = [1, 1, 1]
    cfg = DemoTaskConfig.from_task_config(node)
    assert cfg.patch == [1, 1, 1] and cfg.tolerance == 1e-4


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("dtype", "float16", "choose one of ['float32', 'float64', 'bfloat16']"),
        ("frames", 0, "integer >= 1"),
        ("batch", True, "integer >= 1"),
        ("height", 15, "multiple of its patch size 2"),
        ("patch", [1, 2], "three integers >= 1"),
        ("heads", 5, "must divide task.hidden=64"),
        ("hidden", 7, "even integer >= 6"),
        ("warmup", -1, "integer >= 0"),
        ("atol", 0, "number > 0"),
        ("seed", -3, "integer >= 0"),
        ("mlp_ratio", 0.0, "number > 0"),
        ("check", "yes", "true or false"),
    ],
)
def test_bad_demo_config_values(field: str, value: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        DemoTaskConfig.from_task_config({field: value})
    assert f"task.{field}={value!r}" in str(err.value) and fragment in str(err.value)


def test_unknown_demo_field_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"task\.sed=3 .*allowed fields: .*'seed'"):
        DemoTaskConfig.from_task_config({"name": "demo", "sed": 3})


def test_cp_that_cannot_be_placed_names_the_config() -> None:
    cfg = DemoTaskConfig.from_task_config({"frames": 3, "height": 6})
    with pytest.raises(ConfigError, match=r"engine\.cp_size=2 .*3 patch frames x 3 patch rows"):
        plan_split(cfg, 2)


def test_patchify_roundtrip() -> None:
    x = torch.randn(2, 3, 4, 8, 6)
    for patch in ((1, 2, 2), (2, 4, 3), (1, 1, 1)):
        assert torch.equal(unpatchify(patchify(x, patch), patch, 3), x)


@pytest.mark.parametrize(
    "cp_size, grid_t, want", [(4, 6, (2, 2)), (2, 3, (1, 2)), (4, 8, (4, 1)), (1, 6, (1, 1))]
)
def test_cp_split_blocks(cp_size: int, grid_t: int, want: tuple[int, int]) -> None:
    from worldfoundry.core.distributed import get_cp_size_t

    split = PatchGridSplit.plan((1, 4, grid_t, 16, 16), (1, 2, 2), cp_size)
    assert (split.cp_t, split.cp_h) == want
    if cp_size > 1:
        assert get_cp_size_t() == want[0]
    grid = torch.stack(torch.meshgrid(*(torch.arange(n) for n in split.grid), indexing="ij"), -1)
    seq = split.to_sequence(grid[None])
    assert torch.equal(seq[0], split.positions())
    assert torch.equal(split.from_sequence(seq)[0], grid)
    bt, bh, bw = split.block
    for r in range(split.cp_size):
        pos = split.positions(r)
        assert len(pos) == split.tokens_per_rank == bt * bh * bw
        assert len({tuple(p) for p in pos[:, :2].tolist()}) == bt * bh


def test_stage_blocks_split_evenly() -> None:
    assert [list(stage_blocks(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [len(stage_blocks(4, 3, s)) for s in range(3)] == [2, 1, 1]
    assert [len(stage_blocks(2, 3, s)) for s in range(3)] == [1, 1, 0]


def test_reference_depends_on_positions_and_weights() -> None:
    """A wrong CP plan (tokens at wrong positions) or wrong weights would be caught by the demo's
    check."""
    cfg = DemoTaskConfig.from_task_config(SMALL)
    model = cfg.build_model()
    t, latent = cfg.make_sample(1)
    with torch.inference_mode():
        out = model(latent, t)
        assert out.shape == latent.shape and out.std() > 0.1
        split = PatchGridSplit(tuple(patchify(latent, (1, 2, 2)).shape[1:4]))
        c = model.condition(t)
        seq = split.to_sequence(patchify(latent, (1, 2, 2)))
        shuffled = split.positions()[
            torch.randperm(split.tokens, generator=torch.Generator().manual_seed(0))
        ]
        wrong = model.head(model.run_blocks(model.embed(seq, shuffled), c), c)
        assert (
            unpatchify(split.from_sequence(wrong), (1, 2, 2), 4) - out
        ).abs().max() > 100 * cfg.tolerance
        other = DemoTaskConfig.from_task_config({**SMALL, "seed": 1}).build_model()
        assert (other(latent, t) - out).abs().max() > 100 * cfg.tolerance


# ------------------------------------------------------------------ multi-rank


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, engine, task, split",
    [
        (1, {}, {}, (1, 1)),
        (2, {"cp_size": 2}, {}, (2, 1)),
        (8, {"cp_size": 4, "pp_size": 2}, {}, (2, 2)),
        (2, {"cp_size": 2}, {"frames": 3}, (1, 2)),
        (2, {"pp_size": 2}, {"depth": 3}, (1, 1)),
        (2, {"tp_size": 2}, {}, (1, 1)),
        (4, {"cp_size": 2, "pp_size": 2}, {"dtype": "bfloat16", "frames": 3}, (1, 2)),
        (4, {"cp_size": 2, "dp_size": 2, "order": "cp-dp-tp-pp"}, {"batch": 2}, (2, 1)),
    ],
    ids=[
        "1rank",
        "cp2",
        "cp4-pp2",
        "cp2-over-H",
        "pp2",
        "tp2-replicated",
        "cp2-pp2-bf16",
        "cp2-dp2",
    ],
)
def test_demo_matches_single_process(
    world: int, engine: dict[str, Any], task: dict[str, Any], split: tuple[int, int]
) -> None:
    results = run_task("demo", world, engine, {**SMALL, **task})
    head = results[0]
    layout = Layout(
        world, **{k: v for k, v in engine.items() if k.endswith("_size") or k == "order"}
    )
    assert head["ok"] is True, head
    assert head["max_abs_err"] <= head["atol"]
    assert head["layout"] == layout.sizes
    assert (head["cp_split"]["cp_t"], head["cp_split"]["cp_h"]) == split
    cfg = DemoTaskConfig.from_task_config({**SMALL, **task})
    assert head["tokens"] == cfg.batch * (cfg.frames // 1) * (cfg.height // 2) * (cfg.width // 2)
    assert head["tokens_per_s"] > 0
    assert head["tp_replicated"] == (layout.tp_size > 1)
    holders = [r for r in results if r.get("holds_output")]
    assert len(holders) == layout.tp_size * layout.dp_size
    for r in holders:
        assert r["coords"]["pp"] == layout.pp_size - 1 and r["coords"]["cp"] == 0
        assert r["output_shape"] == list(cfg.latent_shape)
    stages = sorted({(r["stage"], tuple(r["blocks"])) for r in results})
    want = [stage_blocks(cfg.depth, layout.pp_size, i) for i in range(layout.pp_size)]
    assert [b for _, b in stages] == [(s.start, s.stop) for s in want]
    bt, bh, w = (cfg.frames // split[0], cfg.height // 2 // split[1], cfg.width // 2)
    assert all(r["cp_block"] == [bt, bh, w] for r in results)
    assert all(r["shard_shape"] == [cfg.batch, bt * bh * w, cfg.hidden] for r in results)


@pytest.mark.slow
def test_demo_bad_cp_raises_on_every_rank() -> None:
    results = run_task(
        "demo", 2, {"cp_size": 2}, {**SMALL, "frames": 3, "height": 6}, allow_failures=True
    )
    for r in results:
        assert "ConfigError" in r and "engine.cp_size=2 cannot split" in r


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, engine",
    [
        (8, {"tp_size": 2, "cp_size": 2, "pp_size": 2, "order": "tp-cp-pp-dp"}),
        (8, {"cp_size": 2, "pp_size": 2, "dp_size": 2, "order": "dp-pp-cp-tp"}),
    ],
)
def test_layout_rows_match_topology(world: int, engine: dict[str, Any]) -> None:
    results = run_task("layout", world, engine)
    head = results[0]
    assert head["ok"] is True and head["errors"] == []
    layout = Layout(world, **engine)
    assert head["order"] == "-".join(layout.dims)
    for rank, row in enumerate(head["rows"]):
        assert row["rank"] == rank and row["ok"]
        assert row["coords"] == layout.coords(rank)
        for g, members in row["groups"].items():
            assert members == layout.group_of(rank, g)
    assert all(r["ok"] is True for r in results[1:])
    lines = head["table"].splitlines()
    assert lines[0] == f"layout: {layout.describe()}" and len(lines) == world + 2
    assert all(line.endswith("ok") for line in lines[2:])


def test_format_ranks() -> None:
    from wf_launch.tasks.layout import format_ranks

    assert [format_ranks(r) for r in ([3], [0, 4], [0, 1, 2, 3], [0, 4, 8, 12], [0, 1, 5])] == [
        "3",
        "0,4",
        "0-3",
        "0-12:4",
        "0,1,5",
    ]
    assert format_ranks([*list(range(0, 40, 3)), 41]).endswith("...(+7)")


@pytest.mark.slow
def test_noop() -> None:
    assert run_task("noop", 2) == [{}, {}]
