"""``from wf_launch.checkpoint import Checkpointer`` (:mod:`wf_launch.rank.checkpoint`); ``python -m wf_launch.checkpoint``
exports and lists a run's checkpoints (:mod:`wf_launch.tools.checkpoint`)."""

import sys

from wf_launch.rank.checkpoint import (
    COMMIT_FILE,
    Checkpointer,
    CheckpointRefused,
    Scope,
    complete_checkpoints,
)
from wf_launch.tools.checkpoint import main

__all__ = ["COMMIT_FILE", "CheckpointRefused", "Checkpointer", "Scope", "complete_checkpoints", "main"]

if __name__ == "__main__":
    sys.exit(main())
