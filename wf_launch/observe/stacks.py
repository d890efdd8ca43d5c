"""Hang autopsy: where each rank is, from its stack dump or its failure's traceback, grouped.

Every rank dumps its stacks to ``logs/rank{r}.stacks`` on :data:`DUMP_SIGNAL` and leaves
``logs/rank{r}.pid`` (:mod:`wf_launch.rank.stackdump`); this module signals ranks, reads
their dumps (or failures' tracebacks) and groups them.

A rank's *spot* is its main thread's innermost frame outside torch and this
project's runtime (what the user's code was doing), plus the library call it
waits in; ranks at the same spot are listed once, compactly::

    ranks 0-4,6,7 wait in all_reduce at my_tasks.py:58 (train_step)
    rank 5 (tp0 cp1 pp1 dp0) is at my_tasks.py:52 in wfx_hang: time.sleep(60)
"""

from __future__ import annotations

import linecache
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..rank.stackdump import DUMP_SIGNAL
from ..rundir import files
from ..rundir.io import MAX_RECORD_BYTES, open_regular, read_text
from ..rundir.pids import live_rank_pid, read_pid_file

__all__ = [
    "DUMP_SIGNAL",
    "Frame",
    "Spot",
    "collect_dumps",
    "describe_groups",
    "group_spots",
    "last_dump",
    "live_autopsy",
    "local_pids",
    "parse_faulthandler",
    "parse_traceback",
    "rank_ranges",
    "read_last_dumps",
    "read_pid_file",
    "spot_of",
    "stack_offsets",
    "trigger",
]

_LIBRARY = re.compile(
    r"[/\\](torch[/\\]|threading\.py|contextlib\.py|multiprocessing[/\\]|runpy\.py|"
    r"importlib[/\\])|^<"
)
_PROJECT = re.compile(
    r"[/\\](worldfoundry[/\\]core[/\\]distributed|wf_launch[/\\](rank|observe|launchers)"
    r"|submitit[/\\])"
)
_RANK_ENTRY = re.compile(r"wf_launch[/\\]rank[/\\]entrypoint\.py$")
_GENERIC = frozenset(
    {"wrapper", "inner", "_fn", "fn", "__call__", "_wrapped_call_impl", "_call_impl"}
)


@dataclass(frozen=True)
class Frame:
    """One stack frame: file, line and function."""

    file: str
    line: int
    function: str

    @property
    def is_library(self) -> bool:
        """torch, the standard library's plumbing, or this project's runtime and launchers."""
        return bool(_LIBRARY.search(self.file) or _PROJECT.search(self.file))

    @property
    def is_project(self) -> bool:
        return bool(_PROJECT.search(self.file))

    def where(self) -> str:
        return f"{_short(self.file)}:{self.line}"

    def source(self) -> str:
        return linecache.getline(self.file, self.line).strip()


def _short(path: str) -> str:
    """A frame's file as a user knows it: inside a SLURM code snapshot, its path in the project;
    else relative to the working directory, or the file name alone for a long absolute path."""
    p = Path(path)
    for parent in p.parents:
        if (
            parent / files.SNAPSHOT_MANIFEST
        ).is_file():  # a SLURM code snapshot (launchers/slurm/snapshot.py)
            return str(p.relative_to(parent))
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return p.name if len(p.parts) > 3 else str(p)


_FH_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):", re.M)
_FH_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')


def parse_faulthandler(text: str) -> dict[int, list[Frame]]:
    """Each thread's frames (innermost first) in one faulthandler dump, by thread id."""
    threads: dict[int, list[Frame]] = {}
    current: list[Frame] | None = None
    for line in text.splitlines():
        head = _FH_THREAD.match(line)
        if head:
            current = threads.setdefault(int(head.group(2), 16), [])
            continue
        frame = _FH_FRAME.match(line)
        if frame and current is not None:
            current.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3).strip()))
    return threads


_TB_FRAME = re.compile(r'^\s+File "(.*)", line (\d+), in (.+)$')


def parse_traceback(text: str) -> list[Frame]:
    """The frames (innermost first) of a Python traceback's last chained exception."""
    blocks = re.split(
        r"\n(?:The above exception was the direct cause|During handling of the above exception)",
        text or "",
    )
    frames = [
        Frame(m.group(1), int(m.group(2)), m.group(3).strip())
        for m in map(_TB_FRAME.match, blocks[-1].splitlines())
        if m
    ]
    return frames[::-1]


@dataclass(frozen=True)
class Spot:
    """Where a rank is: its innermost frame outside the libraries, and the library call it waits
    in."""

    frame: Frame | None
    waits_in: str | None = None

    def as_record(self) -> dict[str, Any]:
        """The spot as ``result.json`` records a stuck rank: frame, function, source line, library
        call."""
        f = self.frame
        return {
            "frame": f.where() if f else None,
            "function": f.function if f else None,
            "source": f.source() if f else None,
            "waits_in": self.waits_in,
        }

    def text(self) -> str:
        if self.frame is None:
            return "in no frame of its own (only library frames)"
        where = f"{self.frame.where()} ({self.frame.function})"
        if self.waits_in:
            return f"wait{{s}} in {self.waits_in} at {where}"
        source = self.frame.source()
        return f"{{is}} at {self.frame.where()} in {self.frame.function}" + (
            f": {source}" if source else ""
        )


def spot_of(frames: list[Frame]) -> Spot:
    """The rank's spot, from its frames (innermost first).

    The innermost frame of the user's code, else (a rank still starting up) the
    innermost frame of this project's runtime; ``waits_in`` is the library call
    made from there. Frames outside the rank's entry (``rank_main``) are not the rank's:
    a forked rank inherits the launcher's stack below it (Hydra, the CLI, the agent).
    """
    frames = rank_frames(frames)
    for wanted in (lambda f: not f.is_library, lambda f: f.is_project):
        for i, frame in enumerate(frames):
            if wanted(frame):
                inner = [
                    f.function for f in frames[:i] if f.is_library and f.function not in _GENERIC
                ]
                return Spot(frame, inner[-1] if inner else None)
    return Spot(None)


def rank_frames(frames: list[Frame]) -> list[Frame]:
    """``frames`` (innermost first) up to the rank's entry, ``rank/entrypoint.py:rank_main``;
    all of them when there is none (a process that is not a rank)."""
    for i, frame in enumerate(frames):
        if frame.function == "rank_main" and _RANK_ENTRY.search(frame.file):
            return frames[: i + 1]
    return frames


def last_dump(text: str) -> dict[int, list[Frame]]:
    """The most recent of several dumps appended to one stacks file (a thread id repeats at each new
    dump)."""
    blocks = list(_FH_THREAD.finditer(text))
    start, seen = 0, set()
    for m in blocks:
        tid = int(m.group(2), 16)
        if tid in seen:
            start, seen = m.start(), set()
        seen.add(tid)
    return parse_faulthandler(text[start:])


def read_last_dumps(run_dir: Path | str, ranks: Iterable[int]) -> dict[int, list[Frame]]:
    """Each rank's main-thread frames in the last dump of its stacks file (ranks without one are
    absent)."""
    out = {}
    for rank in ranks:
        try:
            text = read_text(files.rank_stacks(run_dir, rank), MAX_RECORD_BYTES)
        except (OSError, ValueError):
            continue
        frames = main_thread_frames(
            last_dump(text), (read_pid_file(run_dir, rank) or {}).get("main_thread")
        )
        if frames:
            out[rank] = frames
    return out


def main_thread_frames(dump: dict[int, list[Frame]], main_thread: int | None) -> list[Frame]:
    if main_thread in dump:
        return dump[main_thread]
    return next(iter(dump.values()), [])


def trigger(
    pids: dict[int, int], sender: Callable[[int, int], None] = os.kill, signum: int = DUMP_SIGNAL
) -> set[int]:
    """Send ``signum`` (:data:`DUMP_SIGNAL`) to each rank's pid; returns the ranks that were
    signalled.

    A pid that is not a single process (0, negative: a process group or every process) is never
    signalled.
    """
    sent = set()
    for rank, pid in pids.items():
        if not (isinstance(pid, int) and pid > 1):
            continue
        try:
            sender(pid, signum)
            sent.add(rank)
        except (ProcessLookupError, PermissionError):
            continue
    return sent


def collect_dumps(
    run_dir: Path | str,
    ranks: Iterable[int],
    offsets: dict[int, int],
    wait_s: float = 2.0,
    alive: Callable[[int], bool] | None = None,
) -> dict[int, list[Frame]]:
    """Each rank's main-thread frames from what it appended to its stacks file after ``offsets``.

    Waits up to ``wait_s`` for the dumps to arrive (a rank writes its dump from a
    signal handler, at once, unless it is stopped or dead). With ``alive`` (rank ->
    still running?), a rank that has exited is not waited for: after a kill -9 the
    survivors leave on their own, and a restart must not wait ``wait_s`` for them.
    """
    pending, out = set(ranks), {}
    deadline = time.monotonic() + wait_s
    while pending:
        gone = {
            r for r in pending if alive is not None and not alive(r)
        }  # before reading: a last dump counts
        for rank in sorted(pending):
            path = files.rank_stacks(run_dir, rank)
            try:
                with open(open_regular(path), "rb") as f:
                    f.seek(offsets.get(rank, 0))
                    text = f.read(MAX_RECORD_BYTES).decode("utf-8", errors="replace")
            except (OSError, ValueError):
                continue
            dump = parse_faulthandler(text)
            frames = main_thread_frames(
                dump, (read_pid_file(run_dir, rank) or {}).get("main_thread")
            )
            if frames and text.endswith("\n"):
                out[rank] = frames
                pending.discard(rank)
        pending -= gone
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return out


def stack_offsets(run_dir: Path | str, ranks: Iterable[int]) -> dict[int, int]:
    """Current size of each rank's stacks file (a new dump is what comes after it)."""
    out = {}
    for rank in ranks:
        try:
            out[rank] = files.rank_stacks(run_dir, rank).stat().st_size
        except OSError:
            out[rank] = 0
    return out


def rank_ranges(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 3, 4, 6, 7] -> '0-4,6,7'."""
    items = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(
            f"{items[i]}-{items[j]}" if j - i >= 2 else ",".join(map(str, items[i : j + 1]))
        )
        i = j + 1
    return ",".join(parts)


def group_spots(spots: dict[int, Spot]) -> list[tuple[list[int], Spot]]:
    """Ranks at the same spot together; the largest group first, then by first rank."""
    groups: dict[Spot, list[int]] = {}
    for rank in sorted(spots):
        groups.setdefault(spots[rank], []).append(rank)
    return sorted(((r, s) for s, r in groups.items()), key=lambda g: (-len(g[0]), g[0][0]))


def describe_groups(
    groups: list[tuple[list[int], Spot]],
    label_of: Callable[[int], str] | None = None,
    indent: str = "  ",
) -> list[str]:
    """One line per group: 'ranks 0-4,6,7 wait in ...' or 'rank 5 (tp0 cp1 pp1 dp0) is at ...'."""
    lines = []
    for ranks, spot in groups:
        if len(ranks) == 1:
            coords = f" ({label_of(ranks[0]).split(' ', 1)[-1]})" if label_of else ""
            who, verb = f"rank {ranks[0]}{coords}", {"s": "s", "is": "is"}
        else:
            who, verb = f"ranks {rank_ranges(ranks)}", {"s": "", "is": "are"}
        lines.append(f"{indent}{who} {spot.text().format(**verb)}")
    return lines


def local_pids(run_dir: Path | str, world_size: int) -> dict[int, int]:
    """Ranks of a run on this host whose recorded process is still that rank's
    (:func:`live_rank_pid`: never a stale, reused, foreign or group pid)."""
    out = {}
    for rank in files.rank_files(run_dir, "pid"):
        if rank >= world_size:
            break
        pid = live_rank_pid(run_dir, rank)
        if pid is not None:
            out[rank] = pid
    return out


def live_autopsy(
    run_dir: Path | str,
    world_size: int,
    label_of: Callable[[int], str],
    signal_ranks: Callable[[Path, int], set[int]],
    wait_s: float = 5.0,
) -> tuple[int, list[str]]:
    """Dump and group the stacks of a running run's ranks now: (ranks that answered, report lines).

    ``signal_ranks(run_dir, signum)`` is the run's launcher's way to reach its ranks
    (:meth:`~wf_launch.launchers.LauncherHooks.signal_ranks`: the pids recorded on this
    host by default, SLURM's ``scancel --signal``); it returns the ranks expected to answer.
    """
    run_dir = Path(run_dir)
    offsets = stack_offsets(run_dir, files.rank_files(run_dir, "stacks"))
    expected = signal_ranks(run_dir, DUMP_SIGNAL)
    if not expected:
        return 0, [f"no running rank of {run_dir} could be reached (has the run ended?)"]
    dumps = collect_dumps(run_dir, expected, offsets, wait_s=wait_s)
    lines = [f"stacks of {len(dumps)}/{world_size} ranks of {run_dir}:"]
    lines += describe_groups(group_spots({r: spot_of(f) for r, f in dumps.items()}), label_of)
    silent = sorted(expected - set(dumps))
    if silent:
        lines.append(
            f"  ranks {rank_ranges(silent)} gave no dump (ended, or stopped in a signal-blocking "
            "call)"
        )
    lines.append(f"  full dumps: {files.stacks_glob(run_dir)}")
    return len(dumps), lines
