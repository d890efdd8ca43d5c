"""Context-parallel helpers on real gloo groups: split/gather, gradients, broadcasts, find_split."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from multirank import run_ranks

from worldfoundry.core.distributed import context_parallel as cp
from worldfoundry.core.distributed import groups


def _full(shape: tuple[int, ...], offset: float = 0.0) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + offset


def _check_group(group: object, n: int, r: int) -> None:
    """Round trips, layouts and gradients on one group of n ranks where this rank is group rank
    r."""
    x = _full((2, 3, 4 * n, 5))
    for dim in (2, -2, 0 if n == 2 else 2):
        shard = cp.split_inputs_cp(x, dim, group)
        assert torch.equal(shard, x.chunk(n, dim)[r])
        assert shard.is_contiguous()
        assert torch.equal(cp.cat_outputs_cp(shard, dim, group), x)

    xt = x.transpose(1, 2)  # non-contiguous, sequence now dim 1
    assert not xt.is_contiguous()
    shard_t = cp.split_inputs_cp(xt, 1, group)
    assert torch.equal(shard_t, xt.chunk(n, 1)[r])
    assert torch.equal(cp.cat_outputs_cp(shard_t.transpose(0, 2), -3, group), xt.transpose(0, 2))

    out = cp.cat_outputs_cp(shard_t, 1, group)
    again = cp.cat_outputs_cp(shard_t * 2, 1, group, out=out)
    assert again is out and torch.equal(out, xt * 2)

    leaf = cp.split_inputs_cp(x, 2, group).clone().requires_grad_(True)
    y = cp.cat_outputs_cp_with_grad(leaf, 2, group)
    assert torch.equal(y.detach(), x)
    weight = _full(x.shape, offset=1.0)
    (y * weight).sum().backward()
    assert torch.equal(leaf.grad, weight.chunk(n, 2)[r])

    indivisible = rf"sequence length 9 along seq_dim 1 is not divisible by .* size {n}"
    with pytest.raises(ValueError, match=indivisible):
        cp.split_inputs_cp(torch.zeros(2, 9), 1, group)
    with pytest.raises(ValueError, match="seq_dim=3 is out of range for a 2-D tensor"):
        cp.cat_outputs_cp(torch.zeros(2, 2), 3, group)


def _split_gather(rank: int, world: int) -> None:
    from torch import distributed as dist

    cp_size = 4 if world == 8 else world
    groups.initialize_model_parallel(tp_size=world // cp_size, cp_size=cp_size)
    try:
        coord = groups.get_cp_group()
        if world == 8:
            assert coord.ranks == [rank % 2 + 2 * i for i in range(4)]  # strided: cp groups skip tp
        _check_group(coord.device_group, cp_size, coord.rank_in_group)
        _check_group(coord, cp_size, coord.rank_in_group)
    finally:
        groups.destroy_model_parallel()
    _check_group(dist.new_group(list(range(world))), world, rank)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_split_and_gather_round_trip(world: int) -> None:
    run_ranks(_split_gather, world, timeout=90)


def _broadcasts(rank: int, world: int) -> tuple[object, ...]:
    from torch import distributed as dist

    sub = dist.new_group([1, 2, 3])  # minimum rank 1, not 0
    results: list[object] = []
    full = _full((2, 12, 3))
    for group, src in ((dist.group.WORLD, 0), (sub, 1)):
        if rank not in dist.get_process_group_ranks(group):
            continue
        n = dist.get_world_size(group)
        r = dist.get_rank(group)
        is_src = rank == src
        t = cp.broadcast(full + src if is_src else None, group)
        assert torch.equal(t, full + src) and t.dtype == torch.float32
        bf = cp.broadcast(torch.ones(3, dtype=torch.bfloat16).t() if is_src else None, group)
        assert bf.dtype == torch.bfloat16 and bf.shape == (3,)
        scalar = cp.broadcast(torch.tensor(7) if is_src else None, group)
        assert scalar.shape == () and scalar.item() == 7
        mine = torch.zeros(2, 12, 3)
        filled = cp.broadcast(full if is_src else mine, group)
        assert torch.equal(filled, full) and (is_src or filled is mine)
        text = cp.broadcast(f"from {rank}" if is_src else None, group)
        obj = cp.broadcast({"step": 3, "src": rank} if is_src else None, group)
        results += [text, obj["src"]]
        strided = full.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
        shard = cp.broadcast_split_tensor(strided if is_src else None, 1, group)
        assert torch.equal(shard, full.chunk(n, 1)[r]) and shard.is_contiguous()
        with pytest.raises(
            ValueError, match=f"sequence length 2 along seq_dim 0 is not divisible .* {n}"
        ):
            cp.broadcast_split_tensor(full if is_src else None, -3, group)
        if n == 3 and is_src:
            cp.broadcast(full, group)
        elif n == 3:  # a mismatched receive buffer fails after the collective, on that rank only
            with pytest.raises(
                ValueError, match=r"is a \(1,\) torch.float32 tensor but the source sent"
            ):
                cp.broadcast(torch.zeros(1), group)
        after = cp.broadcast_split_tensor(full if is_src else None, 1, group)  # group still usable
        assert torch.equal(after, full.chunk(n, 1)[r])
    return tuple(results)


@pytest.mark.slow
def test_broadcast_tensors_objects_and_split_with_receivers_passing_none() -> None:
    out = run_ranks(_broadcasts, 4, timeout=60)
    assert out[0] == ("from 0", 0)
    assert all(o == ("from 0", 0, "from 1", 1) for o in out[1:])


# (source item, seq_dim, expected error) in call order; a shape seen twice in a row makes the
# next call speculate (header and scatter posted together), so every transition is covered:
# hits, misses on shape / dtype / size, a hit whose seq_dim cannot be split, a non-tensor
# source while speculating, and recovery after each error.
_STEADY = [
    ((2, 8, 4), torch.float32, 1, None),
    ((2, 8, 4), torch.float32, 1, None),
    ((2, 8, 4), torch.float32, 1, None),  # speculative hit
    ((2, 8, 4), torch.float32, 2, None),  # hit, another seq_dim of the same shape
    ((2, 16, 4), torch.float32, 1, None),  # miss: larger
    ((2, 16, 4), torch.float32, 1, None),
    ((2, 16, 4), torch.bfloat16, 1, None),  # miss: dtype
    ((2, 16, 4), torch.bfloat16, 1, None),
    ((1, 4, 4), torch.bfloat16, 1, None),  # miss: smaller
    ((3, 8), torch.float32, 1, None),
    ((3, 8), torch.float32, 1, None),
    ((3, 8), torch.float32, 0, ValueError),  # hit, but 3 rows cannot be split
    ((3, 8), torch.float32, 1, None),
    ((3, 8), torch.float32, 1, None),
    ("not a tensor", None, 1, TypeError),  # miss while speculating
    ((3, 8), torch.float32, 1, None),
    ((3, 8), torch.float32, -1, None),
    ((3, 8), torch.float32, 1, None),  # hit
    ((3, 8), torch.float32, 5, ValueError),  # seq_dim out of range while speculating
    ((3, 8), torch.float32, 1, None),
    ((3, 8), torch.float32, 1, None),
    ((3, 8), torch.float32, "1", TypeError),  # seq_dim not an int while speculating
    ((3, 8), torch.float32, 1, None),
]


def _steady_state(rank: int, world: int) -> list[bool]:
    from torch import distributed as dist

    sub = dist.new_group(list(range(world // 2, world))) if world > 2 else None  # its own state
    speculating: list[bool] = []
    for step, (shape, dtype, dim, error) in enumerate(_STEADY):
        for group, src in ((dist.group.WORLD, 0), (sub, world // 2)):
            if group is None or rank not in dist.get_process_group_ranks(group):
                continue
            n, r = dist.get_world_size(group), dist.get_rank(group)
            full = shape if isinstance(shape, str) else (_full(shape, offset=step) + src).to(dtype)
            item = full if rank == src else None
            if error is not None:
                with pytest.raises(error, match="broadcast_split_tensor"):
                    cp.broadcast_split_tensor(item, dim, group)
                continue
            shard = cp.broadcast_split_tensor(item, dim, group)
            assert torch.equal(shard, full.chunk(n, dim)[r]), (step, rank)
            assert shard.dtype == dtype and shard.is_contiguous()
            if group is dist.group.WORLD:
                speculating.append(cp._last_headers()[dist.group.WORLD][1])
    return speculating


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_broadcast_split_tensor_speculates_on_repeated_shapes(world: int) -> None:
    out = run_ranks(_steady_state, world, timeout=60)
    assert all(o == out[0] for o in out)
    assert out[0][:4] == [False, True, True, True]
    assert out[0].count(False) > 4 and out[0].count(True) > 4


def _state_reset(rank: int, world: int) -> int:
    groups.initialize_model_parallel(cp_size=world)
    pg = groups.get_cp_group()
    for _ in range(3):
        cp.broadcast_split_tensor(_full((4, 2)) if rank == 0 else None, 0, pg)
    assert cp._last_headers()[pg.device_group][1]
    groups.destroy_model_parallel()
    remembered = len(cp._last_headers())
    groups.initialize_model_parallel(cp_size=world)
    shard = cp.broadcast_split_tensor(
        _full((2, 4)) if rank == 0 else None, 1, groups.get_cp_group()
    )
    assert torch.equal(shard, _full((2, 4)).chunk(world, 1)[rank])
    groups.destroy_model_parallel()
    return remembered


@pytest.mark.slow
def test_destroy_forgets_broadcast_headers() -> None:
    assert run_ranks(_state_reset, 2, timeout=60) == [0, 0]


def _gather_failure(rank: int, world: int) -> str:
    from torch import distributed as dist

    group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(1.5)  # never joins: rank 0's all-gather times out
        return ""
    with pytest.raises(RuntimeError, match="cat_outputs_cp: all-gather of a") as info:
        cp.cat_outputs_cp(torch.ones(1, 2), 1, group)
    assert info.value.__cause__ is not None
    return type(info.value.__cause__).__name__


@pytest.mark.slow
def test_gather_failure_keeps_its_cause() -> None:
    cause = run_ranks(_gather_failure, 2, timeout=60)[0]
    assert cause  # the backend's own exception type, e.g. DistBackendError


def test_none_group_is_identity() -> None:
    x = torch.ones(2, 4).t()
    assert cp.split_inputs_cp(x, 0) is x
    assert cp.cat_outputs_cp(x, -1) is x
    assert cp.cat_outputs_cp_with_grad(x, 1, None) is x
    assert cp.broadcast(x) is x and cp.broadcast("s", None) == "s"
    assert cp.broadcast_split_tensor(x, 0, None) is x
    out = torch.empty(4, 2)
    assert cp.cat_outputs_cp(x, 0, out=out) is out and torch.equal(out, x)


# ---------------------------------------------------------------- find_split


@pytest.mark.parametrize(
    ("shape", "cp_size", "patch", "view", "expected", "cp_t"),
    [
        ((1, 16, 8, 32, 32), 1, (1, 2, 2), 1, (8, 32, 32), 1),
        ((1, 16, 8, 32, 32), 2, (1, 2, 2), 1, (4, 32, 32), 2),
        ((1, 16, 8, 32, 32), 8, (1, 2, 2), 1, (1, 32, 32), 8),
        ((1, 16, 3, 32, 32), 4, (1, 2, 2), 1, (3, 8, 32), 1),  # all of cp goes to H
        ((2, 16, 6, 32, 32), 4, (1, 2, 2), 1, (3, 16, 32), 2),  # split between T and H
        ((1, 16, 8, 32, 32), 4, (1, 2, 2), 2, (1, 32, 32), 4),  # view_factor first
        ((1, 16, 8, 16, 16), 8, (2, 2, 2), 1, (2, 8, 16), 4),  # temporal patch 2
        (torch.tensor([1, 16, 4, 8, 8]), 2, (1, 2, 2), 1, (2, 8, 8), 2),
        (torch.Size([1, 16, 5, 24, 40]), 6, (1, 2, 2), 1, (5, 4, 40), 1),
    ],
)
def test_find_split(
    shape: object,
    cp_size: int,
    patch: tuple[int, ...],
    view: int,
    expected: tuple[int, ...],
    cp_t: int,
) -> None:
    got = cp.find_split(shape, cp_size, patch, view)
    assert isinstance(got, torch.Size) and got == torch.Size(expected)
    assert groups.get_cp_size_t() == cp_t
    dims = list(shape.tolist() if isinstance(shape, torch.Tensor) else shape)
    assert got.numel() * cp_size * view == dims[2] * dims[3] * dims[4]


@pytest.mark.parametrize(
    ("shape", "cp_size", "patch", "view", "expected", "cp_t"),
    [
        ((1, 16, 8, 32, 32), 1, (1, 2, 2), 1, (8, 32, 32), 1),
        ((1, 16, 3, 32, 32), 4, (1, 2, 2), 1, (3, 8, 32), 1),
        ((2, 16, 6, 32, 32), 4, (1, 2, 2), 1, (3, 16, 32), 2),
        ((1, 16, 8, 32, 32), 4, (1, 2, 2), 2, (1, 32, 32), 4),
        (torch.Size([1, 16, 5, 24, 40]), 6, (1, 2, 2), 1, (5, 4, 40), 1),
    ],
)
def test_find_split_plan_returns_the_split_and_records_nothing(
    shape: object,
    cp_size: int,
    patch: tuple[int, ...],
    view: int,
    expected: tuple[int, ...],
    cp_t: int,
) -> None:
    groups.destroy_model_parallel()
    plan = cp.find_split_plan(shape, cp_size, patch, view)
    assert isinstance(plan, cp.CPSplit)
    assert plan.block == torch.Size(expected) and isinstance(plan.block, torch.Size)
    assert (plan.cp_size_t, plan.cp_size_h) == (cp_t, cp_size // cp_t)
    block, cp_size_t, cp_size_h = plan
    assert cp_size_t * cp_size_h == cp_size
    assert groups.get_cp_size_t() is None  # only find_split records
    assert cp.find_split(shape, cp_size, patch, view) == block
    assert groups.get_cp_size_t() == cp_size_t
    with pytest.raises(ValueError, match="not a multiple of its patch"):
        cp.find_split_plan((1, 16, 8, 33, 32), 2)
    assert groups.get_cp_size_t() == cp_size_t


@pytest.mark.parametrize(
    ("shape", "cp_size", "patch", "view", "match"),
    [
        ((1, 16, 8, 32), 2, (1, 2, 2), 1, r"5 sizes \(B, C, T, H, W\)"),
        ((1, 16, 8, 32, 32), 0, (1, 2, 2), 1, r"cp_size must be an integer >= 1, got 0"),
        ((1, 16, 8, 32, 32), 2, (1, 2, 2), 0, r"view_factor must be an integer >= 1, got 0"),
        ((1, 16, 9, 32, 32), 2, (1, 2, 2), 2, r"T=9 is not divisible by view_factor=2"),
        ((1, 16, 8, 33, 32), 2, (1, 2, 2), 1, r"H=33 is not a multiple of its patch size 2"),
        ((1, 16, 8, 32, 31), 2, (1, 2, 2), 1, r"W=31 is not a multiple of its patch size 2"),
        (
            (1, 16, 5, 32, 32),
            2,
            (2, 2, 2),
            1,
            r"T \(per view\)=5 is not a multiple of its patch size 2",
        ),
        ((1, 16, 1, 2, 32), 2, (1, 2, 2), 1, r"cp_size=2 cannot be absorbed .* 2 left over"),
        ((1, 16, 3, 6, 32), 4, (1, 2, 2), 1, r"cp_size=4 cannot be absorbed .* 4 left over"),
        ((1, 16, 8, 32, 32), 2, (1, 2), 1, r"patch_values must be 3 patch sizes"),
        (
            (1, 16, 0, 32, 32),
            2,
            (1, 2, 2),
            1,
            r"shape_tensor\[2\] \(T\) must be an integer >= 1, got 0",
        ),
    ],
)
def test_find_split_errors_reset_cp_size_t(
    shape: tuple[int, ...], cp_size: int, patch: tuple[int, ...], view: int, match: str
) -> None:
    cp.find_split((1, 16, 8, 32, 32), 2)
    assert groups.get_cp_size_t() == 2
    with pytest.raises(ValueError, match=match):
        cp.find_split(shape, cp_size, patch, view)
    assert groups.get_cp_size_t() is None


def test_find_split_state_reset_by_destroy_model_parallel() -> None:
    cp.find_split((1, 16, 8, 32, 32), 4)
    assert groups.get_cp_size_t() == 4
    cp.find_split((1, 16, 8, 32, 32), 1)
    assert groups.get_cp_size_t() == 1
    cp.find_split((1, 16, 8, 32, 32), 8)
    groups.destroy_model_parallel()
    assert groups.get_cp_size_t() is None
