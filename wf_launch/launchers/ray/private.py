"""A private Ray instance (``launcher.address`` null): started for one run, for its user only.

Ray's defaults open a local instance to every user of the machine (servers on every interface,
a 0644 token in ``~/.ray``), so another user could join as a node and run code as ours. A
private instance binds loopback only, keeps its token (0600) and temp dir in a 0700 dir made
for the run, and on :meth:`PrivateInstance.close` kills every process carrying its marker.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path

from . import ray_adapter as rt

MARKER_ENV = "WF_RAY_PRIVATE"
"""Set (to the run directory) in the environment of every process of a private instance."""


def private_marker(run_dir: str) -> str:
    return f"{MARKER_ENV}={run_dir}"


def _set_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """Set (None: unset) each variable; what they were."""
    saved = {key: os.environ.get(key) for key in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return saved


class PrivateInstance:
    """The run's own Ray instance on this machine: its temp dir, its token, its processes."""

    def __init__(self, run_dir: str) -> None:
        self.marker = private_marker(run_dir)
        self.home = Path(tempfile.mkdtemp(prefix="wfray-", dir="/tmp"))  # short: socket paths
        self.token_file = self.home / "auth_token"
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self._saved: dict[str, str | None] = {}

    def start(self, cpus: float, namespace: str | None) -> str:
        """Start the instance and connect this process to it; its GCS address."""
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": None}
        self._saved = _set_env({**auth, "RAY_AUTH_TOKEN_PATH": str(self.token_file)})
        rt.reset_auth_token()
        os.environ[MARKER_ENV] = self.marker.partition("=")[2]  # inherited by its processes
        try:
            # In this (the main) thread: its processes die with the thread that started them.
            with rt.loopback():
                rt.start_private(cpus, namespace, str(self.home / "ray"))
        finally:
            os.environ.pop(MARKER_ENV, None)
        return rt.gcs_address()

    def close(self) -> None:
        """Stop the instance: every process of it left is killed, its temp dir removed."""
        rt.shutdown()
        reap(self.marker)
        shutil.rmtree(self.home, ignore_errors=True)
        _set_env(self._saved)
        self._saved = {}
        rt.reset_auth_token()


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` ('NAME=VALUE')."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                zombie = f.read().rpartition(b")")[2].split()[0] == b"Z"
        except (OSError, IndexError):
            continue
        if marker.encode() in env and not zombie:
            found.append(int(entry.name))
    return found


def reap(marker: str, grace_s: float = 5.0) -> None:
    """Kill (TERM, then KILL) every process still carrying ``marker``: what ``ray.shutdown``
    left."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        pids = marked_pids(marker)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = marked_pids(marker)
        if not pids:
            return
