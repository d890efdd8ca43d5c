"""Hang autopsy on real ranks: stack dumps by signal, spots outside torch, compact groups."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from multirank import run_ranks

from wf_launch.observe import stacks
from wf_launch.rank import stackdump
from wf_launch.rundir import files


def _user_hang(seconds: float) -> None:
    time.sleep(seconds)


def _rank(rank: int, world_size: int, run_dir: str) -> None:
    import torch
    import torch.distributed as dist

    stackdump.install(run_dir, rank)
    if rank == 2:
        _user_hang(6)
    t = torch.ones(1)
    dist.all_reduce(t)


@pytest.mark.slow
def test_dumps_of_live_ranks_group_the_waiters_and_name_the_straggler(tmp_path: Path) -> None:
    found: dict[int, list[stacks.Frame]] = {}

    def autopsy() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            files.rank_pid(tmp_path, r).exists() for r in range(4)
        ):
            time.sleep(0.05)
        time.sleep(2.0)
        pids = {r: stacks.read_pid_file(tmp_path, r)["pid"] for r in range(4)}
        offsets = stacks.stack_offsets(tmp_path, range(4))
        assert stacks.trigger(pids) == {0, 1, 2, 3}
        found.update(stacks.collect_dumps(tmp_path, range(4), offsets, wait_s=5))

    watcher = threading.Thread(target=autopsy)
    watcher.start()
    run_ranks(_rank, 4, str(tmp_path), timeout=90)
    watcher.join()
    assert sorted(found) == [0, 1, 2, 3]
    groups = stacks.group_spots({r: stacks.spot_of(f) for r, f in found.items()})
    lines = stacks.describe_groups(groups, lambda r: f"r{r} tp0 cp0 pp0 dp{r}")
    assert lines[0].startswith("  ranks 0,1,3 wait in all_reduce at ") and "(_rank)" in lines[0], (
        lines
    )
    assert (
        lines[1].startswith("  rank 2 (tp0 cp0 pp0 dp2) is at ")
        and "in _user_hang: time.sleep(seconds)" in lines[1]
    )


def test_spot_from_a_traceback_skips_torch_and_the_runtime() -> None:
    tb = """Traceback (most recent call last):
  File "/x/wf_launch/rank/entrypoint.py", line 300, in rank_main
    value = task(ctx)
  File "/home/me/my_tasks.py", line 58, in train_step
    dist.all_reduce(t, group=g)
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81, in wrapper
    return func(*args, **kwargs)
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2800, in all_reduce
    work.wait()
RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 6000ms for recv operation
"""
    spot = stacks.spot_of(stacks.parse_traceback(tb))
    assert (
        spot.frame == stacks.Frame("/home/me/my_tasks.py", 58, "train_step")
        and spot.waits_in == "all_reduce"
    )


def test_a_forked_rank_starting_up_is_not_placed_in_the_launcher_it_inherited() -> None:
    """Below a forked rank's entry lie the launcher's own frames (the agent, the CLI): a rank
    still joining its group waits in the runtime, not in the launcher's code."""
    tb = """Traceback (most recent call last):
  File "/x/wf_launch/cli.py", line 146, in main
    _main(argv)
  File "/x/worldfoundry/core/torch_private.py", line 221, in <lambda>
    lambda: agent._start_workers(worker_group)
  File "/x/multiprocessing/popen_fork.py", line 71, in _launch
    code = process_obj._bootstrap(parent_sentinel=child_r)
  File "/x/wf_launch/rank/entrypoint.py", line 207, in rank_main
    _join(r, task)
  File "/x/wf_launch/rank/entrypoint.py", line 136, in _join
    device = dist_init(...)
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 1899, in init_process_group
    store = rendezvous(...)
RuntimeError: timed out
"""
    spot = stacks.spot_of(stacks.parse_traceback(tb))
    assert spot.frame == stacks.Frame("/x/wf_launch/rank/entrypoint.py", 136, "_join")
    assert spot.waits_in == "init_process_group"


def test_rank_ranges() -> None:
    assert stacks.rank_ranges([0, 1, 2, 3, 4, 6, 7]) == "0-4,6,7"
    assert stacks.rank_ranges([5]) == "5" and stacks.rank_ranges([1, 2]) == "1,2"
    assert stacks.rank_ranges(range(64)) == "0-63"
