"""In a rank: dump every thread's Python stack on :data:`DUMP_SIGNAL`, and say where to send it.

``faulthandler`` appends the dump to ``logs/rank{r}.stacks`` (it works while a thread
is blocked inside a C++ collective, and needs no ptrace); ``logs/rank{r}.pid`` (pid,
host, main thread id) lets a launcher or ``python -m wf_launch.status --stacks``
find and signal the rank. :mod:`wf_launch.observe.stacks` reads and groups the dumps.

SIGURG is the signal: its default action is to be ignored (a batch shell or a
process that did not register it is not killed), and neither SLURM nor submitit
(USR2, TERM) uses it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from ..rundir import files

__all__ = ["DUMP_SIGNAL", "NODE_ENV", "install"]

DUMP_SIGNAL = signal.SIGURG
NODE_ENV = "WF_NODE"
"""The node a rank runs on, as its launcher names it (SLURM's node name, Ray's node id); the host by default."""


def install(run_dir: Path | str, rank: int) -> Any:
    """Dump every thread's stack to the rank's stacks file on :data:`DUMP_SIGNAL`; returns the open file."""
    import faulthandler

    path = files.rank_stacks(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")  # noqa: SIM115 - kept open for faulthandler until exit
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "main_thread": threading.main_thread().ident,
            "node": os.environ.get(NODE_ENV) or socket.gethostname()}
    pid_file = files.rank_pid(run_dir, rank)
    tmp = pid_file.with_name(pid_file.name + ".tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(pid_file)
    return f
