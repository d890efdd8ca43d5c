import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

# Forked ranks hang if the parent ever ran a multi-threaded op before forking.
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["slurm_fixture", "ray_fixture"]


_CLUSTER_FIXTURES = {
    "slurm": re.compile(r"def \w+\([^)]*\bslurm_cluster\b|mark\.slurm\b"),
    "ray": re.compile(r"def \w+\([^)]*\bray_cluster\b|mark\.ray\b"),
}


def _cluster_groups(tests: Path) -> dict[str, str]:
    """Test file (``tests/test_x.py``) -> the test cluster its tests use (``slurm``, ``ray``), read from the source:
    a test that takes the ``slurm_cluster`` / ``ray_cluster`` fixture, or a module marked ``slurm`` / ``ray``."""
    groups = {}
    for path in sorted(tests.glob("test_*.py")):
        text = path.read_text()
        for group, pattern in _CLUSTER_FIXTURES.items():
            if pattern.search(text):
                groups[f"{tests.name}/{path.name}"] = group
    return groups


def _make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``pytest -n N --dist loadgroup``: every test file that uses the SLURM test cluster runs on one worker,
    and every one that uses the Ray cluster on one worker, so each session fixture starts its cluster once (two
    clusters of a kind side by side would share this machine's cores and see each other's processes); every other
    test goes wherever a worker is free. (pytest-xdist's own ``xdist_group`` marker does not reach the scheduler
    under pytest 9, whose node ids it can no longer suffix.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    groups = _cluster_groups(Path(__file__).parent)

    class ClusterGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return groups.get(nodeid.split("::", 1)[0], nodeid)

    return ClusterGroups(config, log)


if (
    importlib.util.find_spec("xdist") is not None
):  # the hook exists only with pytest-xdist (not in the wheel check)
    pytest_xdist_make_scheduler = _make_scheduler
