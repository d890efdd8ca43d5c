"""Runs continue with the code they were submitted with: a copy of the project's code per submission.

Any launcher whose runs start later, or elsewhere, than the command (SLURM today) uses it.

A queued or requeued SLURM job imports whatever the checkout holds when it starts, so
editing code while a job waits would silently change the job. With
``launcher.snapshot=true`` (the default) the submission copies the project's files
(``git ls-files``: tracked files as they are in the working tree, plus untracked files
that git does not ignore) into ``RUN_DIR/code`` (a sweep: once, into ``SWEEP_DIR/code``),
and the job's batch script starts in that copy with ``PYTHONPATH`` pointing into it:
the copy first, then every ``PYTHONPATH`` entry of the submitter, those inside the
checkout mapped to the same place in the copy.

"The project" is the git checkout that holds the imported ``wf_launch``; when
``wf_launch`` is an installed package (no checkout), there is nothing to copy: the
submission says so and runs the installed code.

submitit's ``RsyncSnapshot`` does a similar copy, but it needs ``rsync``, clones the
repository, changes the submitting process's working directory and copies tracked
files only; this module needs only ``git``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from ..rundir import files
from ..rundir.io import atomic_write_json, read_json

__all__ = ["CODE_DIR", "MANIFEST", "job_setup", "project_root", "take"]

CODE_DIR = files.CODE
MANIFEST = files.SNAPSHOT_MANIFEST


@lru_cache(maxsize=1)
def project_root() -> Path | None:
    """The git checkout that holds the imported ``wf_launch`` (None: an installed package)."""
    import wf_launch

    here = Path(wf_launch.__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    root = Path(out.stdout.strip()).resolve()
    return root if (root / "wf_launch" / "__init__.py").resolve() == here / "__init__.py" else None


def _files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, timeout=60, check=True)
    return sorted({f for f in out.stdout.decode().split("\0") if f})


def take(dest: Path, root: Path) -> dict[str, object]:
    """Copy the project's files at ``root`` into ``dest`` (created; an existing copy is kept); its manifest."""
    manifest = read_json(dest / MANIFEST) if (dest / MANIFEST).exists() else None
    if manifest:
        return manifest
    t0 = time.monotonic()
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    copied = 0
    for rel in _files(root):
        src = root / rel
        if not (src.is_file() or src.is_symlink()):
            continue  # deleted in the working tree
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        else:
            shutil.copy2(src, target)
        copied += 1
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                            timeout=10).stdout.strip() or None
    manifest = {"source": str(root), "commit": commit, "files": copied, "taken_at": time.time(),
                "seconds": round(time.monotonic() - t0, 3)}
    atomic_write_json(tmp / MANIFEST, manifest)
    tmp.rename(dest)
    return manifest


def job_setup(code: Path, root: Path, pythonpath: str | None = None) -> list[str]:
    """Batch-script lines that make the job's ranks import from the copy at ``code`` of the checkout ``root``."""
    entries = [str(code)]
    for entry in (pythonpath if pythonpath is not None else os.environ.get("PYTHONPATH", "")).split(os.pathsep):
        if not entry:
            continue
        path = Path(entry).resolve()
        if path == root or root in path.parents:
            entries.append(str(code / path.relative_to(root)))
        else:
            entries.append(entry)
    joined = os.pathsep.join(dict.fromkeys(entries))
    return [f"cd {shlex.quote(str(code))}", f"export PYTHONPATH={shlex.quote(joined)}"]
