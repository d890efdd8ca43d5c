"""Distributed runtime every rank uses: topology, groups, CP/PP helpers, run control.

Names are re-exported lazily (PEP 562): importing this package does not import
torch.distributed until a name is used. The launcher, the config and the tools import
torch-free modules of this package (``topology``, ``env``, ``backends``), and every such import
runs this file first: importing every module here eagerly would add torch and
torch.distributed to each of them (measured under load: 0.25 s for ``topology`` through this
face, 14 to 18 s more with every module imported; see docs/benchmarks.md).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # topology
    "Layout": "topology",
    "parse_order": "topology",
    # groups
    "GroupCoordinator": "groups",
    "init_distributed_environment": "groups",
    "initialize_model_parallel": "groups",
    "destroy_model_parallel": "groups",
    "model_parallel_is_initialized": "groups",
    "get_layout": "groups",
    "get_world_group": "groups",
    "get_tp_group": "groups",
    "get_cp_group": "groups",
    "get_pp_group": "groups",
    "get_dp_group": "groups",
    "get_tp_cp_group": "groups",
    "get_dp_cp_group": "groups",
    "get_tp_pp_group": "groups",
    "get_group": "groups",
    "is_last_rank": "groups",
    "is_last_tp_cp_rank": "groups",
    "get_cp_size_t": "groups",
    # init and backends
    "dist_init": "init",
    "LaunchEnv": "env",
    "launch_attempt": "env",
    "resolve_backend": "backends",
    "group_device": "backends",
    # context parallel
    "split_inputs_cp": "context_parallel",
    "cat_outputs_cp": "context_parallel",
    "cat_outputs_cp_with_grad": "context_parallel",
    "broadcast": "context_parallel",
    "broadcast_split_tensor": "context_parallel",
    "find_split": "context_parallel",
    "find_split_plan": "context_parallel",
    "CPSplit": "context_parallel",
    # pipeline
    "PPScheduler": "pipeline",
    "init_pp_scheduler": "pipeline",
    "pp_scheduler": "pipeline",
    # run control: who this process is in a run, and collectives that survive a failing rank
    **{
        n: "run_control"
        for n in ("DistributedState", "distributed_run", "all_reduce", "broadcast_from")
    },
    # who this process is: the process-group wrappers of the run-control API
    **{
        n: "identity"
        for n in (
            "DistributedProcessGroup",
            "ParallelState",
            "is_available",
            "is_initialized",
            "is_distributed_launch",
            "is_distributed_run",
            "is_master",
            "rank",
            "size",
            "backend",
            "barrier",
        )
    },
    "gather_bytes": "gather",
    "gather_state_dicts": "gather",
    "DistributionPlan": "plan",
    "set_distribution_plan": "plan",
    "distribution_plan": "plan",
    "fsdp2_wrap": "fsdp",
    "is_fsdp2_model": "fsdp",
    "DTensorFastEmaModelUpdater": "ema",
    "broadcast_dtensor_model_states": "ema",
    "get_local_tensor_if_dtensor": "ema",
    # logging
    "print_rank_0": "log",
    "print_per_rank": "log",
    "rank_logger": "log",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
