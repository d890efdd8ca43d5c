"""Rank-aware loguru logging: records carry the rank and the caller's location."""

from __future__ import annotations

import os
from typing import Any

from loguru import logger

__all__ = ["current_rank", "print_per_rank", "print_rank_0", "rank_logger"]


def current_rank() -> int:
    """This process's global rank: the live group's, else RANK from the launch, else 0."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except (ImportError, RuntimeError):
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def print_rank_0(message: object) -> None:
    """Log ``message`` once: on rank 0 only (any single process counts as rank 0)."""
    rank = current_rank()
    if rank == 0:
        logger.opt(depth=1).bind(rank=rank).info(str(message))


def print_per_rank(message: object) -> None:
    """Log ``message`` from every calling rank, tagged with that rank."""
    logger.opt(depth=1).bind(rank=current_rank()).info(str(message))


def rank_logger(**extra: Any) -> Any:
    """A loguru logger bound to this rank (plus ``extra`` fields such as layout coordinates)."""
    return logger.bind(rank=current_rank(), **extra)
