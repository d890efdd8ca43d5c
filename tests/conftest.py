import sys
from pathlib import Path

import torch

# Forked ranks hang if the parent ever ran a multi-threaded op before forking.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["slurm_fixture", "ray_fixture"]


_SHARED_CLUSTERS = {"slurm_cluster": "slurm", "ray_cluster": "ray"}
"""Session fixtures that start one cluster each: under ``pytest -n`` (pytest-xdist, ``--dist loadgroup``) every
test that uses one runs on the same worker, so each cluster is started once and never twice side by side."""


def pytest_collection_modifyitems(config, items):  # noqa: ANN001, ANN201 - pytest's hook signature
    import pytest

    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        group = next((g for f, g in _SHARED_CLUSTERS.items() if f in names), None)
        group = group or next((m for m in ("slurm", "ray") if item.get_closest_marker(m)), None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
