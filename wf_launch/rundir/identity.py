"""A run's stable id: ``RUN_DIR/run_id``, written once, the same for every attempt of the run.

Every local restart, SLURM requeue and ``launcher.resume=true`` relaunch runs in the same run
directory, so they all read the same id; a sweep point is its own run directory, so it has its
own. Ranks see it as ``ctx.run_id`` and in the environment as :data:`RUN_ID_ENV`
(``WF_RUN_ID``), and experiment trackers use it to continue one tracked run across attempts
(W&B's run id, the tag of the MLflow run).

The file is written with ``link()`` from a private temporary file: of two processes that set a
run directory up at once, exactly one id wins and both read it.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from . import files
from .io import read_text

__all__ = ["RUN_ID_ENV", "RunIdError", "ensure_run_id", "new_run_id", "read_run_id"]

RUN_ID_ENV = "WF_RUN_ID"
"""The environment variable that carries the run id into every rank (and the scripts it runs)."""

_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
"""What W&B, MLflow tags and file names all accept."""


class RunIdError(ValueError):
    """``RUN_DIR/run_id`` exists but does not hold a run id."""


def new_run_id() -> str:
    """A fresh id: the UTC time it was made and 32 random bits, e.g.
    ``20261203-101500-3f9a2c1b``."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(4)}"


def read_run_id(run_dir: Path | str) -> str | None:
    """The run's id (None when the directory has none yet); :class:`RunIdError` when the file is not
    one."""
    path = files.run_id_file(run_dir)
    try:
        text = read_text(path, 4096).strip()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RunIdError(f"{path}: cannot read the run id ({exc})") from None
    if not _VALID.fullmatch(text):
        raise RunIdError(
            f"{path}: {text[:80]!r} is not a run id (expected 1-64 letters, digits, '-' or '_')"
        )
    return text


def ensure_run_id(run_dir: Path | str) -> str:
    """The run's id, made and written now if the directory has none (written once, never
    replaced)."""
    existing = read_run_id(run_dir)
    if existing is not None:
        return existing
    path = files.run_id_file(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(new_run_id() + "\n")
    try:
        os.link(tmp, path)  # fails if another process wrote it first: then theirs is the id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    run_id = read_run_id(run_dir)
    if run_id is None:
        raise RunIdError(f"{path}: written but not readable")
    return run_id
