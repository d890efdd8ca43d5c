"""``python -m wf_launch.rank.fresh_entry SPEC PARENT_PID``: a rank's fresh interpreter (see
:mod:`.fresh`).

Dies with its supervisor (``PR_SET_PDEATHSIG``), runs :func:`~.entrypoint.rank_main`
with the pickled spec and leaves the way every launcher's rank does: exit code 0 on
success, the rank's failure code otherwise, 0 for a requeue (``Preempted``), always
through :func:`~.hardexit.flush_and_exit` (no interpreter teardown, see there).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys

from ..rundir.pids import die_with_parent
from .entrypoint import Preempted, rank_main
from .fresh import mark_fresh
from .hardexit import exit_status, flush_and_exit

__all__ = ["main"]


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the supervisor) dies; leave now if it already has."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str]) -> None:
    """Load the spec at ``argv[0]`` (and delete it), run the rank, exit with its code."""
    _die_with(int(argv[1]))
    mark_fresh()
    with open(argv[0], "rb") as f:
        spec = pickle.load(f)
    os.unlink(argv[0])
    try:
        rank_main(spec)
    except Preempted:
        flush_and_exit(0)
    except BaseException as exc:
        flush_and_exit(exit_status(exc))
    flush_and_exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
