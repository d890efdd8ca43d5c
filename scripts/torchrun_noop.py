"""The torchrun baseline for ``task=noop``: init gloo, one barrier, destroy."""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
