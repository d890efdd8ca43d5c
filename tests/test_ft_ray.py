"""``ft=torchft`` on ``launcher=ray``: replica groups in placement groups of their own on the
test cluster, a kill -9 and a hang of one group, the others stepping on (real Ray, real torchft).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ft_cluster import drill_two_faults, sigterm_while_running
from ray_fixture import RayCluster

from wf_launch.config.ft import FtConfig
from wf_launch.launchers.ft_record import compose_ft
from wf_launch.rank.ft import append_event
from wf_launch.rundir import files


def test_a_ray_failure_without_exit_codes_is_a_recovery_of_its_rank_never_a_cascade(tmp_path):
    """Ray knows no exit codes: the failed event names the rank and the cause; a rank that died
    (killed from outside) is not counted as a survivor's restart even right after another's."""
    for k in (0, 1):
        where = files.ft_replica_dir(tmp_path, k)
        where.mkdir(parents=True)
        append_event(where, event="failed", attempt=1, rank=1, cause="died", failed_at_step=8)
        append_event(where, event="rejoined", step=9)
    ft = FtConfig.from_dict({"name": "torchft", "replicas": 2})
    section, _ = compose_ft(tmp_path, ft, 2, {0: 0, 1: 0})
    recoveries = [
        (r["replica"], r["rank"], r["global_rank"], r["cause"]) for r in section["recoveries"]
    ]
    assert recoveries == [(0, 1, 1, "died"), (1, 1, 3, "died")]
    assert section["survivor_restarts"] == 0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_ray_drill_kills_then_hangs_one_group_and_the_other_steps_on(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    where = [f"launcher.address={ray_cluster.address}"]
    record = drill_two_faults("ray", where, ray_cluster.env, tmp_path)
    assert record["ft"]["recoveries"][0]["cause"] == "died"  # Ray knows no signal
    # each replica group was its own Ray run: group 0 one attempt, group 1 three
    run = tmp_path / "drill" / "interrupted"
    replicas = [
        json.loads((files.ft_replica_dir(run, k) / "result.json").read_text()) for k in (0, 1)
    ]
    assert [len(r["attempts"]) for r in replicas] == [1, 3]
    assert ray_cluster.leftovers() == []


@pytest.mark.ray
@pytest.mark.slow
def test_sigterm_stops_every_ray_replica_group_and_leaves_nothing(
    ray_cluster: RayCluster, tmp_path: Path
) -> None:
    where = ["launcher=ray", f"launcher.address={ray_cluster.address}"]
    sigterm_while_running(where, ray_cluster.env, tmp_path)
    assert ray_cluster.leftovers() == []
