"""``from wf_launch.checkpoint import Checkpointer`` (:mod:`wf_launch.rank.checkpoint`); ``from
wf_launch import checkpoint`` then ``checkpoint.save(step, state)`` / ``checkpoint.load(state)``:
the run's checkpoints for code without ``ctx`` (:mod:`wf_launch.rank.script_api`, no-ops outside
wf_launch); ``python -m wf_launch.checkpoint`` exports and lists a run's checkpoints
(:mod:`wf_launch.readers.checkpoint`)."""

import sys

from wf_launch.rank.checkpoint import (
    COMMIT_FILE,
    Checkpointer,
    CheckpointRefused,
    Scope,
    complete_checkpoints,
)
from wf_launch.rank.script_api import latest_step, load, save, wait
from wf_launch.readers.checkpoint import main

__all__ = [
    "COMMIT_FILE",
    "CheckpointRefused",
    "Checkpointer",
    "Scope",
    "complete_checkpoints",
    "latest_step",
    "load",
    "main",
    "save",
    "wait",
]

if __name__ == "__main__":
    sys.exit(main())
