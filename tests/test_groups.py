"""Real gloo process groups: layout -> groups, group objects, dist_init, teardown."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from multirank import run_ranks

from worldfoundry.core.distributed import groups as g
from worldfoundry.core.distributed.init import dist_init
from worldfoundry.core.distributed.topology import COMBINED, DIMS, Layout

ORDERS = ["tp-cp-pp-dp", "tp-dp-pp", "dp-pp-cp-tp", "cp-tp-dp-pp"]


def _engine(**kw: object) -> SimpleNamespace:
    base = dict(
        distributed_backend="gloo",
        distributed_timeout_minutes=1,
        tp_size=1,
        cp_size=1,
        pp_size=1,
        order="tp-cp-pp-dp",
    )
    base.update(kw)
    return SimpleNamespace(engine_config=SimpleNamespace(**base))


def _check_orders(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    checked = []
    for order in ORDERS:
        sizes = dict(tp=2, cp=2, pp=2, dp=1) if "cp" in order else dict(tp=2, cp=1, pp=2, dp=2)
        g.initialize_model_parallel(
            sizes["tp"], sizes["pp"], sizes["cp"], order=order, distributed_timeout_minutes=0.5
        )
        L = Layout(world, **{f"{d}_size": v for d, v in sizes.items()}, order=order)
        dims = list(L.dims)
        mesh = init_device_mesh(
            "cpu", tuple(L.sizes[d] for d in reversed(dims)), mesh_dim_names=tuple(reversed(dims))
        )
        for name in (*DIMS, *COMBINED):
            grp = g.get_group(name)
            assert grp.ranks == L.group_of(rank, name), (order, name)
            assert dist.get_process_group_ranks(grp.device_group) == sorted(grp.ranks)
            t = torch.tensor([rank])
            dist.all_reduce(t, group=grp.device_group)
            assert t.item() == sum(grp.ranks), (order, name)
        for d in DIMS:
            grp = g.get_group(d)
            mesh_ranks = dist.get_process_group_ranks(mesh.get_group(d))
            assert grp.ranks == mesh_ranks, (order, d, grp.ranks, mesh_ranks)
            assert grp.rank_in_group == grp.ranks.index(rank)
            assert grp.first_rank == grp.ranks[0] and grp.last_rank == grp.ranks[-1]
            n = grp.world_size
            assert grp.next_rank == grp.ranks[(grp.rank_in_group + 1) % n]
            assert grp.prev_rank == grp.ranks[(grp.rank_in_group - 1) % n]
        assert g.is_last_tp_cp_rank() == (rank == g.get_tp_cp_group().ranks[-1])
        assert g.is_last_rank() == (rank == world - 1)
        g.destroy_model_parallel()
        assert not g.model_parallel_is_initialized()
        checked.append(order)
    return checked


@pytest.mark.slow
def test_groups_match_layout_and_device_mesh_across_orders() -> None:
    assert run_ranks(_check_orders, 8, timeout=120) == [ORDERS] * 8


def _destroy_really_destroys(rank: int, world: int) -> int:
    from torch.distributed.distributed_c10d import _world

    before = len(_world.pg_map)
    g.initialize_model_parallel(tp_size=2, cp_size=2)
    tp_pg = g.get_tp_group().device_group
    assert len(_world.pg_map) > before
    g.destroy_model_parallel()
    assert len(_world.pg_map) == before
    with pytest.raises((RuntimeError, ValueError, KeyError)):
        dist.get_process_group_ranks(tp_pg)
    with pytest.raises(RuntimeError, match="dist_init"):
        g.get_tp_group()
    g.initialize_model_parallel(tp_size=2, cp_size=2)  # the same layout again: no stale state
    t = torch.ones(1)
    dist.all_reduce(t, group=g.get_cp_group().device_group)
    assert t.item() == 2
    g.destroy_model_parallel()
    g.initialize_model_parallel(pp_size=4, order="pp-tp-cp-dp")
    assert g.get_pp_group().ranks == [0, 1, 2, 3]
    g.destroy_model_parallel()
    assert dist.is_initialized()  # the caller's default group is left alone
    return len(_world.pg_map)


@pytest.mark.slow
def test_destroy_destroys_groups_and_allows_reinit() -> None:
    assert run_ranks(_destroy_really_destroys, 4) == [1] * 4


def _dist_init_cycle(rank: int, world: int) -> list[object]:
    device = dist_init(_engine(cp_size=2, tp_size=2, distributed_timeout_minutes=0.25))
    out: list[object] = [str(device), g.get_cp_group().ranks, g.get_world_group().world_size]
    g.destroy_model_parallel()
    assert not dist.is_initialized()
    dist_init(_engine(pp_size=4, order="pp-tp-cp-dp"))
    from worldfoundry.core.distributed.pipeline import pp_scheduler

    out.append(pp_scheduler() is not None)
    out.append(g.get_pp_group().ranks)
    g.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_dist_init_destroy_dist_init_with_another_layout() -> None:
    res = run_ranks(_dist_init_cycle, 4, init=False)
    assert res[0] == ["cpu", [0, 2], 4, True, [0, 1, 2, 3]]
    assert res[3][1] == [1, 3]


def _bad_dist_init(rank: int, world: int, engine: dict, needle: str) -> bool:
    with pytest.raises(ValueError, match=needle):
        dist_init(SimpleNamespace(engine_config=SimpleNamespace(**engine)))
    assert not dist.is_initialized(), "a group was made before the error"
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    ("engine", "needle"),
    [
        (dict(distributed_backend="gloo", cp_size=3), r"does not divide the world size 4"),
        (dict(distributed_backend="gloo", cp_size=2, dp_size=1), r"!= world size 4"),
        (dict(distributed_backend="nccl"), r"needs CUDA.*use 'gloo'"),
        (dict(distributed_backend="mpi"), r"distributed_backend='mpi' is not allowed"),
        (
            dict(distributed_backend="gloo", distributed_timeout_minutes=0),
            r"distributed_timeout_minutes=0",
        ),
        (dict(distributed_backend="gloo", order="tp-cp-pp-xx"), r"unknown token"),
    ],
)
def test_dist_init_rejects_bad_config_before_making_groups(engine: dict, needle: str) -> None:
    assert run_ranks(_bad_dist_init, 4, engine, needle, init=False) == [True] * 4


def test_dist_init_in_a_plain_single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert dist_init(_engine()) == torch.device("cpu")
    try:
        assert g.get_world_group().world_size == 1
        assert g.is_last_rank() and g.is_last_tp_cp_rank()
        assert g.get_tp_group().ranks == [0]
    finally:
        g.destroy_model_parallel()
    assert not dist.is_initialized()


def test_group_access_before_init_names_what_to_call() -> None:
    for getter in (
        g.get_world_group,
        g.get_tp_group,
        g.get_cp_group,
        g.get_pp_group,
        g.get_dp_group,
    ):
        with pytest.raises(RuntimeError, match=r"call worldfoundry\.core\.distributed\.dist_init"):
            getter()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        g.initialize_model_parallel()
    assert not g.model_parallel_is_initialized()
