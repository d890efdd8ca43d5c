"""EMA on plain and DTensor parameters, DTensor model-state broadcast, local-shard access."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.tensor
from multirank import run_ranks
from torch import nn

from worldfoundry.core.distributed.ema import (
    DTensorFastEmaModelUpdater,
    broadcast_dtensor_model_states,
    get_local_tensor_if_dtensor,
)


def _net(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4)).to(dtype)


def _reference_ema(ema: list[torch.Tensor], src: list[torch.Tensor], beta: float) -> None:
    """The plain per-parameter loop the updater must agree with."""
    for e, s in zip(ema, src):
        e.copy_(beta * e + (1 - beta) * s.float())


@torch.no_grad()
def test_ema_numerics_match_a_plain_loop() -> None:
    updater = DTensorFastEmaModelUpdater()
    model, ema = _net(0), _net(1)
    updater.copy_to(model, ema)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ema.parameters()))
    reference = [p.clone() for p in ema.parameters()]
    for _step in range(5):
        for p in model.parameters():
            p.add_(torch.randn_like(p))
        updater.update_average(model, ema, beta=0.9)
        _reference_ema(reference, list(model.parameters()), 0.9)
    for got, want in zip(ema.parameters(), reference):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(reference[0], model[0].weight)  # the EMA really lags the model


@torch.no_grad()
def test_ema_from_a_low_precision_model_into_fp32() -> None:
    updater = DTensorFastEmaModelUpdater()
    model, ema = _net(0, torch.bfloat16), _net(1)
    reference = [p.clone() for p in ema.parameters()]
    updater.update_average(model, ema, beta=0.5)
    _reference_ema(reference, list(model.parameters()), 0.5)
    for got, want in zip(ema.parameters(), reference):
        torch.testing.assert_close(got, want)


def test_ema_errors_are_clear() -> None:
    updater = DTensorFastEmaModelUpdater()
    with pytest.raises(ValueError, match="src has 4 parameters but tgt has 2"):
        updater.copy_to(_net(0), nn.Linear(8, 6))
    with pytest.raises(
        ValueError, match=r"src '0.weight' has local shape \(6, 8\) but tgt '0.weight' has"
    ):
        updater.update_average(_net(0), nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(6, 4)))
    with pytest.raises(
        TypeError, match=r"target '0.weight' is torch.bfloat16; EMA weights must be"
    ):
        updater.update_average(_net(0), _net(1, torch.bfloat16))
    with pytest.raises(ValueError, match=r"beta=1.5 must be a number in \[0, 1\]"):
        updater.update_average(_net(0), _net(1), beta=1.5)


@torch.no_grad()
def test_cache_and_restore() -> None:
    updater = DTensorFastEmaModelUpdater()
    with pytest.raises(RuntimeError, match="nothing is cached"):
        updater.restore(_net(0).parameters())
    model = _net(0)
    saved = [p.clone() for p in model.parameters()]
    updater.cache(model.parameters())
    assert [c.device for c in updater.collected_params] == [p.device for p in model.parameters()]
    with pytest.raises(RuntimeError, match="already cached"):
        updater.cache(model.parameters())
    for p in model.parameters():
        p.zero_()
    with pytest.raises(ValueError, match="3 parameters given but 4 were cached"):
        updater.restore(list(model.parameters())[:3])
    updater.restore(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved))
    updater.cache(model.parameters(), is_cpu=True)
    assert all(c.device.type == "cpu" for c in updater.collected_params)
    updater.restore(model.parameters())
    assert not updater.is_cached and updater.collected_params == []


def test_get_local_tensor_of_a_plain_tensor_is_itself() -> None:
    t = torch.ones(2)
    assert get_local_tensor_if_dtensor(t) is t


def _dtensor_ema(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    beta = 0.8
    model, ema = _net(0), _net(1)
    reference = [p.detach().clone() for p in ema.parameters()]
    fully_shard(model)
    fully_shard(ema)
    updater = DTensorFastEmaModelUpdater()
    out: dict = {"dtensor": all(isinstance(p, DTensor) for p in ema.parameters())}
    with torch.no_grad():
        for step in range(3):
            for i, p in enumerate(model.parameters()):
                get_local_tensor_if_dtensor(p).add_(0.1 * (step + 1) * (i + 1))
            updater.update_average(model, ema, beta=beta)
            _reference_ema(reference, [p.full_tensor() for p in model.parameters()], beta)
    out["ema_close"] = all(
        torch.allclose(p.full_tensor(), want, rtol=1e-6, atol=1e-6)
        for p, want in zip(ema.parameters(), reference)
    )
    out["local_is_shard"] = get_local_tensor_if_dtensor(ema[0].weight).shape == (3, 8)

    saved = [p.full_tensor() for p in ema.parameters()]
    updater.cache(ema.parameters())
    updater.copy_to(model, ema)
    out["copied"] = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(ema.parameters(), model.parameters())
    )
    updater.restore(ema.parameters())
    out["restored"] = all(torch.equal(p.full_tensor(), s) for p, s in zip(ema.parameters(), saved))
    # a plain model as EMA source for a sharded EMA target does not pair shard-for-shard
    try:
        updater.update_average(_net(0), ema)
        out["mixed"] = "no error"
    except ValueError as e:
        out["mixed"] = str(e)
    return out


@pytest.mark.slow
def test_ema_on_fsdp2_dtensor_shards_matches_a_plain_loop() -> None:
    for res in run_ranks(_dtensor_ema, 2):
        assert res["dtensor"] and res["local_is_shard"]
        assert res["ema_close"]
        assert res["copied"] and res["restored"]
        assert "local shape (6, 8) but tgt '0.weight' has (3, 8)" in res["mixed"]


class _Holder(nn.Module):
    def __init__(self, weight: torch.Tensor, buf: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.register_buffer("count", buf)


def _broadcast(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    local = torch.full((2, 3), float(rank))
    weight = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)
    model = _Holder(weight, torch.tensor([rank * 10]))
    broadcast_dtensor_model_states(model, mesh)
    out = {
        "weight": get_local_tensor_if_dtensor(model.weight).tolist(),
        "count": model.count.tolist(),
    }
    try:
        broadcast_dtensor_model_states(model, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    except ValueError as e:
        out["no_replicate"] = str(e)
    return out


@pytest.mark.slow
def test_broadcast_dtensor_model_states_from_first_replicate_rank() -> None:
    results = run_ranks(_broadcast, 4)
    # mesh [[0, 1], [2, 3]]: replicate groups {0, 2} and {1, 3}; their first ranks send
    for rank, res in enumerate(results):
        source = rank % 2
        assert res["weight"] == [[float(source)] * 3] * 2
        assert res["count"] == [source * 10]
        assert "mesh has dimensions ('dp',); it needs one named 'replicate'" in res["no_replicate"]
