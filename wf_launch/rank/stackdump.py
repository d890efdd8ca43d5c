"""In a rank: dump every thread's Python stack on :data:`DUMP_SIGNAL`, and say where to send it.

``faulthandler`` appends the dump to ``logs/rank{r}.stacks`` (it works while a thread
is blocked inside a C++ collective, and needs no ptrace); ``logs/rank{r}.pid`` (pid,
host, main thread id, start time) lets a launcher or ``python -m wf_launch.status --stacks``
find and signal the rank. :mod:`wf_launch.observe.stacks` reads and groups the dumps.

SIGURG is the signal: its default action is to be ignored (a batch shell or a
process that did not register it is not killed), and neither SLURM nor submitit
(USR2, TERM) uses it.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.pids import NODE_ENV, write_pid_file

__all__ = ["DUMP_SIGNAL", "NODE_ENV", "install"]

DUMP_SIGNAL = signal.SIGURG


def install(run_dir: Path | str, rank: int) -> Any:
    """Dump every thread's stack to the rank's stacks file on :data:`DUMP_SIGNAL`; returns the open
    file."""
    import faulthandler

    path = files.rank_stacks(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")  # noqa: SIM115 - kept open for faulthandler until exit
    faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False)
    write_pid_file(run_dir, rank)
    return f
