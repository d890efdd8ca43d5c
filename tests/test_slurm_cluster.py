"""What a user relies on from a SLURM cluster, checked on the real throw-away one
(scripts/slurm_cluster.sh): srun ranks, submitit multi-task and multi-node jobs with
TorchDistributedEnvironment, readable job states (CANCELLED, FAILED), and a gloo all_reduce
across SLURM tasks. (The time-limit signal and requeue: tests/test_slurm_launcher.py.)"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import cloudpickle
import pytest
import submitit
from slurm_fixture import SlurmCluster
from submitit.core.utils import FailedJobError, UncompletedJobError

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Jobs unpickle these functions; pickle them by value so a job need not import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def executor(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> submitit.AutoExecutor:
    """A submitit executor on the cluster, with a fresh folder (job ids restart at 1 on
    every cluster start, so an old folder would hold an earlier run's results)."""
    slurm_cluster.activate(monkeypatch)
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    ex.update_parameters(timeout_min=5, cpus_per_task=1)
    return ex


def _state(job: submitit.Job) -> str:
    return job.watcher.get_state(job.job_id, mode="force")


def _wait_state(job: submitit.Job, prefix: str, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while (state := _state(job)).split()[0] != prefix:
        assert time.monotonic() < deadline, f"job {job.job_id} still {state}, wanted {prefix}"
        time.sleep(0.3)
    return state


# ----------------------------------------------------------------- functions run in jobs
def _dist_env() -> dict:
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {
        **{k: os.environ[k] for k in keys},
        "node": os.environ["SLURMD_NODENAME"],
        "master_ip": socket.gethostbyname(env.master_addr),
    }


def _all_reduce() -> dict:
    import torch
    import torch.distributed as dist

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    try:
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return {
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "sum": value.item(),
            "node": os.environ["SLURMD_NODENAME"],
        }
    finally:
        dist.destroy_process_group()


def _raise() -> None:
    raise ValueError("boom from a slurm task")


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


# ----------------------------------------------------------------- tests
def test_srun_gives_procids(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run(["srun", "-n4", "bash", "-c", "echo $SLURM_PROCID"])
    assert sorted(int(x) for x in out.stdout.split()) == [0, 1, 2, 3]


def test_submitit_one_node_four_tasks(executor: submitit.AutoExecutor) -> None:
    executor.update_parameters(nodes=1, tasks_per_node=4)
    job = executor.submit(_dist_env)
    results = job.results()
    assert len(results) == 4
    assert sorted(int(r["RANK"]) for r in results) == [0, 1, 2, 3]
    assert sorted(int(r["LOCAL_RANK"]) for r in results) == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in results} == {"4"}
    assert {r["LOCAL_WORLD_SIZE"] for r in results} == {"4"}
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in results}) == 1
    assert {r["master_ip"] for r in results} == {"127.0.0.1"}
    assert _wait_state(job, "COMPLETED") == "COMPLETED"  # sacct answers after the job ends


def test_submitit_two_nodes(slurm_cluster: SlurmCluster, executor: submitit.AutoExecutor) -> None:
    if slurm_cluster.nodes < 2:
        pytest.skip(f"cluster has {slurm_cluster.nodes} node(s); start it with --nodes 2")
    executor.update_parameters(nodes=2, tasks_per_node=2)
    results = executor.submit(_dist_env).results()
    by_rank = {int(r["RANK"]): r for r in results}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert {r["node"] for r in results} == {"n1", "n2"}
    assert [by_rank[i]["node"] for i in range(4)] == ["n1", "n1", "n2", "n2"]
    assert [int(by_rank[i]["LOCAL_RANK"]) for i in range(4)] == [0, 1, 0, 1]
    assert {r["LOCAL_WORLD_SIZE"] for r in results} == {"2"}
    assert {r["MASTER_ADDR"] for r in results} == {"n1"}
    assert {r["master_ip"] for r in results} == {"127.0.0.1"}


def test_gloo_all_reduce_across_tasks(
    slurm_cluster: SlurmCluster, executor: submitit.AutoExecutor
) -> None:
    nodes = min(slurm_cluster.nodes, 2)
    executor.update_parameters(nodes=nodes, tasks_per_node=4 // nodes)
    results = executor.submit(_all_reduce).results()
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["world"] for r in results} == {4}
    assert {r["sum"] for r in results} == {1.0 + 2 + 3 + 4}
    assert len({r["node"] for r in results}) == nodes


def test_failing_function_is_failed_job_error(executor: submitit.AutoExecutor) -> None:
    executor.update_parameters(nodes=1, tasks_per_node=1)
    job = executor.submit(_raise)
    with pytest.raises(FailedJobError, match="boom from a slurm task"):
        job.result()
    assert _wait_state(job, "FAILED") == "FAILED"


def test_cancelled_job_reads_cancelled(executor: submitit.AutoExecutor) -> None:
    executor.update_parameters(nodes=1, tasks_per_node=1)
    job = executor.submit(_sleep, 300)
    _wait_state(job, "RUNNING")
    job.cancel(check=True)
    assert _wait_state(job, "CANCELLED").startswith("CANCELLED")  # sacct: "CANCELLED by 0"
    assert job.done()
    assert job.state.startswith("CANCELLED")
    # A cancelled job writes no result: result() raises instead of blocking. submitit first
    # waits _results_timeout_s (15 s) for a late result file; skip that wait here.
    job._results_timeout_s = 0
    started = time.monotonic()
    with pytest.raises(UncompletedJobError, match="CANCELLED"):
        job.result()
    assert time.monotonic() - started < 10
