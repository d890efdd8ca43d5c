"""What one ``task=noop`` sweep point does, as a plain torchrun script: init gloo, one barrier,
destroy.

torchrun --standalone --nproc-per-node=N scripts/torchrun_equivalent.py
"""

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
