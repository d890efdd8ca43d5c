"""What code without ``ctx`` uses: ``from wf_launch import progress, should_stop, checkpoint,
report_result``.

The same contract as ``ctx.progress``, ``ctx.should_stop()`` and ``ctx.checkpoint``
(:class:`~wf_launch.rank.task_context.TaskContext`), for a script or a function that
wf_launch runs (``task=script``, ``task=call``) and for any task's helper code: the
rank entrypoint binds its context here before the task starts (:func:`bind`).

Outside a wf_launch rank (the same script under plain ``torchrun``, or ``python
train.py``) nothing is bound and every helper is a harmless no-op: ``progress`` does
nothing, ``should_stop()`` is False, ``checkpoint.save`` saves nothing and
``checkpoint.load`` finds nothing (returns None), ``report_result`` only checks its
argument. A process forked from a rank (a ``DataLoader`` worker) gets the no-ops too:
only the rank's own process may report or take part in the stop agreement.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .task_context import TaskContext

__all__ = [
    "RESERVED_KEYS",
    "bind",
    "bound",
    "latest_step",
    "load",
    "progress",
    "report_result",
    "reported",
    "save",
    "should_stop",
    "unbind",
    "wait",
]

RESERVED_KEYS = frozenset({"exit_code"})
"""Keys of a rank's result that wf_launch fills itself (``report_result`` refuses them)."""

_state: dict[str, Any] = {"ctx": None, "pid": None, "reported": {}}


def bind(ctx: TaskContext) -> None:
    """Make the helpers act on this rank's context (the entrypoint calls it before the task)."""
    _state.update(ctx=ctx, pid=os.getpid(), reported={})


def unbind() -> None:
    """Back to the no-ops."""
    _state.update(ctx=None, pid=None, reported={})


def bound() -> TaskContext | None:
    """The rank's context in the rank's own process; None elsewhere (plain torchrun, a forked
    worker)."""
    return _state["ctx"] if _state["pid"] == os.getpid() else None


def progress(step: int, total: int | None = None, **metrics: Any) -> None:
    """Report this rank's step (of ``total``) and metrics: the live bar, stall warnings,
    ``metrics.jsonl``.

    Cheap (never a collective); call it every step. A no-op outside wf_launch.
    """
    ctx = bound()
    if ctx is not None:
        ctx.progress(step, total, **metrics)


def should_stop() -> bool:
    """Whether to stop at this step boundary (preemption, SIGTERM): the same answer on every rank.

    Collective once the script's process group is up: every rank calls it at the same
    steps. On True, save a checkpoint and end normally; on SLURM the job is then requeued
    and the script resumes from it. False outside wf_launch.
    """
    ctx = bound()
    return ctx.should_stop() if ctx is not None else False


def report_result(result: dict[str, Any]) -> None:
    """Add ``result`` (a JSON-able dict) to this rank's entry in ``result.json``; later calls update
    it.

    Rank 0's entry is the run's summary (the drill compares its ``weights_sha256`` and
    ``final_loss``). Checked everywhere, recorded only under wf_launch.
    """
    if not isinstance(result, dict):
        raise TypeError(f"report_result(result): expected a dict, got {type(result).__name__}")
    bad = [k for k in result if not isinstance(k, str)]
    if bad:
        raise TypeError(f"report_result(result): keys must be strings, got {bad[0]!r}")
    reserved = sorted(RESERVED_KEYS & set(result))
    if reserved:
        raise ValueError(
            f"report_result(result): {reserved[0]!r} is filled in by wf_launch; use another key"
        )
    try:
        json.dumps(result)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"report_result(result): not JSON-able: {exc}") from exc
    if bound() is not None:
        _state["reported"].update(result)


def reported() -> dict[str, Any]:
    """What this rank reported so far (a copy)."""
    return dict(_state["reported"]) if bound() is not None else {}


# ------------------------------------------------------------------ checkpoint (``from wf_launch
# import checkpoint``)
def save(step: int, state: dict[str, Any], scopes: dict[str, str] | None = None) -> None:
    """``checkpoint.save(step, state, scopes=None)``: a collective, atomic checkpoint of ``state``.

    As :meth:`wf_launch.checkpoint.Checkpointer.save` (``ctx.checkpoint.save``), under
    ``RUN_DIR/checkpoints``: ``scopes`` gives per-rank entries a scope (``replicated``,
    ``dp``, ``rank``, the default), which decides whether they load at another layout.
    Checked, then a no-op outside wf_launch.
    """
    if scopes is not None and not isinstance(scopes, dict):
        raise TypeError(
            f"checkpoint.save(scopes=...): expected a dict, got {type(scopes).__name__}"
        )
    ctx = bound()
    if ctx is not None:
        ctx.checkpoint.save(step, state, scopes)
        _settle()


def load(state: dict[str, Any], remap: dict[str, Callable[..., Any]] | None = None) -> int | None:
    """``checkpoint.load(state, remap=None)``: restore the newest complete checkpoint into
    ``state``; its step, or None.

    As ``ctx.checkpoint.load`` (``remap``: entry -> ``fn(saved_per_replica, dp_rank, dp_size)``
    for ``dp`` entries on a dp-size change). None outside wf_launch and when the run has no
    checkpoint yet (a first start).
    """
    ctx = bound()
    if ctx is None:
        return None
    step = ctx.checkpoint.load(state, remap)
    _settle()
    return step


def latest_step() -> int | None:
    """``checkpoint.latest_step()``: the step of the newest complete checkpoint, or None."""
    ctx = bound()
    return ctx.checkpoint.latest_step() if ctx is not None else None


def wait() -> None:
    """``checkpoint.wait()``: commit a pending save (collective; a no-op when none is pending)."""
    ctx = bound()
    if ctx is not None and ctx._checkpointer is not None:
        ctx._checkpointer.wait()
        _settle()


def _settle() -> None:
    """After the helpers' collectives: the script may destroy its group right after (see
    :func:`~worldfoundry.core.distributed.runtime.settle_group_threads`, a torch deadlock at
    teardown)."""
    # torch: the script API is importable, and a no-op, in a script that never imports torch
    from worldfoundry.core.distributed.runtime import settle_group_threads

    settle_group_threads()
