"""Collective, atomic checkpoints of a task's state (``ctx.checkpoint``), on torch DCP, loadable on
another layout.

:class:`Checkpointer` saves and restores a dict of named things: ``nn.Module``s (plain or
FSDP2 / DTensor-sharded, EMA copies included) and optimizers, through DCP under global
parameter names, so they reshard on load at any layout (:mod:`.sharded`); and per-rank
entries (``torch.Generator``s, objects with ``state_dict`` / ``load_state_dict``, small
plain values) with a scope: replicated, per data-parallel replica, or per rank
(:mod:`.entries`), plus every rank's RNG states. ``COMMIT`` records the layout that saved
the checkpoint; a load on another layout reshards, re-derives what its scope allows, and
refuses on every rank what it cannot serve, naming the entry and both layouts.

Layout, under ``RUN_DIR/checkpoints/``::

    step_00000010/            a complete checkpoint (it has a COMMIT file)
        .metadata  __0_0.distcp ...   DCP: modules and optimizers, sharded as they lived
        rank_00000.pt ...             per rank: RNG states and the per-rank entries it owns
        COMMIT                        written last: step, commit order, layout, entries
    .step_00000020.tmp-<hex>/ a save in progress (or one a crash left behind)

The on-disk format (names, ``COMMIT``, which checkpoints are complete) is
:mod:`wf_launch.rundir.checkpoints`. Modules: :mod:`.safe_read`
(reading as data: a restricted unpickler for DCP's metadata), :mod:`.disk` (rank 0's commit,
recovery and pruning by commit order), :mod:`.per_rank`, :mod:`.sharded`, :mod:`.staging`
(async buffers), :mod:`.checkpointer`. ``docs/checkpointing.md`` is the user's guide.
"""

from ...rundir.checkpoints import COMMIT_FILE, CheckpointUnreadable, complete_checkpoints
from .checkpointer import Checkpointer, LoadReport
from .entries import Scope
from .safe_read import CheckpointRefused

__all__ = [
    "COMMIT_FILE",
    "CheckpointRefused",
    "CheckpointUnreadable",
    "Checkpointer",
    "LoadReport",
    "Scope",
    "complete_checkpoints",
]
