"""A rank's pid file (``logs/rank{r}.pid``), and the one check a pid read from a run passes before
it is signalled.

A pid in a file is a claim, not a process: the rank may have died and its pid been
given to an unrelated process; the file may hold ``0`` or ``-1`` (which ``kill``
reads as "the whole process group" and "every process you may signal"), or a pid of
another host. :func:`live_rank_pid` gives the pid only when it is still that rank's
process on this host: a number above 1 that is not this process, alive, and started
when the rank did (its start time in ``/proc``, recorded in the file, must match; a
file without it is trusted only for a process that started before the file was written).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from worldfoundry.core.validation import is_int

from . import files
from .io import read_json

__all__ = [
    "NODE_ENV",
    "die_with_parent",
    "live_rank_pid",
    "live_recorded_pid",
    "pid_record",
    "process_start",
    "read_pid_file",
    "write_pid_file",
]


NODE_ENV = "WF_NODE"
"""The node a rank runs on, as its launcher names it (SLURM's node name, Ray's node id); the host by
default."""


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``); None where
    unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        return int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started, as a Unix time (from ``/proc``); None where unknown."""
    ticks = process_start(pid)
    try:
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK") if ticks is not None else None
    except (OSError, ValueError, StopIteration):
        return None


def pid_record() -> dict[str, Any]:
    """What a rank records about its own process: pid, host, main thread, start time, node."""
    host = socket.gethostname()
    return {
        "pid": os.getpid(),
        "host": host,
        "main_thread": threading.main_thread().ident,
        "start": process_start(os.getpid()),
        "node": os.environ.get(NODE_ENV) or host,
    }


def write_pid_file(run_dir: Path | str, rank: int) -> None:
    """Record this process as rank ``rank``'s (replaced atomically; no fsync: it matters only while
    the rank lives)."""
    path = files.rank_pid(run_dir, rank)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(pid_record()))
    tmp.replace(path)


def read_pid_file(run_dir: Path | str, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s pid record (None when there is none, or it is not one: a pid that is not an
    int above 0)."""
    return _read_record(files.rank_pid(run_dir, rank))


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        data = read_json(path, 1 << 16)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not (is_int(data.get("pid")) and data["pid"] > 0):
        return None
    return data


def live_rank_pid(run_dir: Path | str, rank: int) -> int | None:
    """The pid of rank ``rank``'s process if it is safe to signal (see the module's docstring), else
    None."""
    return live_recorded_pid(files.rank_pid(run_dir, rank))


def live_recorded_pid(path: Path) -> int | None:
    """The pid of the process recorded in the pid record at ``path`` (a rank's, the Lighthouse's)
    if it is safe to signal, else None."""
    info = _read_record(path)
    if info is None or info.get("host") != socket.gethostname():
        return None
    pid = info["pid"]
    if pid <= 1 or pid == os.getpid() or pid > 2**22:
        return None
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, OverflowError):
        return None
    recorded = info.get("start")
    if is_int(recorded):
        return pid if process_start(pid) == recorded else None
    started = _started_at(pid)
    try:
        written = path.stat().st_mtime
    except OSError:
        return None
    return pid if started is None or started <= written + 1.0 else None


def die_with_parent(signum: int) -> None:
    """Ask Linux to send this process ``signum`` when its parent dies (``PR_SET_PDEATHSIG``), so
    ranks, replica groups and tune rounds never outlive what started them; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # 1: PR_SET_PDEATHSIG
        except OSError:
            pass
