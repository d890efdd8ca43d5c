"""DistributionPlan and recording / reading a model's plan."""

from __future__ import annotations

import pytest
from multirank import run_ranks
from torch import nn

from worldfoundry.core.distributed.plan import (
    DistributionPlan,
    distribution_plan,
    set_distribution_plan,
)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_plan_degrees() -> None:
    plan = DistributionPlan(world_size=8, ep_size=4, dense="fsdp")
    assert (plan.edp, plan.is_expert_parallel, plan.is_fsdp_dense) == (2, True, True)
    single = DistributionPlan()
    assert (single.world_size, single.ep_size, single.dense) == (1, 1, "replicate")
    assert (single.edp, single.is_expert_parallel, single.is_fsdp_dense) == (1, False, False)
    assert DistributionPlan(4, 1, "replicate") == DistributionPlan(world_size=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, r"world_size=0 must be an int >= 1"),
        ({"world_size": 2.0}, r"world_size=2.0 must be an int >= 1"),
        ({"ep_size": True}, r"ep_size=True must be an int >= 1"),
        ({"world_size": 6, "ep_size": 4}, r"ep_size=4 must divide world_size=6"),
        ({"dense": "ddp"}, r"dense='ddp' is not allowed; allowed: \('replicate', 'fsdp'\)"),
    ],
)
def test_plan_validation_names_field_value_and_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DistributionPlan(**kwargs)


def test_plan_recorded_on_model_and_current_submodules() -> None:
    model = _model()
    plan = DistributionPlan(world_size=2, dense="fsdp")
    assert distribution_plan(model) == DistributionPlan()  # single process without a plan
    set_distribution_plan(model, plan)
    assert all(distribution_plan(m) is plan for m in model.modules())
    model.add_module("late", nn.Linear(2, 2))
    assert distribution_plan(model.late) == DistributionPlan()  # added afterwards: records none
    assert distribution_plan(model) is plan


def test_second_record_raises_and_leaves_the_model_as_it_was() -> None:
    model = _model()
    inner_plan = DistributionPlan(world_size=2)
    set_distribution_plan(model[1], inner_plan)
    with pytest.raises(RuntimeError, match=r"submodule '1' \(Sequential\) already records"):
        set_distribution_plan(model, DistributionPlan(world_size=4))
    assert distribution_plan(model) == DistributionPlan()  # root untouched
    assert distribution_plan(model[0]) == DistributionPlan()
    assert distribution_plan(model[1][0]) is inner_plan
    with pytest.raises(RuntimeError, match="the model .* already records"):
        set_distribution_plan(model[1], inner_plan)  # the same plan included
    with pytest.raises(TypeError, match="plan must be a DistributionPlan"):
        set_distribution_plan(_model(), {"world_size": 2})  # type: ignore[arg-type]


def _plan_in_a_run(rank: int, world: int) -> dict:
    model = _model()
    try:
        distribution_plan(model)
        unrecorded = "no error"
    except RuntimeError as e:
        unrecorded = str(e)
    set_distribution_plan(model, DistributionPlan(world_size=world))
    return {"unrecorded": unrecorded, "recorded": distribution_plan(model[1]).world_size}


@pytest.mark.slow
def test_model_without_plan_in_a_multi_rank_run_raises() -> None:
    for res in run_ranks(_plan_in_a_run, 2):
        assert "records no plan, but it is held in a run of 2 ranks" in res["unrecorded"]
        assert "set_distribution_plan" in res["unrecorded"]
        assert res["recorded"] == 2


def test_layout_table_of_a_huge_world_stays_small() -> None:
    from pathlib import Path

    from wf_launch.launchers.launch_plan import LaunchPlan
    from worldfoundry.core.distributed.topology import Layout

    plan = LaunchPlan(
        config={}, layout=Layout(1 << 20, cp_size=4, dp_size=1 << 18), run_dir=Path("x")
    )
    table = plan.layout_table()
    assert len(table) < 4000 and "... 1048560 more ranks, not shown" in table
    assert "3..1048575 step 4 (262144 ranks)" in table.splitlines()[-1]
