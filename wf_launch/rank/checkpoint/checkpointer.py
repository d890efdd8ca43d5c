"""The :class:`Checkpointer`: collective saves and loads, committed atomically, loadable on another
layout."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from worldfoundry.core.distributed import groups
from worldfoundry.core.distributed.backends import group_device
from worldfoundry.core.distributed.env import launch_attempt
from worldfoundry.core.distributed.topology import Layout
from worldfoundry.core.validation import is_int

from ...rundir import files
from ...rundir.attempts import update
from ...rundir.checkpoints import (
    CheckpointUnreadable,
    Commit,
    complete_checkpoints,
    describe_layout,
    layout_dict,
    read_commit,
    step_name,
)
from ...rundir.space import disk_full, full_disk_error
from .disk import Disk
from .entries import Plan, classify, derive_rng, set_rng_states
from .per_rank import check_present, read_payloads, resolve, restore, write_rank_file
from .safe_read import CheckpointRefused, read_metadata
from .sharded import global_state_dicts, load_sharded
from .staging import CachedStager

__all__ = ["Checkpointer", "LoadReport"]


def _log() -> Any:
    from loguru import logger

    return logger


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


@dataclass
class LoadReport:
    """What :meth:`Checkpointer.load` did: the step, the two layouts, and what a layout change
    re-derived.

    ``layout_from`` / ``layout_to``: the saving and the loading layout (as ``COMMIT`` records
    them; ``layout_from`` is None for a format-1 checkpoint). ``rederived``: ``dp`` entries
    left as the task built them (dp size changed, no ``remap``); ``remapped``: those the
    task's ``remap`` computed. ``rng``: ``restored``, or how the RNG states were re-derived.
    ``fell_back``: ``(step, why)`` of newer checkpoints that could not be read.
    """

    step: int
    path: Path
    layout_from: dict[str, Any] | None
    layout_to: dict[str, Any]
    changed: bool
    rederived: list[str] = field(default_factory=list)
    remapped: list[str] = field(default_factory=list)
    rng: str = "restored"
    fell_back: list[tuple[int, str]] = field(default_factory=list)


def _check_remap(remap: Any, plan: Plan) -> dict[str, Callable[..., Any]]:
    if remap is None:
        return {}
    if not isinstance(remap, dict):
        raise ValueError(
            f"remap={remap!r} must be a dict of entry name -> callable(saved, dp_rank, dp_size)"
        )
    for name, fn in remap.items():
        if name not in plan.kinds:
            raise ValueError(
                f"remap[{name!r}]: no per-rank entry {name!r} in state (entries: "
                f"{sorted(plan.kinds)})"
            )
        if not callable(fn):
            raise ValueError(
                f"remap[{name!r}]={fn!r} must be callable(saved: list, dp_rank: int, dp_size: int)"
            )
    return dict(remap)


class Checkpointer:
    """Collective, atomically committed DCP checkpoints under ``RUN_DIR/checkpoints`` (see the
    package doc).

    ``keep``: how many complete checkpoints to keep (the newest commits). ``async_save``:
    write in the background; the next ``save`` / ``wait`` / ``load`` / ``close`` commits.
    ``process_group``: the group of ranks that save together (None: the default group).
    ``layout``: the ranks' parallel layout (None: the one ``initialize_model_parallel``
    built, else every rank a data-parallel replica). ``seed``: what RNG states are
    re-derived from after a layout change (with the step and the rank).
    ``record_attempt``: rank 0 records the loaded step (and a layout change) in this
    launch attempt's record; ``ctx.checkpoint`` sets it. Every method except
    :meth:`latest_step` is collective over the group.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        keep: int = 3,
        async_save: bool = False,
        process_group: Any = None,
        record_attempt: bool = False,
        layout: Layout | None = None,
        seed: int = 0,
    ) -> None:
        if not is_int(keep) or keep < 1:
            raise ValueError(
                f"keep={keep!r} must be an int >= 1 (how many complete checkpoints to keep)"
            )
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save={async_save!r} must be a bool")
        if run_dir is None or not str(run_dir):
            raise ValueError(f"run_dir={run_dir!r} must be a directory path")
        if layout is not None and not isinstance(layout, Layout):
            raise ValueError(
                f"layout={layout!r} must be a worldfoundry.core.distributed.topology.Layout or None"
            )
        if not is_int(seed):
            raise ValueError(f"seed={seed!r} must be an int")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / files.CHECKPOINTS
        self.keep = keep
        self.async_save = async_save
        self.process_group = process_group
        self.record_attempt = record_attempt
        self.seed = seed
        self.last_load: LoadReport | None = None
        self._fixed_layout = layout
        self._disk = Disk(self.root, keep, warn=lambda message: _log().warning(message))
        self._async_group: Any = None
        self._held: Any = (
            None  # the last control collective's tensor, kept alive: see settle_group_threads
        )
        self._pending: tuple[Any, Commit, Path] | None = None  # (future, commit record, temp dir)
        self._stager: CachedStager | None = None

    # ----------------------------------------------------------------- group helpers
    def _dist(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if self._dist() else 0

    def _world(self) -> int:
        return dist.get_world_size(self.process_group) if self._dist() else 1

    def _control_device(self) -> Any:

        return group_device(self.process_group, control=True)

    def _max(self, *values: int) -> Any:
        """All-reduce MAX of ints over the group: the agreement primitive (and a barrier).

        One value: returns an int; several: a tuple of ints.
        """
        if self._dist():
            import torch

            t = torch.tensor(values, dtype=torch.int64, device=self._control_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
            self._held = t
            values = tuple(int(v) for v in t.tolist())
        return values[0] if len(values) == 1 else tuple(values)

    def _from_rank0(self, value: int) -> int:
        if not self._dist():
            return value
        import torch

        t = torch.tensor(
            [value if self._rank() == 0 else 0], dtype=torch.int64, device=self._control_device()
        )
        dist.broadcast(t, group_src=0, group=self.process_group)
        self._held = t
        return int(t.item())

    def _dcp_group(self) -> Any:
        """The group DCP's own collectives run on: a dedicated gloo group when saving
        asynchronously."""
        if not (self.async_save and self._dist()):
            return self.process_group
        if self._async_group is None:
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            self._async_group = dist.new_group(
                ranks=ranks, backend="gloo", use_local_synchronization=True
            )
        return self._async_group

    def layout(self) -> Layout:
        """The layout of the ranks saving and loading now (see the class doc)."""
        world = self._world()
        if self._fixed_layout is not None:
            if self._fixed_layout.world_size != world:
                raise ValueError(
                    f"layout={self._fixed_layout.describe()} does not match the group's {world} "
                    "rank(s)"
                )
            return self._fixed_layout

        if self.process_group is None and groups.model_parallel_is_initialized():
            layout = groups.get_layout()
            if layout.world_size == world:
                return layout
        return Layout(world)

    # ----------------------------------------------------------------- save
    def save(self, step: int, state: dict[str, Any], scopes: dict[str, str] | None = None) -> None:
        """Checkpoint ``state`` as ``step`` (collective: every rank, the same step and entries).

        ``scopes`` gives per-rank entries a scope (``replicated``, ``dp``, ``rank``; the
        default ``rank``): see :class:`~wf_launch.rank.checkpoint.Scope`.
        """
        if not is_int(step) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        plan = classify(state, scopes)
        self.wait()  # commit the previous async save first
        sig = plan.signature()
        high, neg_low, sig_high, neg_sig_low = self._max(
            step, -step, sig, -sig
        )  # one collective: the same path
        if high != step or -neg_low != step:
            raise ValueError(f"step={step}: every rank must save the same step")
        if sig_high != sig or -neg_sig_low != sig:
            raise ValueError(
                f"step={step}: every rank must save the same per-rank entries with the same scopes "
                f"(this rank: {plan.entries()})"
            )
        layout = self.layout()
        token = self._from_rank0(uuid.uuid4().int >> 65)  # the same temp dir name on every rank
        tmp = self.root / f".{step_name(step)}.tmp-{token:016x}"
        error: BaseException | None = None
        sd: dict[str, Any] = {}
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            write_rank_file(tmp, self._rank(), layout, plan)
            sd = global_state_dicts(plan)
        except Exception as e:  # agree before DCP's collectives, or the other ranks would hang
            error = e
        self._give_up_if_failed(step, tmp, error, "its per-rank state")
        commit = Commit(
            step=step, world_size=self._world(), layout=layout_dict(layout), entries=plan.entries()
        )
        self._write_sharded(sd, commit, tmp)

    def _write_sharded(self, sd: dict[str, Any], commit: Commit, tmp: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.api import CheckpointException

        writer = FileSystemWriter(str(tmp), sync_files=True)
        group = self._dcp_group()
        if self.async_save and self._dist():
            if self._stager is None:
                self._stager = CachedStager()
            future = dcp.async_save(
                sd, storage_writer=writer, process_group=group, async_stager=self._stager
            )
            self._pending = (future, commit, tmp)
            return
        error: BaseException | None = None
        try:
            dcp.save(sd, storage_writer=writer, process_group=group, no_dist=not self._dist())
        except (Exception, CheckpointException) as e:  # on every rank when one failed to write
            error = e  # (a CheckpointException is a BaseException)
        self._give_up_if_failed(commit.step, tmp, error, "its shards")
        self._commit(commit, tmp)

    def wait(self) -> None:
        """Wait for the pending async save, then commit it (collective; a no-op when none is
        pending)."""
        if self._pending is None:
            return
        from torch.distributed.checkpoint.api import CheckpointException

        future, commit, tmp = self._pending
        self._pending = None
        error = None
        try:
            result = future.result()
            if hasattr(result, "upload_completion"):  # an AsyncSaveResponse
                result.upload_completion.result()
        except (Exception, CheckpointException) as e:  # agree with the other ranks first
            error = e
        self._give_up_if_failed(commit.step, tmp, error, "its shards")
        self._commit(commit, tmp)

    def _give_up_if_failed(
        self, step: int, tmp: Path, error: BaseException | None, what: str
    ) -> None:
        """Collective: if any rank failed to write ``what`` of ``step``, remove ``tmp`` and raise on
        every rank; nothing is committed, the last complete checkpoint stays.

        Removing the partial checkpoint gives back the space a full disk needs for the run's
        records; a full disk (on any rank) is raised as ``OSError(ENOSPC)`` naming the checkpoint
        folder, the root cause the run's record keeps (DCP's own error would read ``unexpected
        pos``).
        """
        full = int(error is not None and disk_full(self.root, error))
        failed, full = self._max(int(error is not None), full)
        if not failed:
            return
        if self._rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self._max(0)
        if full:
            raise full_disk_error(
                self.root, f"checkpoint step {step} not saved; the last complete one is kept"
            ) from error
        problem = _first_line(error) if error is not None else "another rank failed"
        raise RuntimeError(
            f"checkpoint step {step}: a rank could not write {what} ({problem}); "
            "nothing was committed"
        ) from error

    def _commit(self, commit: Commit, tmp: Path) -> None:
        """Barrier, then rank 0 commits ``tmp`` (:meth:`.disk.Disk.commit`); every rank learns the
        outcome."""
        self._max(0)  # every rank has finished writing
        ok, message = 1, ""  # 1: committed, 0: not, 2: not, the disk being full
        if self._rank() == 0:
            try:
                self._disk.commit(tmp, commit)
            except OSError as e:
                ok, message = 2 if disk_full(self.root, e) else 0, _first_line(e)
                shutil.rmtree(tmp, ignore_errors=True)  # never moved in place: not a checkpoint
        ok = self._from_rank0(ok)
        if ok == 2:
            raise full_disk_error(
                self.root,
                f"checkpoint step {commit.step} not committed; the last complete one is kept",
            )
        if ok != 1:
            raise RuntimeError(
                f"checkpoint step {commit.step}: rank 0 could not commit {tmp}"
                f"{': ' + message if message else ''}"
            )

    # ----------------------------------------------------------------- load
    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (commit order) on this rank's view of the disk (not
        collective)."""
        complete = complete_checkpoints(self.run_dir)
        return complete[-1][0] if complete else None

    def load(
        self, state: dict[str, Any], remap: dict[str, Callable[..., Any]] | None = None
    ) -> int | None:
        """Restore the newest complete checkpoint into ``state``; its step, or None on a fresh
        start.

        Collective. Loads at any layout: modules and optimizers reshard; per-rank entries
        load by their scope (``remap``: entry -> ``fn(saved_per_replica, dp_rank, dp_size)``
        for ``dp`` entries on a dp-size change); an entry the layout cannot serve raises
        :class:`CheckpointRefused` on every rank. A newest checkpoint that cannot be read
        makes it fall back to the previous complete one (logged); :attr:`last_load` tells
        what happened.
        """
        plan = classify(state)
        remap_fns = _check_remap(remap, plan)
        self.wait()
        failures: list[tuple[int, str]] = []
        step = self._pick(failures)
        while step is not None:
            report = self._try_load(plan, state, step, remap_fns)
            if isinstance(report, LoadReport):
                report.fell_back = failures
                self._loaded(report)
                return step
            failures.append((step, report))
            _log().warning(
                f"checkpoint step {step} is unreadable ({report}); trying the previous complete "
                "checkpoint"
            )
            step = self._pick(failures)
        if failures:
            raise RuntimeError(
                "no complete checkpoint could be read: "
                + "; ".join(f"step {s}: {why}" for s, why in failures)
            )
        self.last_load = None
        self._record(None, None)
        return None

    def _pick(self, failures: list[tuple[int, str]]) -> int | None:
        """Rank 0 picks the newest complete checkpoint not yet tried (first: after recovering); all
        get its step."""
        chosen = -1
        if self._rank() == 0:
            if not failures:
                try:
                    self._disk.recover()
                except OSError as e:
                    _log().warning(
                        f"checkpoint: could not tidy {self.root} ({_first_line(e)}); loading anyway"
                    )
            tried = {s for s, _ in failures}
            left = [s for s, _ in complete_checkpoints(self.run_dir) if s not in tried]
            chosen = left[-1] if left else -1
        step = self._from_rank0(chosen)
        return None if step < 0 else step

    def _agree(self, directory: Path, unreadable: str, refusal: str) -> str:
        """Every rank learns whether any rank refused (raise everywhere) or could not read (the
        reason)."""
        bad, refused = self._max(int(bool(unreadable)), int(bool(refusal)))
        if refused:
            raise CheckpointRefused(
                refusal
                or f"cannot load checkpoint {directory}: another rank refused it (its log says why)"
            )
        return (unreadable or "another rank could not read its part") if bad else ""

    def _try_load(
        self, plan: Plan, state: dict[str, Any], step: int, remap: dict[str, Callable[..., Any]]
    ) -> LoadReport | str:
        """Load checkpoint ``step``: a report, or why it is unreadable (every rank agrees on
        which)."""
        directory = self.root / step_name(step)
        layout, rank = self.layout(), self._rank()
        unreadable, refusal = "", ""
        commit = res = payloads = metadata = None
        try:
            commit = read_commit(directory)
            res = resolve(directory, commit, plan, layout, rank, remap)
            payloads = read_payloads(directory, commit, res.ranks_to_read())
            check_present(directory, res, payloads)
            metadata = read_metadata(directory) if plan.modules or plan.optimizers else None
        except CheckpointRefused as e:
            refusal = str(e)
        except CheckpointUnreadable as e:
            unreadable = str(e)
        if why := self._agree(directory, unreadable, refusal):
            return why
        try:
            load_sharded(
                plan,
                directory,
                metadata,
                self.process_group,
                self._dist(),
                legacy=commit.format < 2,
            )
        except CheckpointRefused as e:
            refusal = str(e)
        except (
            CheckpointUnreadable
        ) as e:  # torn shards, a failed read on any rank: DCP tells every rank
            unreadable = str(e)
        if why := self._agree(directory, unreadable, refusal):
            return why
        return self._restore(plan, state, step, directory, commit, res, payloads, remap)

    def _restore(
        self,
        plan: Plan,
        state: dict[str, Any],
        step: int,
        directory: Path,
        commit: Commit,
        res: Any,
        payloads: dict[int, dict[str, Any]],
        remap: dict[str, Callable[..., Any]],
    ) -> LoadReport:
        layout, rank = self.layout(), self._rank()
        problem: BaseException | None = None
        rng = "restored"
        try:
            restore(plan, state, res, payloads, remap, layout, rank)
            if res.rng_from is not None:
                set_rng_states(payloads[res.rng_from]["rng"])
            else:
                derive_rng(self.seed, step, rank)
                rng = f"re-derived from seed {self.seed}, step {step} and rank {rank}"
        except Exception as e:  # a task's load_state_dict or remap failed: every rank raises
            problem = e
        if self._max(int(problem is not None)):
            if problem is not None:
                raise problem
            raise RuntimeError(
                f"cannot load checkpoint {directory}: another rank failed to restore its state"
            )
        return LoadReport(
            step,
            directory,
            commit.layout,
            res.current,
            res.changed,
            list(res.rederived),
            sorted(res.remapped),
            rng,
        )

    def _loaded(self, report: LoadReport) -> None:
        self.last_load = report
        log = _log()
        if report.fell_back:
            newer = ", ".join(f"step {s}" for s, _ in report.fell_back)
            log.warning(
                f"checkpoint: loaded step {report.step}, the newest readable one ({newer} "
                "unreadable: "
                f"{report.fell_back[0][1]})"
            )
        if report.changed:
            log.info(
                f"checkpoint step {report.step} was saved at "
                f"{describe_layout(report.layout_from)} and loads at "
                f"{describe_layout(report.layout_to)}: modules and optimizers resharded; RNG "
                f"states {report.rng}"
                + (
                    f"; re-derived by the task (dp size changed): {report.rederived}"
                    if report.rederived
                    else ""
                )
                + (f"; remapped: {report.remapped}" if report.remapped else "")
            )
        self._record(report.step, report)

    def _record(self, step: int | None, report: LoadReport | None) -> None:
        if not (self.record_attempt and self._rank() == 0):
            return

        change = (
            {"layout_from": report.layout_from, "layout_to": report.layout_to}
            if report is not None and report.changed
            else {}
        )
        update(self.run_dir, launch_attempt(), resumed_from=step, **change)

    def close(self) -> None:
        """Commit the pending async save (collective) and drop the checkpoint group."""
        self.wait()
        self._disk.join()
        if self._async_group is not None:
            try:
                dist.destroy_process_group(self._async_group)
            except (RuntimeError, ValueError):
                pass
            self._async_group = None
