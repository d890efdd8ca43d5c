"""fsdp2_wrap / is_fsdp2_model on a small causal LM, FSDP2 on gloo CPU ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp
from multirank import run_ranks
from torch import nn

from worldfoundry.core.distributed.fsdp import fsdp2_wrap, is_fsdp2_model

DIM, VOCAB, LAYERS = 16, 32, 3


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)


class Block(nn.Module):
    """A decoder block holding its own ModuleList of experts, as an MoE layer does."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(DIM, DIM)
        self.experts = nn.ModuleList(Expert() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.attn(x))
        return x + sum(e.fc(x) for e in self.experts) / 2


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        # an off-dtype parameter (e.g. a router's fp64 bias): FSDP2 cannot group it with fp32 ones
        self.scale = nn.Parameter(torch.ones(DIM, dtype=torch.float64))


class TinyCausalLM(nn.Module):
    """Laid out like a HF causal LM (model.model.layers), without transformers."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        x = self.model.norm(x) * self.model.scale.to(x.dtype)
        return self.lm_head(x)


def _model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM()


def _wrap(rank: int, world: int, shard_root: bool) -> dict:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from worldfoundry.core.distributed.plan import distribution_plan

    reference = _model()
    ids = torch.arange(12).reshape(2, 6) % VOCAB
    ref_loss = reference(ids).float().pow(2).mean()
    ref_loss.backward()

    model = _model()
    assert not is_fsdp2_model(model)
    layers = fsdp2_wrap(model, shard_root=shard_root)
    loss = model(ids).float().pow(2).mean()
    loss.backward()
    try:
        distribution_plan(model)
        plan_error = None
    except RuntimeError as e:
        plan_error = str(e)
    try:
        fsdp2_wrap(model)
        again = None
    except ValueError as e:
        again = str(e)
    grad = model.model.layers[0].attn.weight.grad
    full_grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return {
        "layers_is_model_layers": layers is model.model.layers,
        "layers_sharded": [isinstance(m, FSDPModule) for m in layers],
        "experts_wrapped": any(isinstance(e, FSDPModule) for e in model.model.layers[0].experts),
        "root_sharded": isinstance(model, FSDPModule),
        "embed_is_dtensor": isinstance(model.model.embed_tokens.weight, DTensor),
        "layer_param_is_dtensor": isinstance(model.model.layers[1].attn.weight, DTensor),
        "layer_local_rows": get_rows(model.model.layers[1].attn.weight),
        "scale_plain": type(model.model.scale) is nn.Parameter
        and not isinstance(model.model.scale, DTensor),
        "scale_device": model.model.scale.device.type,
        "is_fsdp2": is_fsdp2_model(model),
        "loss_matches": abs(loss.item() - ref_loss.item()) < 1e-5,
        "grad_matches": torch.allclose(
            full_grad, reference.model.layers[0].attn.weight.grad, atol=1e-6
        ),
        "plan_error": plan_error,
        "again": again,
    }


def get_rows(param: torch.Tensor) -> int:
    return param.to_local().shape[0] if hasattr(param, "to_local") else param.shape[0]


@pytest.mark.slow
@pytest.mark.parametrize("shard_root", [True, False])
def test_fsdp2_wrap_shards_decoder_layers_on_gloo_cpu(shard_root: bool) -> None:
    for res in run_ranks(_wrap, 2, shard_root):
        assert res["layers_is_model_layers"]  # the decoder layers, not the experts' lists
        assert res["layers_sharded"] == [True] * LAYERS
        assert not res["experts_wrapped"]
        assert res["root_sharded"] is shard_root
        assert res["embed_is_dtensor"] is shard_root
        assert res["layer_param_is_dtensor"] and res["layer_local_rows"] == DIM // 2
        assert (
            res["scale_plain"] and res["scale_device"] == "cpu"
        )  # the off-dtype param stays whole
        assert res["is_fsdp2"]
        assert res["loss_matches"] and res["grad_matches"]
        assert "records no plan, but it is FSDP2-sharded" in res["plan_error"]
        assert "already FSDP2-sharded" in res["again"]


def _no_layers(rank: int, world: int) -> str:
    try:
        fsdp2_wrap(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_fsdp2_wrap_without_decoder_layers_is_a_clear_error() -> None:
    [msg] = run_ranks(_no_layers, 1)
    assert "Sequential has no decoder layers to shard" in msg


def _mixed_precision(rank: int, world: int) -> list[str]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _model()
    fsdp2_wrap(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), cpu_offload=True)
    seen: list[str] = []
    model.model.layers[0].attn.register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    model(torch.arange(6).reshape(1, 6))
    return [*seen, str(model.model.layers[0].attn.weight.dtype)]


@pytest.mark.slow
def test_fsdp2_wrap_mixed_precision_and_cpu_offload() -> None:
    for res in run_ranks(_mixed_precision, 2):
        assert res == ["torch.bfloat16", "torch.float32"]  # compute in bf16, shards kept fp32


def test_is_fsdp2_model_and_bad_arguments() -> None:
    assert not is_fsdp2_model(_model())
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        fsdp2_wrap(_model(), mp_policy="bf16")
    with pytest.raises(RuntimeError, match="process group is not initialized"):
        fsdp2_wrap(_model())
