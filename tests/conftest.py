import sys
from pathlib import Path

import torch

# Forked ranks hang if the parent ever ran a multi-threaded op before forking.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["slurm_fixture", "ray_fixture"]
