"""The bare baseline for ``task=noop``: torch's ``elastic_launch`` with fork, the same group walk,
no wf_launch.

Every worker initializes gloo, creates the groups wf_launch creates for a
``dp_size=N`` layout (every rank walks every group, identical member sets made
once), runs one barrier and tears down.

    python scripts/elastic_fork_equivalent.py N
"""

from __future__ import annotations

import sys
import uuid


def _worker(world: int) -> None:
    import torch
    import torch.distributed as dist

    from worldfoundry.core.distributed.topology import COMBINED, DIMS, Layout

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    layout = Layout(world, dp_size=world)
    made = {tuple(range(world))}
    for name in (*DIMS, *COMBINED):
        for members in layout.groups(name):
            if tuple(members) not in made:
                made.add(tuple(members))
                dist.new_group(members)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    import torch  # noqa: F401 - the parent imports torch once, as wf_launch does, then forks
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    world = int(sys.argv[1])
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        start_method="fork",
        monitor_interval=0.1,
        local_addr="127.0.0.1",
    )
    elastic_launch(config, _worker)(world)


if __name__ == "__main__":
    main()
