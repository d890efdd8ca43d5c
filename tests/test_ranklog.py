"""Rank output capture: linear in what a rank writes, bounded, and never raising into the task."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _in_subprocess(code: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (rank logging replaces sys.stdout / loguru's sinks)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _progress_seconds(tmp_path: Path, updates: int) -> float:
    proc = _in_subprocess(
        f"""
        import sys, time
        from pathlib import Path
        from wf_launch.rank.ranklog import setup_rank_logging
        setup_rank_logging(Path("r{updates}.log"), 0, "r0", console=False)
        t0 = time.perf_counter()
        for i in range({updates}):
            sys.stdout.write(f"\\r step {{i}}/{updates} [{{'#' * (i * 40 // {updates}):<40}}]")
        sys.stdout.write("\\n")
        sys.__stdout__.write(f"{{time.perf_counter() - t0}}\\n")
    """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_carriage_return_progress_costs_linear_time_and_keeps_the_last_state(
    tmp_path: Path,
) -> None:
    small = min(_progress_seconds(tmp_path, 10_000) for _ in range(2))
    big = min(_progress_seconds(tmp_path, 100_000) for _ in range(2))
    assert big / small < 30, (
        f"10x the updates took {big / small:.1f}x the time (quadratic capture?)"
    )
    log = (tmp_path / "r100000.log").read_text().splitlines()
    assert log[-1].endswith("step 99999/100000 [" + "#" * 39 + " ]")
    assert len(log) < 200, (
        "every \\r update became a line; a redrawn line is logged at most once a second"
    )


def test_a_line_without_newline_is_flushed_in_bounded_pieces(tmp_path: Path) -> None:
    proc = _in_subprocess(
        """
        import sys
        from pathlib import Path
        from wf_launch.rank.ranklog import setup_rank_logging
        setup_rank_logging(Path("r.log"), 0, "r0", console=False)
        for _ in range(300):
            sys.stdout.write("x" * 1000)
        sys.stdout._parts and sys.__stdout__.write(str(sys.stdout._pending))
    """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout or 0) <= 1 << 16
    assert (tmp_path / "r.log").read_text().count("x") >= 250_000


def test_a_full_disk_drops_log_lines_and_never_raises_into_the_task(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank0.log").symlink_to("/dev/full")
    proc = _in_subprocess(
        """
        import sys
        from pathlib import Path
        from loguru import logger
        from wf_launch.rank.ranklog import setup_rank_logging
        log = setup_rank_logging(Path("logs/rank0.log"), 0, "r0", console=False)
        for i in range(200):
            print(f"line {i}")
            log.info("record")
        import warnings
        warnings.warn("still fine")
        sys.__stdout__.write("task went on\\n")
    """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "task went on" in proc.stdout
    assert proc.stderr.count("dropping log lines") == 1 and "RecursionError" not in proc.stderr
    assert "No space left on device" in proc.stderr


def test_a_flooding_rank_keeps_head_and_tail_within_the_cap(tmp_path: Path) -> None:
    proc = _in_subprocess(
        """
        from pathlib import Path
        from wf_launch.rank.ranklog import setup_rank_logging
        log = setup_rank_logging(Path("rank0.log"), 0, "r0", console=False, max_log_mb=0.05)
        for i in range(5000):
            print(f"flood line {i:05d} " + "y" * 60)
    """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in tmp_path.glob("rank0*"))
    assert files == ["rank0.log", "rank0.tail.log", "rank0.tail.log.1"]
    total = sum(p.stat().st_size for p in tmp_path.glob("rank0*"))
    assert total <= 1.6 * 0.05 * (1 << 20)
    head = (tmp_path / "rank0.log").read_text()
    assert "flood line 00000" in head and "log capped" in head
    assert "flood line 04999" in (tmp_path / "rank0.tail.log").read_text()
