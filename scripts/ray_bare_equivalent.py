"""What ``python -m wf_launch launcher=ray task=noop`` does, as a bare Ray script: the same
placement group and actors, a gloo group over them, one barrier, teardown.

    python scripts/ray_bare_equivalent.py ADDRESS WORLD_SIZE

One placement group of WORLD_SIZE one-CPU bundles (PACK), one actor per bundle; rank 0 gives its
node's address and a free port; every actor joins a gloo group (``init_process_group``), runs one
barrier and destroys it; then the actors are killed and the group removed.
"""

import os
import socket
import sys

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote(num_cpus=1)
class Rank:
    def where(self):
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def run(self, rank, world, addr, port):
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        dist.barrier()
        dist.destroy_process_group()
        return rank


def main():
    address, world = sys.argv[1], int(sys.argv[2])
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    pg = placement_group([{"CPU": 1}] * world, strategy="PACK")
    ray.get(pg.ready())
    actors = [
        Rank.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote()
        for i in range(world)
    ]
    addr, port = ray.get(actors[0].where.remote())
    assert sorted(
        ray.get([a.run.remote(r, world, addr, port) for r, a in enumerate(actors)])
    ) == list(range(world))
    for a in actors:
        ray.kill(a)
    remove_placement_group(pg)
    ray.shutdown()


if __name__ == "__main__":
    main()
