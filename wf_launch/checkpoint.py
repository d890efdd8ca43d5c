"""``from wf_launch.checkpoint import Checkpointer``: the checkpointer a task uses (:mod:`wf_launch.rank.checkpoint`)."""

from wf_launch.rank.checkpoint import COMMIT_FILE, Checkpointer, complete_checkpoints

__all__ = ["COMMIT_FILE", "Checkpointer", "complete_checkpoints"]
