"""Runs continue with the code they were submitted with: a copy of the project's code per
submission.

Any launcher whose runs start later, or elsewhere, than the command (SLURM today) uses it.

A queued or requeued SLURM job imports whatever the checkout holds when it starts, so
editing code while a job waits would silently change the job. With
``launcher.snapshot=true`` (the default) the submission copies the project's files
into ``RUN_DIR/code`` (a sweep: once, into ``SWEEP_DIR/code``), and the job's batch
script starts in that copy with ``PYTHONPATH`` pointing into it: the copy first, then
every ``PYTHONPATH`` entry of the submitter, those inside the checkout mapped to the
same place in the copy.

What is copied, and how:

- the files git tracks (``git ls-files``, as they are in the working tree), those of
  checked-out submodules included; a submodule that is not checked out is named in the
  manifest (``submodules_missing``) and the log. Untracked files that git does not ignore
  only with ``untracked=True`` (``launcher.snapshot_untracked``), and never those inside
  a run directory or an earlier snapshot (snapshots never nest);
- never a secret: dot-env files (``.env``, ``.env.*``), keys and certificates
  (``*.pem``, ``*.key``, ``id_rsa``...), ``.netrc`` and the like are left out, tracked or
  not, and named in the manifest (``excluded``);
- contents only: each file is created owner-only (``0600``, ``0700`` when it was
  executable), never with its source's mode;
- a link that stays inside the checkout is resolved (a file's content is copied; a folder
  link becomes a relative link inside the copy); a link out of the checkout (absolute, or
  through ``..``) is refused with :class:`SnapshotError`, as is a copy larger than
  ``max_bytes`` (``launcher.snapshot_max_mb``), before anything is copied.

"The project" is the git checkout that holds the imported ``wf_launch``; when
``wf_launch`` is an installed package (no checkout), there is nothing to copy: the
submission says so and runs the installed code. submitit's ``RsyncSnapshot`` does a
similar copy, but it needs ``rsync``, clones the repository and changes the submitting
process's working directory; this module needs only ``git``.
"""

from __future__ import annotations

import fnmatch
import os
import shlex
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.io import atomic_write_json, read_json

__all__ = [
    "CODE_DIR",
    "MANIFEST",
    "SECRET_PATTERNS",
    "SnapshotError",
    "code_dir",
    "job_setup",
    "project_root",
    "take",
    "take_for",
]

CODE_DIR = files.CODE
MANIFEST = files.SNAPSHOT_MANIFEST
SECRET_PATTERNS = (
    ".env",
    ".env.*",
    "*.env",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.jks",
    "*.keystore",
    "id_rsa",
    "id_dsa",
    "id_ecdsa",
    "id_ed25519",
    "id_rsa.*",
    "id_dsa.*",
    "id_ecdsa.*",
    "id_ed25519.*",
    ".netrc",
    ".pgpass",
    ".git-credentials",
    ".pypirc",
    "*.kdbx",
)
"""File names a snapshot never copies (matched against the name, not the path)."""
_RUN_MARKERS = (files.LOCK, files.SNAPSHOT_MANIFEST)


class SnapshotError(ValueError):
    """The snapshot cannot be taken as asked (a link out of the checkout, over the size cap):
    nothing was copied."""


@lru_cache(maxsize=1)
def project_root() -> Path | None:
    """The git checkout that holds the imported ``wf_launch`` (None: an installed package)."""
    here = Path(__file__).resolve().parents[1]  # the imported wf_launch package
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    root = Path(out.stdout.strip()).resolve()
    return root if (root / "wf_launch" / "__init__.py").resolve() == here / "__init__.py" else None


def _git_paths(root: Path, *args: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", *args], cwd=root, capture_output=True, timeout=60, check=True
    )
    return sorted({f for f in out.stdout.decode(errors="surrogateescape").split("\0") if f})


def _missing_submodules(root: Path) -> list[str]:
    """Submodules (gitlinks) of the checkout that are not checked out: their files cannot be
    copied."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--stage"], cwd=root, capture_output=True, timeout=60, check=True
    )
    links = [
        line.split("\t", 1)[1]
        for line in out.stdout.decode(errors="surrogateescape").split("\0")
        if line.startswith("160000 ") and "\t" in line
    ]
    return sorted(p for p in links if not (root / p / ".git").exists())


def is_secret(rel: str) -> bool:
    """Whether the file at ``rel`` looks like a secret a snapshot never copies
    (:data:`SECRET_PATTERNS`)."""
    name = Path(rel).name
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in SECRET_PATTERNS)


def _inside_a_run(root: Path, rel: str) -> bool:
    """Whether ``rel`` lies in a run directory or an earlier snapshot under ``root`` (never
    copied)."""
    for parent in Path(rel).parents:
        if parent != Path(".") and any(
            (root / parent / marker).exists() for marker in _RUN_MARKERS
        ):
            return True
    return False


@dataclass
class _Plan:
    """What a snapshot copies: (path in the checkout, what it is), their size, what it leaves
    out."""

    entries: list[tuple[str, str]] = field(default_factory=list)
    size: int = 0
    excluded: list[str] = field(default_factory=list)
    left_untracked: list[str] = field(default_factory=list)
    missing_submodules: list[str] = field(default_factory=list)


def _link_target(root: Path, rel: str) -> Path | None:
    """Where the link at ``rel`` leads, inside ``root`` (None: a loop); :class:`SnapshotError` for a
    link out of the checkout."""
    src = root / rel
    try:
        target = src.resolve()
    except (RuntimeError, OSError):
        return None
    if target != root and root not in target.parents:
        raise SnapshotError(
            f"launcher.snapshot: {rel} is a link out of the checkout ({os.readlink(src)} -> "
            f"{target}); refusing to snapshot it. Make it point inside {root}, remove it, or set "
            "launcher.snapshot=false"
        )
    return target


def _plan(root: Path, untracked: bool) -> _Plan:
    plan = _Plan(missing_submodules=_missing_submodules(root))
    tracked = set(_git_paths(root, "--cached", "--recurse-submodules"))
    others = [
        p for p in _git_paths(root, "--others", "--exclude-standard") if not _inside_a_run(root, p)
    ]
    if untracked:
        tracked |= set(others)
    else:
        plan.left_untracked = others
    for rel in sorted(tracked):
        src = root / rel
        target = _link_target(root, rel) if src.is_symlink() else src
        if is_secret(rel) or (target is not None and is_secret(target.name)):
            plan.excluded.append(rel)
        elif target is not None and target.is_dir() and src.is_symlink():
            plan.entries.append((rel, "dirlink"))
        elif (
            target is not None and target.is_file()
        ):  # else deleted, a broken link, or a submodule folder
            plan.entries.append((rel, "file"))
            plan.size += target.stat().st_size
    return plan


def _check_size(plan: _Plan, root: Path, max_bytes: int | None) -> None:
    if max_bytes is None or plan.size <= max_bytes:
        return
    biggest = sorted(
        ((root / rel).resolve().stat().st_size, rel) for rel, kind in plan.entries if kind == "file"
    )
    top = ", ".join(f"{rel} ({size / 2**20:.1f} MB)" for size, rel in biggest[::-1][:3])
    raise SnapshotError(
        f"launcher.snapshot: the code snapshot of {root} would copy {plan.size / 2**20:.1f} MB in "
        f"{len(plan.entries)} files, more than launcher.snapshot_max_mb={max_bytes / 2**20:g}; the "
        f"largest: {top}. Untrack or ignore big files, raise launcher.snapshot_max_mb, or set "
        "launcher.snapshot=false"
    )


def _copy(root: Path, tmp: Path, plan: _Plan) -> None:
    """Copy the planned entries into ``tmp``: contents only, owner-only modes; folder links as
    relative links."""
    for rel, kind in plan.entries:
        target = tmp / rel
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        src = root / rel
        if kind == "dirlink":
            resolved = src.resolve().relative_to(root)
            os.symlink(os.path.relpath(tmp / resolved, target.parent), target)
            continue
        shutil.copyfile(src.resolve(), target)
        executable = os.stat(src).st_mode & stat.S_IXUSR
        os.chmod(target, 0o700 if executable else 0o600)


def take(
    dest: Path, root: Path, untracked: bool = False, max_bytes: int | None = None
) -> dict[str, object]:
    """Copy the project's files at ``root`` into ``dest`` (created owner-only; an existing copy is
    kept); its manifest. :class:`SnapshotError` when it cannot be taken as asked (nothing is copied
    then)."""
    manifest = read_json(dest / MANIFEST) if (dest / MANIFEST).exists() else None
    if manifest:
        return manifest
    t0 = time.monotonic()
    plan = _plan(root, untracked)
    _check_size(plan, root, max_bytes)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(mode=0o700)
    os.chmod(tmp, 0o700)
    _copy(root, tmp, plan)
    commit = (
        subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        or None
    )
    manifest = {
        "source": str(root),
        "commit": commit,
        "files": len(plan.entries),
        "bytes": plan.size,
        "untracked": untracked,
        "excluded": plan.excluded,
        "untracked_left_out": len(plan.left_untracked),
        "submodules_missing": plan.missing_submodules,
        "taken_at": time.time(),
        "seconds": round(time.monotonic() - t0, 3),
    }
    atomic_write_json(tmp / MANIFEST, manifest)
    tmp.rename(dest)
    _report(plan)
    return manifest


def _report(plan: _Plan) -> None:
    """Say what the snapshot left out: secrets, untracked files, submodules that are not checked
    out."""
    from loguru import logger

    if plan.excluded:
        logger.warning(
            f"code snapshot: left out {len(plan.excluded)} secret-looking file(s): "
            f"{', '.join(plan.excluded[:5])}{' ...' if len(plan.excluded) > 5 else ''}"
        )
    if plan.left_untracked:
        logger.warning(
            f"code snapshot: {len(plan.left_untracked)} untracked file(s) not copied (git add "
            "them, or "
            f"launcher.snapshot_untracked=true): {', '.join(plan.left_untracked[:5])}"
            f"{' ...' if len(plan.left_untracked) > 5 else ''}"
        )
    if plan.missing_submodules:
        logger.warning(
            f"code snapshot: submodule(s) not checked out, not in the snapshot: "
            f"{', '.join(plan.missing_submodules)}"
        )


def code_dir(lc: Any, base: Path) -> Path | None:
    """Where a submission's job runs its code from: ``base/code`` (``base``: the run's or the
    sweep's directory), or None (``launcher.snapshot=false``, or an installed ``wf_launch``)."""
    if not lc.snapshot or project_root() is None:
        return None
    return Path(base).absolute() / CODE_DIR


def take_for(lc: Any, base: Path) -> dict[str, object] | None:
    """Copy the project's code for a submission as the launcher config ``lc`` asks (its
    ``snapshot*`` fields) into :func:`code_dir`; its manifest, or None."""
    from loguru import logger

    code, root = code_dir(lc, base), project_root()
    if code is None or root is None:
        if lc.snapshot:
            logger.warning(
                "launcher.snapshot: wf_launch is an installed package, not a git checkout: "
                "nothing to copy, the job runs the installed code"
            )
        return None
    max_bytes = int(lc.snapshot_max_mb * 2**20)
    manifest = take(code, root, untracked=lc.snapshot_untracked, max_bytes=max_bytes)
    logger.info(f"code snapshot: {manifest['files']} file(s) of {root} in {code}")
    return manifest


def job_setup(code: Path, root: Path, pythonpath: str | None = None) -> list[str]:
    """Batch-script lines that make the job's ranks import from the copy at ``code`` of the checkout
    ``root``."""
    entries = [str(code)]
    for entry in (pythonpath if pythonpath is not None else os.environ.get("PYTHONPATH", "")).split(
        os.pathsep
    ):
        if not entry:
            continue
        path = Path(entry).resolve()
        if path == root or root in path.parents:
            entries.append(str(code / path.relative_to(root)))
        else:
            entries.append(entry)
    joined = os.pathsep.join(dict.fromkeys(entries))
    return [f"cd {shlex.quote(str(code))}", f"export PYTHONPATH={shlex.quote(joined)}"]
