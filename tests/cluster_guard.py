"""Test clusters never outlive the pytest run that started them.

A fixture that starts a cluster (``tests/slurm_fixture.py``, ``tests/ray_fixture.py``) ``claim``s
its state folder: ``<folder>.owner`` beside it names the processes the cluster lives for (the pytest
process and, under xdist, its controller, each with its start time), and a guardian, started in its
own session, waits on their exit (a pidfd, no polling). When one of them ends while the cluster
still runs (pytest was killed with SIGKILL, or a timeout killed the run), the guardian stops the
cluster. Three more nets catch the rest:

- before a fixture starts a cluster, it ``reap``s every cluster whose owners are gone (the
  guardian itself was killed too);
- ``.ci/run`` gives the suite a temporary folder of its own and, on any exit (a trap),
  runs ``python tests/cluster_guard.py reap --all DIR``;
- SIGTERM of pytest is turned into KeyboardInterrupt (``tests/conftest.py``), so the session
  fixtures' teardown stops their clusters as Ctrl-C does.

Usage: ``python tests/cluster_guard.py reap [--all] [DIR]`` (default: the temporary folder);
``python tests/cluster_guard.py guard STATE`` is what ``claim`` starts.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "slurm": REPO / "scripts" / "slurm_cluster.sh",
    "ray": REPO / "scripts" / "ray_cluster.sh",
}
"""Cluster kind -> the script that starts and stops it; a state folder is ``wf-<kind>-*``."""

OWNER = ".owner"
"""Suffix of the claim beside a state folder (the scripts own the folder's contents)."""
STOP_TIMEOUT_S = 180


def state_dir(kind: str) -> Path:
    """A new state folder for a cluster of ``kind`` in the temporary folder."""
    return Path(tempfile.mkdtemp(prefix=f"wf-{kind}-"))


def kind_of(state: Path) -> str:
    return state.name.split("-")[1]


def claim_file(state: Path) -> Path:
    return state.with_name(state.name + OWNER)


def owners() -> list[dict[str, float]]:
    """The processes a cluster started from here lives for: this one and, in an xdist
    worker, the controller that started it."""
    pids = [os.getpid()]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pids.append(os.getppid())
    return [{"pid": pid, "started": psutil.Process(pid).create_time()} for pid in pids]


def alive(owner: dict[str, float]) -> bool:
    """The process is still the one recorded (same pid, same start time) and not a zombie."""
    try:
        proc = psutil.Process(int(owner["pid"]))
        return proc.create_time() == owner["started"] and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_owners(state: Path) -> list[dict[str, float]] | None:
    try:
        return json.loads(claim_file(state).read_text())
    except (OSError, ValueError):
        return None


def claim(state: Path) -> subprocess.Popen[bytes]:
    """Record this run as ``state``'s owner and start the guardian; before the cluster starts,
    so that a run killed during the start leaves nothing either."""
    tmp = state.with_name(f".{state.name}{OWNER}")
    tmp.write_text(json.dumps(owners()))
    os.replace(tmp, claim_file(state))
    return subprocess.Popen(
        [sys.executable, __file__, "guard", str(state)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@contextmanager
def locked(state: Path) -> Iterator[bool]:
    """Hold the lock of ``state``'s claim (the guardian, a reaper and the fixture may all
    try to stop it); yields whether the cluster is still claimed, so still to stop."""
    try:
        fd = os.open(claim_file(state), os.O_RDONLY)
    except FileNotFoundError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield claim_file(state).exists()
    finally:
        os.close(fd)


def stop(state: Path) -> str | None:
    """Stop the cluster in ``state``, remove the folder and the claim: '' once done, the error,
    or None when it was no longer claimed (another stopper, say the guardian, got there first)."""
    with locked(state) as claimed:
        if not claimed:
            return None
        if state.is_dir() and any(state.iterdir()):  # empty: the start never began
            out = subprocess.run(
                ["bash", str(SCRIPTS[kind_of(state)]), "stop", "--dir", str(state)],
                text=True,
                capture_output=True,
                timeout=STOP_TIMEOUT_S,
            )
            if out.returncode != 0:
                return f"stopping the cluster in {state} failed:\n{out.stderr}"
        shutil.rmtree(state, ignore_errors=True)
        claim_file(state).unlink()
        return ""


def orphaned(state: Path) -> bool:
    """A claimed cluster with an owner that has ended."""
    recorded = read_owners(state)
    return recorded is not None and not all(alive(o) for o in recorded)


def reap(root: Path, everything: bool = False) -> list[Path]:
    """Stop every claimed cluster under ``root`` whose owners have ended (every claimed one
    with ``everything``); the folders stopped. Unclaimed folders are never touched."""
    stopped = []
    for kind in SCRIPTS:
        for claim in sorted(root.glob(f"wf-{kind}-*{OWNER}")):
            state = claim.with_name(claim.name.removesuffix(OWNER))
            if everything or orphaned(state):
                error = stop(state)
                if error:
                    print(error, file=sys.stderr)
                elif error is not None:
                    stopped.append(state)
    return stopped


def guard(state: Path) -> None:
    """Wait until one of ``state``'s owners ends, then stop its cluster if it still runs."""
    recorded = read_owners(state) or []
    fds = []
    for owner in recorded:
        try:
            fds.append(os.pidfd_open(int(owner["pid"])))
        except ProcessLookupError:
            fds = []
            break
    if fds and all(alive(o) for o in recorded):
        select.select(fds, [], [])
    stop(state)


def main(argv: list[str]) -> int:
    if argv[:1] == ["guard"] and len(argv) == 2:
        guard(Path(argv[1]))
        return 0
    if argv[:1] == ["reap"]:
        everything = "--all" in argv
        rest = [a for a in argv[1:] if a != "--all"]
        root = Path(rest[0]) if rest else Path(tempfile.gettempdir())
        for state in reap(root, everything):
            print(f"stopped the test cluster left in {state}")
        return 0
    print("usage: cluster_guard.py reap [--all] [DIR] | guard STATE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
