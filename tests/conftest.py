"""Suite-wide set-up: the cluster fixtures, the cluster markers, and the xdist scheduler.

A test that uses the SLURM or the Ray test cluster is marked ``slurm`` or ``ray``; a test that takes
a cluster fixture without its marker fails before the cluster starts. Under ``pytest -n N`` the
marked tests of each kind run on one worker, so each session fixture starts its cluster once.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Forked ranks hang if the parent ever ran a multi-threaded op before forking.
torch.set_num_threads(1)

# A command started in the background by a non-interactive shell (as .ci/run starts pytest)
# inherits SIGINT ignored, and so would every process a test starts: a Ctrl-C the test sends
# to `status --follow` would do nothing. The tests' processes get a terminal's Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["slurm_fixture", "ray_fixture"]

CLUSTER_MARKERS = {"slurm": "slurm_cluster", "ray": "ray_cluster"}
"""Marker -> the session fixture that starts that test cluster."""

GROUPS_DIR = "wf_cluster_groups"
"""Key of ``workerinput`` naming the folder where each xdist worker writes its groups."""
GROUPS_KEY = pytest.StashKey[str]()
"""The controller's own record of that folder."""


def cluster_group(item: pytest.Item) -> str | None:
    """The cluster marker of ``item`` (``slurm``, ``ray``), or None."""
    marks = [name for name in CLUSTER_MARKERS if item.get_closest_marker(name)]
    return marks[0] if len(marks) == 1 else None


def worker_group(item: pytest.Item) -> str | None:
    """The group whose tests share one worker: the cluster marker, else the name given by
    ``@pytest.mark.xdist_group`` (a module whose module-scoped fixture launches runs: on one
    worker it launches them once), else None (any free worker)."""
    group = cluster_group(item)
    if group is not None:
        return group
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.kwargs.get("name", mark.args[0] if mark.args else "xdist_group"))


def misuse(item: pytest.Item) -> str | None:
    """Why ``item`` cannot run with the cluster markers it has (None: it can): it uses a
    cluster fixture (directly or through another fixture) without that cluster's marker, or
    it is marked for both clusters."""
    used = getattr(item, "fixturenames", ())
    marks = [name for name in CLUSTER_MARKERS if item.get_closest_marker(name)]
    if len(marks) > 1:
        return f"{item.nodeid} is marked {' and '.join(marks)}: one worker runs each cluster"
    for marker, fixture in CLUSTER_MARKERS.items():
        if fixture in used and marker not in marks:
            return (
                f"{item.nodeid} uses {fixture} but is not marked {marker} "
                f"(@pytest.mark.{marker}: the scheduler keeps those tests on the worker "
                "that runs that cluster)"
            )
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test that misuses the cluster markers fails before any fixture starts a cluster."""
    reason = misuse(item)
    if reason:
        pytest.fail(reason, pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, tell the controller which tests need which cluster."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or GROUPS_DIR not in workerinput:
        return
    groups = {item.nodeid: g for item in items if (g := worker_group(item))}
    folder = Path(workerinput[GROUPS_DIR])
    tmp = folder / f".{workerinput['workerid']}.json"
    tmp.write_text(json.dumps(groups))
    os.replace(tmp, folder / f"{workerinput['workerid']}.json")


def read_groups(folder: Path) -> dict[str, str]:
    """Node id -> cluster marker, as the workers wrote them (every worker collects
    the same tests, so any complete file will do; they are merged)."""
    groups: dict[str, str] = {}
    for path in sorted(folder.glob("*.json")):
        groups.update(json.loads(path.read_text()))
    return groups


def make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``pytest -n N --dist loadgroup``: every test marked ``slurm`` runs on one
    worker and every test marked ``ray`` on one worker, so each session fixture starts its
    cluster once (two clusters of a kind side by side would share this machine's cores and
    see each other's processes); so do the tests of one ``xdist_group`` (see
    :func:`worker_group`); every other test goes wherever a worker is free.

    The workers collect and the controller schedules, and only node ids travel between
    them (pytest 9's node ids can no longer carry xdist's ``@group`` suffix), so each
    worker writes its groups to a file at collection (see pytest_collection_modifyitems);
    the scheduler reads them when it first splits, after every worker's collection ended.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling  # optional: only under pytest-xdist

    folder = Path(config.stash[GROUPS_KEY])

    class ClusterGroups(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = read_groups(folder)
            return self.groups.get(nodeid, nodeid)

    return ClusterGroups(config, log)


def configure_controller(config: pytest.Config) -> None:
    """The controller's folder for the workers' group files (removed at the end)."""
    if not hasattr(config, "workerinput"):
        config.stash[GROUPS_KEY] = tempfile.mkdtemp(prefix="wf-xdist-groups-")


def unconfigure_controller(config: pytest.Config) -> None:
    if GROUPS_KEY in config.stash:
        shutil.rmtree(config.stash[GROUPS_KEY], ignore_errors=True)


def configure_node(node: object) -> None:
    """Hand each worker the controller's folder for its group file."""
    node.workerinput[GROUPS_DIR] = node.config.stash[GROUPS_KEY]


def interrupt_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM (a timeout, a CI runner giving up) ends pytest as Ctrl-C does, so the session
    fixtures' teardown stops the test clusters (tests/cluster_guard.py catches SIGKILL)."""
    if os.getpid() != PYTEST_PID:  # a forked rank dies of SIGTERM as it would without us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise KeyboardInterrupt(f"signal {signum}")


PYTEST_PID = os.getpid()


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    if importlib.util.find_spec("xdist") is not None:
        configure_controller(config)


if importlib.util.find_spec("xdist") is not None:  # not installed in the wheel check
    pytest_unconfigure = unconfigure_controller
    pytest_configure_node = configure_node
    pytest_xdist_make_scheduler = make_scheduler


@pytest.fixture(scope="module")
def other_user() -> Iterator[str]:
    """A real second Unix user (made for the module's tests, removed after); root only."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("a second Unix user needs root, useradd and runuser")
    name = f"wf_other{os.getpid() % 100000}"
    made = subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], capture_output=True)
