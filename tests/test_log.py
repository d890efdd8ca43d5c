"""Rank-aware loguru helpers: who logs, and where the record says it came from."""

from __future__ import annotations

from typing import Any

import pytest
from loguru import logger
from multirank import run_ranks

from worldfoundry.core.distributed import print_per_rank, print_rank_0


def _capture() -> tuple[list[dict[str, Any]], int]:
    records: list[dict[str, Any]] = []
    sink = logger.add(lambda m: records.append(m.record), level="INFO")
    return records, sink


def _summary(records: list[dict[str, Any]]) -> list[tuple[str, int, str, str]]:
    return [(r["message"], r["extra"]["rank"], r["function"], r["file"].name) for r in records]


def test_single_process_without_a_group_counts_as_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    records, sink = _capture()
    try:
        print_rank_0("once")
        print_per_rank("each")
    finally:
        logger.remove(sink)
    fn = "test_single_process_without_a_group_counts_as_rank_0"
    assert _summary(records) == [("once", 0, fn, "test_log.py"), ("each", 0, fn, "test_log.py")]


def test_rank_from_the_launch_environment_before_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    records, sink = _capture()
    try:
        print_rank_0("not me")
        print_per_rank("me")
    finally:
        logger.remove(sink)
    assert [(m, r) for m, r, _, _ in _summary(records)] == [("me", 3)]


def _log_on_ranks(rank: int, world: int) -> list[tuple[str, int, str, str]]:
    records, sink = _capture()
    print_rank_0("hello once")
    print_per_rank(f"hello from {rank}")
    logger.remove(sink)
    return _summary(records)


@pytest.mark.slow
def test_print_rank_0_once_and_print_per_rank_everywhere_on_real_ranks() -> None:
    out = run_ranks(_log_on_ranks, 4)
    assert out[0] == [
        ("hello once", 0, "_log_on_ranks", "test_log.py"),
        ("hello from 0", 0, "_log_on_ranks", "test_log.py"),
    ]
    for r in (1, 2, 3):
        assert out[r] == [(f"hello from {r}", r, "_log_on_ranks", "test_log.py")]
