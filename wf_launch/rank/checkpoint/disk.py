"""Rank 0's operations on ``RUN_DIR/checkpoints``: commit, recover after a crash, prune by commit
order.

The commit of a save whose files every rank has written (``.step_N.tmp-<hex>/``):

1. ``COMMIT`` is written into the temporary directory (``.part``, fsync, rename, fsync):
   from here on it is a complete checkpoint, under a hidden name;
2. a ``step_N`` already there (the step saved a second time) is renamed aside to
   ``.step_N.old-<hex>``: still complete, still found;
3. the temporary directory is renamed to ``step_N`` and the root is fsynced;
4. the replaced copy is hidden as ``.del-`` and deleted; then pruning.

A crash between any two of these leaves a complete copy of ``step_N`` (or the previous
complete checkpoint) that :func:`~.format.complete_checkpoints` finds; :meth:`Disk.recover`,
at the next load, renames the newest complete copy of every step back to ``step_N`` and
deletes the rest. Pruning keeps the ``keep`` newest **commits** (``COMMIT``'s ``seq``),
whatever their step numbers.
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path

from ...rundir.checkpoints import (
    COMMIT_FILE,
    Commit,
    candidates,
    fsync_path,
    hidden_step,
    parse_step,
    step_name,
    write_commit,
)

__all__ = ["Disk"]


def _hidden(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:16]}")


def _delete_all(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


class Disk:
    """The checkpoint root as rank 0 changes it (never collective)."""

    def __init__(self, root: Path, keep: int, warn: object = None) -> None:
        self.root = root
        self.keep = keep
        self.warn = warn  # a callable taking a message: where a backwards step is reported
        self._deleter: threading.Thread | None = None

    def _newest(self) -> tuple[int, int]:
        """``(next seq, newest readable step or -1)`` over every complete copy under the root."""
        seq, newest, newest_order = 0, -1, None
        for copies in candidates(self.root).values():
            for c in copies:
                if c.readable:
                    seq = max(seq, int(c.seq))
                    if newest_order is None or c.order > newest_order:
                        newest, newest_order = c.step, c.order
        return seq + 1, newest

    def commit(self, tmp: Path, commit: Commit) -> None:
        """Make ``tmp`` the complete checkpoint ``step_N`` (steps 1-4 of the module doc), then
        prune."""
        commit.seq, newest = self._newest()
        fsync_path(tmp)
        write_commit(tmp, commit)
        final = self.root / step_name(commit.step)
        old = None
        if final.exists():
            old = _hidden(final, "old")
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(self.root)
        if 0 <= commit.step < newest and callable(self.warn):
            self.warn(
                f"checkpoint step {commit.step} was committed after step {newest}: the steps went "
                "backwards; "
                f"commit order decides, so step {commit.step} is now the newest checkpoint (it "
                "loads next, "
                f"and keep={self.keep} keeps the newest commits, not the highest steps)"
            )
        self.prune(extra=[old] if old is not None else [])

    def prune(self, extra: list[Path] | None = None) -> None:
        """Keep the ``keep`` newest commits; hide (``.del-``) and delete in the background
        everything else."""
        found = candidates(self.root)
        best = sorted((copies[0] for copies in found.values()), key=lambda c: c.order)
        readable = [c for c in best if c.readable]
        doomed_keep = {c.path for c in readable[: max(0, len(readable) - self.keep)]}
        if (
            len(readable) >= self.keep
        ):  # COMMIT unreadable: never loadable, gone once enough good ones exist
            doomed_keep |= {c.path for c in best if not c.readable}
        kept = {c.path for c in best} - doomed_keep
        doomed = [*doomed_keep, *(p for p in self._leftovers() if p not in kept), *(extra or [])]
        self._delete(doomed)

    def _leftovers(self) -> list[Path]:
        """Step directories without COMMIT and every hidden copy (temporary, replaced, being
        deleted)."""
        try:
            entries = list(self.root.iterdir())
        except OSError:
            return []
        found = []
        for p in entries:
            incomplete = (
                parse_step(p.name) is not None and p.is_dir() and not (p / COMMIT_FILE).is_file()
            )
            if incomplete or hidden_step(p.name) is not None:
                found.append(p)
        return found

    def _delete(self, paths: list[Path]) -> None:
        hidden = []
        for p in dict.fromkeys(paths):
            marked = hidden_step(p.name)
            if marked is not None and marked[1] == "del":
                hidden.append(p)
                continue
            step = marked[0] if marked is not None else parse_step(p.name)
            if step is None or not p.exists():
                continue
            target = _hidden(p.with_name(step_name(step)), "del")
            try:
                os.replace(p, target)  # atomic: a pruned checkpoint can never load again
                hidden.append(target)
            except OSError:
                continue
        if hidden:
            self.join()
            self._deleter = threading.Thread(
                target=_delete_all, args=(hidden,), name="wf-ckpt-prune", daemon=True
            )
            self._deleter.start()

    def recover(self) -> None:
        """After a crash: the newest complete copy of every step becomes ``step_N`` again; the rest
        is deleted."""
        self.join()
        for step, copies in candidates(self.root).items():
            best = copies[0]
            if not best.path.name.startswith("."):
                continue
            final = self.root / step_name(step)
            if final.exists():
                os.replace(final, _hidden(final, "del"))
            os.replace(best.path, final)
        if self.root.is_dir():
            fsync_path(self.root)
        kept = {copies[0].path for copies in candidates(self.root).values()}
        self._delete([p for p in self._leftovers() if p not in kept])
        self.join()

    def join(self) -> None:
        """Wait for the background deletion (if any)."""
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None
