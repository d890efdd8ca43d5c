"""``from wf_launch.checkpoint import Checkpointer``: the checkpointer a task uses (:mod:`wf_launch.rank.checkpoint`);
``from wf_launch import checkpoint`` then ``checkpoint.save(step, state)`` / ``checkpoint.load(state)``: the run's own
checkpoints for code without ``ctx`` (:mod:`wf_launch.rank.script_api`, no-ops outside wf_launch)."""

from wf_launch.rank.checkpoint import COMMIT_FILE, Checkpointer, complete_checkpoints
from wf_launch.rank.script_api import latest_step, load, save, wait

__all__ = ["COMMIT_FILE", "Checkpointer", "complete_checkpoints", "latest_step", "load", "save", "wait"]
