"""``python -m wf_launch.checkpoint``: list a run's checkpoints, export one's weights as a plain
state dict.

``list RUN_DIR [--json]``: every checkpoint directory (complete or not), oldest commit
first: step, state, commit order, the layout that saved it, size, time.

``export RUN_DIR --out model.pt [--step N] [--ema | --entry NAME]``: one module entry
of a (sharded) checkpoint, consolidated into full tensors under their global names and
written with ``torch.save`` (a plain ``{name: tensor}`` dict), without a process group:
for evaluation or inference elsewhere. The checkpoint is read as data (the restricted
metadata reader of :mod:`wf_launch.rank.checkpoint.safe_read`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ..observe.console import print_or_quiet
from ..rank.checkpoint.safe_read import (
    CheckpointRefused,
    SafeLoadPlanner,
    SafeReader,
    read_metadata,
)
from ..rundir import files
from ..rundir.checkpoints import (
    COMMIT_FILE,
    CheckpointUnreadable,
    complete_checkpoints,
    describe_layout,
    hidden_step,
    parse_step,
    read_commit,
)
from ..rundir.io import OutputRefused, check_output_path, write_output_file

__all__ = ["ExportError", "consolidate", "list_checkpoints", "main", "module_entries"]


class ExportError(Exception):
    """The export cannot be done as asked (no such run, step or entry; an unreadable checkpoint)."""


def _size(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(dirpath, n))
            except OSError:
                pass
    return total


def _row(path: Path, complete: set[Path]) -> dict[str, Any] | None:
    step = parse_step(path.name)
    hidden = hidden_step(path.name)
    if step is None and hidden is None:
        return None
    row: dict[str, Any] = {
        "step": step if step is not None else hidden[0],
        "path": str(path),
        "size": _size(path),
        "complete": path in complete,
        "seq": None,
        "time": None,
        "layout": None,
        "world_size": None,
    }
    if (path / COMMIT_FILE).is_file():
        try:
            commit = read_commit(path)
            row.update(
                seq=commit.seq, time=commit.time, layout=commit.layout, world_size=commit.world_size
            )
        except CheckpointUnreadable as exc:
            row["problem"] = str(exc)
    if path in complete:
        row["state"] = (
            "complete"
            if step is not None
            else "complete (hidden: a save of this step was interrupted)"
        )
    elif hidden is not None and hidden[1] == "del":
        row["state"] = "being deleted"
    else:
        row["state"] = "incomplete (a save in progress, or one a crash left; never loaded)"
    return row


def list_checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    """Every checkpoint directory of ``run_dir``: complete ones in commit order, then the others."""
    root = Path(run_dir) / files.CHECKPOINTS
    order = [p for _, p in complete_checkpoints(run_dir)]
    rows = [
        r for p in (sorted(root.iterdir()) if root.is_dir() else []) if (r := _row(p, set(order)))
    ]
    rank = {p: i for i, p in enumerate(order)}
    return sorted(rows, key=lambda r: (rank.get(Path(r["path"]), len(rank)), r["step"]))


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def render_list(rows: list[dict[str, Any]], run_dir: Path) -> str:
    if not rows:
        return f"no checkpoints in {Path(run_dir) / files.CHECKPOINTS}"
    lines = [f"{'step':>8}  {'commit':>6}  {'saved at':<19}  {'size':>9}  {'layout':<46}  state"]
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"])) if r["time"] else "-"
        layout = describe_layout(r["layout"], r["world_size"]) if r["world_size"] else "-"
        lines.append(
            f"{r['step']:>8}  {r['seq'] if r['seq'] is not None else '-':>6}  {when:<19}  "
            f"{_human(r['size']):>9}  {layout:<46}  {r['state']}"
        )
    return "\n".join(lines)


def module_entries(directory: Path, metadata: Any) -> list[str]:
    """The module entries of a checkpoint (``COMMIT``'s kinds; a format-1 checkpoint: its tensor key
    prefixes)."""
    try:
        entries = read_commit(directory).entries
    except CheckpointUnreadable as exc:
        raise ExportError(str(exc)) from None
    if entries:
        return sorted(
            n for n, e in entries.items() if isinstance(e, dict) and e.get("kind") == "module"
        )
    keys = metadata.state_dict_metadata
    return sorted(
        {k.split(".", 1)[0] for k in keys if ".state." not in k and ".param_groups." not in k}
    )


def consolidate(directory: Path, entry: str, metadata: Any = None) -> dict[str, Any]:
    """Module entry ``entry`` of the checkpoint in ``directory`` as full tensors (no process
    group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata(directory) if metadata is None else metadata
    prefix = f"{entry}."
    full = {
        key[len(prefix) :]: torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not full:
        raise ExportError(f"{directory}: no tensors under entry {entry!r}")
    with warnings.catch_warnings():  # DCP warns that no process group is up: none is needed here
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to load in a single process"
        )
        planner = SafeLoadPlanner(directory)
        try:
            dcp.load(
                {entry: full},
                storage_reader=SafeReader(directory, metadata),
                planner=planner,
                no_dist=True,
            )
        except (Exception, CheckpointException) as exc:  # DCP's wraps each read failure
            if planner.refused:
                raise CheckpointRefused(planner.refused) from None
            why = next((ln for ln in reversed(str(exc).splitlines()) if ln.strip()), "")
            raise CheckpointUnreadable(f"{directory}: {type(exc).__name__}: {why}") from None
    return full


def _readable(directory: Path) -> Any:
    """The checkpoint's metadata, its ``COMMIT`` checked first (:class:`CheckpointUnreadable`)."""

    read_commit(directory)
    return read_metadata(directory)


def _pick(run_dir: Path, step: int | None) -> tuple[Path, Any]:
    """The checkpoint to export and its metadata: ``--step``'s, or the newest that reads (each
    newer one that does not is named on stderr and skipped)."""
    complete = complete_checkpoints(run_dir)
    if not complete:
        raise ExportError(
            f"{run_dir}: no complete checkpoint in {Path(run_dir) / files.CHECKPOINTS}"
        )
    if step is not None:
        found = [p for s, p in complete if s == step]
        if not found:
            raise ExportError(
                f"--step {step}: no complete checkpoint of that step; complete steps: "
                f"{[s for s, _ in complete]}"
            )
        complete = [(step, found[0])]
    for number, directory in reversed(complete):
        try:
            return directory, _readable(directory)
        except CheckpointUnreadable as exc:
            if step is not None:
                raise ExportError(str(exc)) from None
            print(f"wf_launch.checkpoint: skipped step {number}: {exc}", file=sys.stderr)
    raise ExportError(f"{run_dir}: no complete checkpoint could be read (see above)")


def export(
    run_dir: Path,
    out: Path,
    step: int | None,
    entry: str | None,
    ema: bool,
    force: bool = False,
) -> dict[str, Any]:
    """Write one module entry of a checkpoint as a plain ``torch.save`` state dict; what was
    written.

    ``out`` must be free, or a regular file and ``force`` set (:class:`OutputRefused`): checked
    before the checkpoint is read, and again as the file is put in place.
    """
    import torch  # heavy: only an export needs it

    check_output_path(out, force)
    directory, metadata = _pick(run_dir, step)
    modules = module_entries(directory, metadata)
    name = (
        "ema"
        if ema
        else entry
        if entry is not None
        else ("model" if "model" in modules else modules[0] if len(modules) == 1 else None)
    )
    if name is None or name not in modules:
        what = (
            "--ema: no module entry 'ema'"
            if ema
            else f"--entry {name}: no such module entry"
            if name
            else "several module entries: choose one with --entry"
        )
        raise ExportError(f"{directory}: {what}; module entries: {modules}")
    state = consolidate(directory, name, metadata)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputRefused(
            f"--out {out}: cannot make its folder ({exc.strerror or exc})"
        ) from None
    write_output_file(out, lambda f: torch.save(state, f), force)
    commit = read_commit(directory)
    return {
        "step": commit.step,
        "entry": name,
        "tensors": len(state),
        "out": str(out),
        "numel": sum(t.numel() for t in state.values()),
        "bytes": out.stat().st_size,
        "layout": describe_layout(commit.layout, commit.world_size),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m wf_launch.checkpoint",
        description="List a run's checkpoints, or export one module of a checkpoint as a "
        "plain torch.save state dict (full tensors, no process group).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser(
        "list", help="every checkpoint: step, commit order, time, size, layout, complete or not"
    )
    ls.add_argument("run_dir", type=Path)
    ls.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    ex = sub.add_parser(
        "export", help="one module entry of a checkpoint -> a torch.save state dict"
    )
    ex.add_argument("run_dir", type=Path)
    ex.add_argument(
        "--out", type=Path, required=True, help="where to write the state dict (e.g. model.pt)"
    )
    ex.add_argument(
        "--step", type=int, default=None, help="the checkpoint's step (default: the newest commit)"
    )
    ex.add_argument(
        "--force", action="store_true", help="replace --out if it is an existing regular file"
    )
    which = ex.add_mutually_exclusive_group()
    which.add_argument(
        "--ema", action="store_true", help="the module entry 'ema' (the EMA weights)"
    )
    which.add_argument(
        "--entry", default=None, help="the module entry (default: 'model', or the only one)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    if not args.run_dir.is_dir():
        print(f"wf_launch.checkpoint: {args.run_dir}: not a directory", file=sys.stderr)
        return 2
    if args.command == "list":
        rows = list_checkpoints(args.run_dir)
        return print_or_quiet(
            json.dumps(rows, indent=1) if args.json else render_list(rows, args.run_dir)
        )
    try:
        done = export(args.run_dir, args.out, args.step, args.entry, args.ema, args.force)
    except (ExportError, CheckpointRefused, CheckpointUnreadable, OutputRefused) as exc:
        print(f"wf_launch.checkpoint: {exc}", file=sys.stderr)
        return 2
    return print_or_quiet(
        f"exported entry {done['entry']!r} of step {done['step']} (saved at {done['layout']}): "
        f"{done['tensors']} tensors, {done['numel']:,} values, {_human(done['bytes'])} -> "
        f"{done['out']}"
    )
