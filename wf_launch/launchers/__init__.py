"""Launchers differ only in how rank processes come to exist; see ``get_launcher``."""

from __future__ import annotations

from typing import Any


def get_launcher(name: str) -> Any:
    """The launcher module for ``launcher.name`` (each has ``describe(plan)`` and ``launch(plan)``)."""
    if name == "local":
        from . import local

        return local
    if name == "slurm":
        from . import slurm

        return slurm
    raise ValueError(f"launcher.name={name!r} is not allowed: choose 'local' or 'slurm'")
