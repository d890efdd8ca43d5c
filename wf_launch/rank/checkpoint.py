"""Collective, atomic checkpoints of a task's state (``ctx.checkpoint``), on torch DCP.

:class:`Checkpointer` saves and restores a dict of named things: ``nn.Module``s
(plain or FSDP2 / DTensor-sharded, EMA copies included), optimizers (through
``torch.distributed.checkpoint.state_dict``, so an FSDP2 model's optimizer works),
``torch.Generator``s, objects with ``state_dict`` / ``load_state_dict`` (e.g. LR
schedulers) and small plain values (ints, floats, strings, lists, dicts, CPU tensors),
plus every rank's RNG states (torch CPU, CUDA when initialized, Python ``random``,
NumPy when imported), which are always saved.

Layout, under ``RUN_DIR/checkpoints/``::

    step_00000010/            a complete checkpoint (it has a COMMIT file)
        .metadata  __0_0.distcp ...   DCP: modules and optimizers, sharded as they live
        rank_00000.pt ...             per rank: RNG states, plain values, generators, stateful objects
        COMMIT                        written last; JSON {"step", "world_size", "time"}
    .step_00000020.tmp-<hex>/ a save in progress (or one a crash left behind)

Commit: every rank writes into the same hidden temporary directory; once every rank's
writes are done (DCP's final collective plus a flag all-reduce that doubles as a
barrier), rank 0 renames the directory to ``step_XXXXXXXX`` and writes ``COMMIT`` last,
then deletes all but the newest ``keep`` complete checkpoints and any leftover
incomplete ones. A directory without ``COMMIT`` is never loaded. A synchronous
:meth:`Checkpointer.save` returns once the checkpoint is committed on rank 0 (every
rank waits for rank 0's answer, and fails if rank 0 failed to commit).

With ``async_save=True`` :meth:`Checkpointer.save` copies the tensors to CPU memory
(DCP's staging) and writes the per-rank file before it returns; DCP writes the files in
a background thread on a separate gloo group, created once, so its collectives never
interleave with the training step's. The checkpoint is committed (same steps as above)
by the next :meth:`save`, :meth:`wait`, :meth:`load` or :meth:`close`, which first
waits for the background write. A job that dies before that leaves only an
uncommitted temporary directory, so the previous complete checkpoint stays the one
that loads.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from worldfoundry.core.torch_private import copy_state_dict, create_cpu_state_dict
from worldfoundry.core.validation import is_int

from ..rundir import files

__all__ = ["COMMIT_FILE", "Checkpointer", "complete_checkpoints"]

COMMIT_FILE = "COMMIT"
_PREFIX = "step_"
_PLAIN_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _step_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _parse_step(name: str) -> int | None:
    if not name.startswith(_PREFIX):
        return None
    digits = name[len(_PREFIX):]
    return int(digits) if digits.isdigit() else None


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of the complete (committed) checkpoints under ``run_dir``, oldest first."""
    root = Path(run_dir) / files.CHECKPOINTS
    found = []
    if root.is_dir():
        for p in root.iterdir():
            step = _parse_step(p.name)
            if step is not None and p.is_dir() and (p / COMMIT_FILE).is_file():
                found.append((step, p))
    return sorted(found)


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    if depth > 32:
        raise ValueError(f"{where} is nested too deeply to be plain task state")
    if isinstance(value, _PLAIN_SCALARS):
        return
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, nn.Parameter):
            raise ValueError(f"{where} is of type {type(value).__name__}; only plain tensors are saved as "
                             "per-rank state (put sharded tensors in a module)")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, _PLAIN_SCALARS):
                raise ValueError(f"{where} has a key of type {type(k).__name__}; keys must be plain")
            _check_plain(v, f"{where}[{k!r}]", depth + 1)
        return
    raise ValueError(
        f"{where} is of type {type(value).__name__}, which Checkpointer cannot save: entries must be "
        "nn.Module, torch.optim.Optimizer, torch.Generator, an object with state_dict()/load_state_dict(), "
        "or plain values (None, bool, int, float, str, bytes, CPU tensors, and lists/tuples/dicts of them)"
    )


@dataclass
class _Plan:
    modules: dict[str, nn.Module]
    optimizers: dict[str, tuple[torch.optim.Optimizer, nn.Module]]
    generators: dict[str, torch.Generator]
    stateful: dict[str, Any]
    plain: dict[str, Any]


def _classify(state: Any) -> _Plan:
    if not isinstance(state, dict):
        raise ValueError(f"state must be a dict of name -> object to checkpoint, got {type(state).__name__}")
    plan = _Plan({}, {}, {}, {}, {})
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name, value in state.items():
        if not isinstance(name, str) or not name or name.startswith("_"):
            raise ValueError(f"state key {name!r} must be a non-empty str not starting with '_'")
        if isinstance(value, nn.Module):
            plan.modules[name] = value
        elif isinstance(value, torch.optim.Optimizer):
            optimizers[name] = value
        elif isinstance(value, torch.Generator):
            plan.generators[name] = value
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            plan.stateful[name] = value
        else:
            _check_plain(value, f"state[{name!r}]")
            plan.plain[name] = value
    for name, opt in optimizers.items():
        ids = {id(p) for g in opt.param_groups for p in g["params"]}
        owner = next((m for m in plan.modules.values() if ids <= {id(p) for p in m.parameters()}), None)
        if owner is None:
            raise ValueError(f"state[{name!r}] is an optimizer whose parameters belong to no nn.Module in state; "
                             "add the model it optimizes to the same state dict")
        plan.optimizers[name] = (opt, owner)
    return plan


def _delete_all(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


class _CachedStager:
    """DCP async stager that copies the state dict into CPU buffers allocated once and reused.

    Reuse is safe because a save waits for the previous one before staging again.
    Pinned when CUDA is available (faster device-to-host copies).
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._signature: Any = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = _signature(state_dict)
        if self._cache is None or signature != self._signature:
            self._cache = create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._signature = signature
        return copy_state_dict(state_dict, self._cache)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _signature(obj: Any) -> Any:
    """Structure, shapes and dtypes of a nested state dict (when it changes, new buffers are made)."""
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return ("T", tuple(local.shape), local.dtype)
    return type(obj).__name__


def _rng_states() -> dict[str, Any]:
    rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        rng["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return rng


def _set_rng_states(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


class Checkpointer:
    """Collective, atomically committed DCP checkpoints under ``RUN_DIR/checkpoints`` (see the module doc).

    ``keep``: how many complete checkpoints to keep (the newest). ``async_save``: write in
    the background; the next ``save`` / ``wait`` / ``load`` / ``close`` commits.
    ``process_group``: the group of ranks that save together (None: the default group).
    Every method except :meth:`latest_step` is collective over that group.
    ``record_attempt``: rank 0 records the step :meth:`load` resumed from in this launch
    attempt's record (``logs/attempt{N}.json``, :mod:`wf_launch.attempts`); ``ctx.checkpoint`` sets it.
    """

    def __init__(self, run_dir: str | os.PathLike, keep: int = 3, async_save: bool = False,
                 process_group: Any = None, record_attempt: bool = False) -> None:
        if not is_int(keep) or keep < 1:
            raise ValueError(f"keep={keep!r} must be an int >= 1 (how many complete checkpoints to keep)")
        if not isinstance(async_save, bool):
            raise ValueError(f"async_save={async_save!r} must be a bool")
        if run_dir is None or not str(run_dir):
            raise ValueError(f"run_dir={run_dir!r} must be a directory path")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / files.CHECKPOINTS
        self.keep = keep
        self.async_save = async_save
        self.process_group = process_group
        self.record_attempt = record_attempt
        self._async_group: Any = None
        self._pending: tuple[Any, int, Path] | None = None  # (future, step, temp dir)
        self._stager: Any = None  # async: CPU staging buffers, reused by every save
        self._deleter: Any = None  # rank 0: the thread deleting pruned checkpoints

    # ----------------------------------------------------------------- group helpers
    def _dist(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if self._dist() else 0

    def _world(self) -> int:
        return dist.get_world_size(self.process_group) if self._dist() else 1

    def _control_device(self) -> torch.device:
        from worldfoundry.core.distributed.backends import group_device

        return group_device(self.process_group, control=True)

    def _max(self, *values: int) -> Any:
        """All-reduce MAX of ints over the group: the agreement primitive (and a barrier).

        One value: returns an int; several: a tuple of ints.
        """
        if self._dist():
            t = torch.tensor(values, dtype=torch.int64, device=self._control_device())
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
            values = tuple(int(v) for v in t.tolist())
        return values[0] if len(values) == 1 else tuple(values)

    def _from_rank0(self, value: int) -> int:
        if not self._dist():
            return value
        t = torch.tensor([value if self._rank() == 0 else 0], dtype=torch.int64, device=self._control_device())
        dist.broadcast(t, group_src=0, group=self.process_group)
        return int(t.item())

    def _dcp_group(self) -> Any:
        """The group DCP's own collectives run on: a dedicated gloo group when saving asynchronously."""
        if not (self.async_save and self._dist()):
            return self.process_group
        if self._async_group is None:
            ranks = dist.get_process_group_ranks(self.process_group or dist.group.WORLD)
            self._async_group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        return self._async_group

    # ----------------------------------------------------------------- save
    def save(self, step: int, state: dict[str, Any]) -> None:
        """Checkpoint ``state`` as ``step`` (collective: every rank, the same step)."""
        if not is_int(step) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        plan = _classify(state)
        self.wait()  # commit the previous async save first
        high, neg_low = self._max(step, -step)  # one collective: every rank must take the same path
        if high != step or -neg_low != step:
            raise ValueError(f"step={step}: every rank must save the same step")

        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        token = self._from_rank0(uuid.uuid4().int >> 65)  # the same temp dir name on every rank
        tmp = self.root / f".{_step_name(step)}.tmp-{token:016x}"
        problem = ""
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            self._write_rank_file(tmp, plan)
        except Exception as e:  # agree before DCP's collectives, or the other ranks would hang in them
            problem = f"{type(e).__name__}: {e}"
        if self._max(int(bool(problem))):
            raise RuntimeError(f"checkpoint step {step}: a rank could not write its per-rank state "
                               f"({problem or 'another rank failed'}); nothing was saved")
        sd: dict[str, Any] = {name: get_model_state_dict(m) for name, m in plan.modules.items()}
        for name, (opt, model) in plan.optimizers.items():
            sd[name] = get_optimizer_state_dict(model, opt)
        writer = FileSystemWriter(str(tmp), sync_files=True)
        group = self._dcp_group()
        if self.async_save and self._dist():
            import torch.distributed.checkpoint as dcp

            if self._stager is None:
                self._stager = _CachedStager()
            future = dcp.async_save(sd, storage_writer=writer, process_group=group, async_stager=self._stager)
            self._pending = (future, step, tmp)
            return
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=writer, process_group=group, no_dist=not self._dist())
        self._commit(step, tmp)

    def _write_rank_file(self, directory: Path, plan: _Plan) -> None:
        payload = {
            "rank": self._rank(), "world_size": self._world(), "rng": _rng_states(),
            "generators": {n: g.get_state() for n, g in plan.generators.items()},
            "stateful": {n: o.state_dict() for n, o in plan.stateful.items()},
            "plain": plan.plain,
        }
        path = directory / f"rank_{self._rank():05d}.pt"
        part = path.with_name(path.name + ".part")
        torch.save(payload, part)
        os.replace(part, path)

    def wait(self) -> None:
        """Wait for the pending async save, then commit it (collective; a no-op when none is pending)."""
        if self._pending is None:
            return
        future, step, tmp = self._pending
        self._pending = None
        error = None
        try:
            result = future.result()
            if hasattr(result, "upload_completion"):  # an AsyncSaveResponse
                result.upload_completion.result()
        except Exception as e:  # agree with the other ranks before raising
            error = e
        self._commit(step, tmp, failed=error is not None)
        if error is not None:
            raise error

    def _commit(self, step: int, tmp: Path, failed: bool = False) -> None:
        """Barrier, then rank 0 renames ``tmp`` into place and writes COMMIT; every rank learns the outcome."""
        if self._max(int(failed)):  # every rank has finished writing, or some rank failed
            if self._rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._max(0)
            raise RuntimeError(f"checkpoint step {step}: a rank failed to write it; nothing was committed")
        ok, message = 1, ""
        if self._rank() == 0:
            try:
                self._rename_and_mark(step, tmp)
                self._prune()
            except OSError as e:
                ok, message = 0, f"{type(e).__name__}: {e}"
        if self._from_rank0(ok) != 1:
            raise RuntimeError(f"checkpoint step {step}: rank 0 could not commit {tmp}{': ' + message if message else ''}")

    def _rename_and_mark(self, step: int, tmp: Path) -> None:
        final = self.root / _step_name(step)
        old = None
        if final.exists():  # saving a step again (e.g. right after resuming from it)
            old = self.root / f".{final.name}.old-{uuid.uuid4().hex[:16]}"
            os.replace(final, old)
        os.replace(tmp, final)
        marker = final / (COMMIT_FILE + ".part")
        marker.write_text(json.dumps({"step": step, "world_size": self._world(), "time": time.time()}) + "\n")
        with open(marker, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(marker, final / COMMIT_FILE)
        try:
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _prune(self) -> None:
        """Rank 0: keep the newest ``keep`` complete checkpoints; delete incomplete leftovers.

        Pruned checkpoints are first renamed to hidden ``.step_XXXXXXXX.del-<hex>`` names
        (atomic, so they can never load again), then deleted by a background thread; a
        crash mid-delete leaves a hidden name that the next clean-up removes.
        """
        complete = complete_checkpoints(self.run_dir)
        doomed = []
        for _, path in complete[: max(0, len(complete) - self.keep)]:
            hidden = path.with_name(f".{path.name}.del-{uuid.uuid4().hex[:16]}")
            os.replace(path, hidden)
            doomed.append(hidden)
        doomed += self._incomplete()
        if doomed:
            self._join_deleter()
            self._deleter = threading.Thread(target=_delete_all, args=(doomed,), name="wf-ckpt-prune", daemon=True)
            self._deleter.start()

    def _join_deleter(self) -> None:
        if self._deleter is not None:
            self._deleter.join()
            self._deleter = None

    def _incomplete(self) -> list[Path]:
        """Uncommitted step dirs and hidden leftovers (temp, replaced, pruned) under the root."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            step = _parse_step(p.name)
            if (step is not None and p.is_dir() and not (p / COMMIT_FILE).is_file()) or (
                    p.name.startswith(f".{_PREFIX}") and any(t in p.name for t in (".tmp-", ".old-", ".del-"))):
                found.append(p)
        return found

    def _clean_incomplete(self) -> None:
        self._join_deleter()
        _delete_all(self._incomplete())

    # ----------------------------------------------------------------- load
    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step on this rank's view of the disk (not collective)."""
        complete = complete_checkpoints(self.run_dir)
        return complete[-1][0] if complete else None

    def load(self, state: dict[str, Any]) -> int | None:
        """Restore the newest complete checkpoint into ``state`` in place; its step, or None on a fresh start.

        Collective: rank 0 picks the checkpoint and broadcasts its step. Modules and
        optimizers are loaded in place; generators and stateful objects get their state
        back; plain entries are replaced (a dict or list is updated in place); RNG
        states are restored last, each rank's own.
        """
        plan = _classify(state)
        self.wait()
        step = self._pick()
        if step is None:
            return None
        directory = self.root / _step_name(step)
        payload = self._read_rank_file(directory)
        self._load_sharded(plan, directory)
        self._restore_rank_state(plan, state, payload, directory)
        self._max(0)  # nobody leaves load before every rank has read the checkpoint
        return step

    def _pick(self) -> int | None:
        """Rank 0 picks the newest complete checkpoint (and clears incomplete ones); every rank gets its step."""
        chosen = -1
        if self._rank() == 0:
            latest = self.latest_step()
            chosen = -1 if latest is None else latest
            self._clean_incomplete()
        step = self._from_rank0(chosen)
        if self.record_attempt and self._rank() == 0:
            from worldfoundry.core.distributed.env import launch_attempt

            from ..rundir.attempts import update

            update(self.run_dir, launch_attempt(), resumed_from=None if step < 0 else step)
        return None if step < 0 else step

    def _read_rank_file(self, directory: Path) -> dict[str, Any]:
        """This rank's file of the checkpoint; every rank raises when any rank cannot read its own."""
        rank_file = directory / f"rank_{self._rank():05d}.pt"
        problem, payload = "", {}
        try:  # tensors and plain values only (numpy's RNG state is stored as a tensor): weights_only holds
            payload = torch.load(rank_file, map_location="cpu", weights_only=True)
            if payload.get("world_size") != self._world():
                problem = f"it was saved by {payload.get('world_size')} ranks; {self._world()} are loading it"
        except FileNotFoundError:
            problem = (f"it has no {rank_file.name}: it was saved by a different number of ranks than the "
                       f"{self._world()} loading it")
        except Exception as e:
            problem = f"{rank_file.name} is unreadable: {type(e).__name__}: {e}"
        if self._max(int(bool(problem))):  # every rank raises, none is left waiting in DCP's collectives
            raise RuntimeError(f"cannot load checkpoint {directory}: {problem or 'another rank could not read it'}")
        return payload

    def _load_sharded(self, plan: _Plan, directory: Path) -> None:
        """Modules and optimizers through DCP, each rank reading the shards it owns, loaded in place."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        sd: dict[str, Any] = {name: get_model_state_dict(m) for name, m in plan.modules.items()}
        for name, (opt, model) in plan.optimizers.items():
            sd[name] = get_optimizer_state_dict(model, opt)
        if sd:
            dcp.load(sd, storage_reader=FileSystemReader(str(directory)), process_group=self.process_group,
                     no_dist=not self._dist())
        for name, m in plan.modules.items():
            set_model_state_dict(m, sd[name])
        for name, (opt, model) in plan.optimizers.items():
            set_optimizer_state_dict(model, opt, sd[name])

    @staticmethod
    def _restore_rank_state(plan: _Plan, state: dict[str, Any], payload: dict[str, Any], directory: Path) -> None:
        """Generators, stateful objects and plain values from this rank's file; its RNG states last."""
        missing = [n for n in (*plan.generators, *plan.stateful, *plan.plain)
                   if n not in payload["generators"] and n not in payload["stateful"] and n not in payload["plain"]]
        if missing:
            raise RuntimeError(f"checkpoint {directory} has no saved state for {missing}")
        for name, gen in plan.generators.items():
            gen.set_state(payload["generators"][name])
        for name, obj in plan.stateful.items():
            obj.load_state_dict(payload["stateful"][name])
        for name, old in plan.plain.items():
            new = payload["plain"][name]
            if isinstance(old, dict) and isinstance(new, dict):
                old.clear()
                old.update(new)
            elif isinstance(old, list) and isinstance(new, list):
                old[:] = new
            else:
                state[name] = new
        _set_rng_states(payload["rng"])

    def close(self) -> None:
        """Commit the pending async save (collective) and drop the checkpoint group."""
        self.wait()
        self._join_deleter()
        if self._async_group is not None:
            try:
                dist.destroy_process_group(self._async_group)
            except (RuntimeError, ValueError):
                pass
            self._async_group = None
