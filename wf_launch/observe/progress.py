"""The launcher's live view of the ranks' progress: one line, stall warnings, a bar on a terminal.

:class:`ProgressView` reads every rank's latest state (:mod:`wf_launch.rundir.progress`) and
makes one line of it: step/total, rate, ETA, the slowest rank with its coordinates,
rank 0's latest metrics; and names a rank that made no progress for
``stall_warning_s``. :class:`ProgressMonitor` shows it while the launcher waits:
a tqdm bar on a terminal (tqdm: one small pure-Python dependency that redraws a
single line well, where rich would bring a whole rendering stack), a plain line
every ``progress_interval_s`` elsewhere (CI, log files, sbatch output).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..rundir.progress import read_progress
from ..rundir.text import printable

__all__ = ["ProgressMonitor", "ProgressView"]


@dataclass
class ProgressView:
    """Turns the ranks' latest states into one line, and stall warnings."""

    run_dir: Path
    world_size: int
    label_of: Callable[[int], str]
    stall_warning_s: float = 120.0
    started: float = field(default_factory=time.time)
    since: float | None = None
    """States published before this time (an earlier attempt's, before a resume) are not shown."""
    _history: list[tuple[float, int]] = field(default_factory=list)
    _warned: dict[int, int] = field(default_factory=dict)

    def snapshot(self, now: float | None = None) -> dict[str, Any] | None:
        """The run's progress now (None before any rank reported)."""
        now = time.time() if now is None else now
        states = self._states()
        if not states:
            return None
        slowest = min(states, key=lambda r: (states[r]["step"], r))
        step = states[slowest]["step"]
        total = next((s["total"] for s in states.values() if s.get("total")), None)
        rate = self._rate(now, step)
        eta = (total - step) / rate if rate and total is not None and total > step else None
        return {
            "step": step,
            "total": total,
            "rate": rate,
            "eta_s": eta,
            "slowest": slowest,
            "reported": len(states),
            "metrics": (states.get(0) or {}).get("metrics") or {},
            "states": states,
        }

    def _states(self) -> dict[int, dict[str, Any]]:
        """Every rank's latest state, but those published before :attr:`since`."""
        states = read_progress(self.run_dir, self.world_size)
        if self.since is None:
            return states
        return {r: s for r, s in states.items() if float(s.get("time") or 0) >= self.since}

    def _rate(self, now: float, step: int) -> float | None:
        """Steps per second over the last 30 s (None until the step moved)."""
        self._history.append((now, step))
        self._history = [(t, s) for t, s in self._history if now - t <= 30] or [(now, step)]
        t0, s0 = self._history[0]
        return (step - s0) / (now - t0) if now > t0 and step > s0 else None

    def line(self, snap: dict[str, Any]) -> str:
        """'step 340/1000 (34%), 2.1 steps/s, ETA 5 min; slowest rank 5 (tp0 cp1 pp1 dp0);
        loss=0.12'."""
        total = snap["total"]
        parts = [
            f"step {snap['step']}"
            + (f"/{total} ({100 * snap['step'] / total:.0f}%)" if total else "")
        ]
        if snap["rate"]:
            parts.append(f"{snap['rate']:.3g} steps/s")
        if snap["eta_s"] is not None:
            parts.append(f"ETA {_duration(snap['eta_s'])}")
        text = ", ".join(parts)
        if self.world_size > 1:
            slowest = snap["slowest"]
            text += f"; slowest rank {slowest} ({self.label_of(slowest).split(' ', 1)[-1]})"
        if snap["reported"] < self.world_size:
            text += f"; {snap['reported']}/{self.world_size} ranks reporting"
        metrics = printable(
            ", ".join(f"{k}={_fmt(v)}" for k, v in list(snap["metrics"].items())[:4])
        )
        return f"{text}; {metrics}" if metrics else text

    def stalls(self, snap: dict[str, Any], now: float | None = None) -> list[str]:
        """A warning for each rank with no progress for ``stall_warning_s`` (once per step it is
        stuck at)."""
        now = time.time() if now is None else now
        out = []
        for rank, state in sorted(snap["states"].items()):
            idle = now - float(state.get("time") or now)
            done = state.get("total") is not None and state["step"] >= state["total"]
            if (
                idle >= self.stall_warning_s
                and not done
                and self._warned.get(rank) != state["step"]
            ):
                self._warned[rank] = state["step"]
                out.append(
                    f"rank {rank} ({self.label_of(rank).split(' ', 1)[-1]}): no progress for "
                    f"{idle:.0f} s, last at step {state['step']}"
                )
        return out


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else f"{value!s:.40}"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class ProgressMonitor:
    """A launcher thread that shows the run's progress until :meth:`stop`.

    ``write`` receives the progress line every ``interval_s`` when not on a terminal (on a
    terminal a tqdm bar is redrawn in place instead); ``warn`` (default: ``write``) the
    stall warnings.
    """

    def __init__(
        self,
        view: ProgressView,
        interval_s: float = 10.0,
        write: Callable[[str], None] | None = None,
        tty: bool | None = None,
        poll_s: float = 0.5,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.view = view
        self.interval_s = interval_s
        self.write = write or (
            lambda line: print(f"wf_launch: {line}", file=sys.stderr, flush=True)
        )
        self.warn = warn or self.write
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wf-progress", daemon=True)
        self._bar: Any = None
        self._last_line = -math.inf
        self._last_tick = -math.inf

    def start(self) -> ProgressMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (if started), show the last state, close the bar."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.tick()
        if self._bar is not None:
            self._bar.close()

    def maybe_tick(self) -> None:
        """:meth:`tick` at most every ``poll_s``: for a caller's own loop instead of the thread."""
        now = time.monotonic()
        if now - self._last_tick >= self.poll_s:
            self._last_tick = now
            self.tick()

    def tick(self) -> None:
        """Read the ranks' states once and show them."""
        snap = self.view.snapshot()
        if snap is None:
            return
        for warning in self.view.stalls(snap):
            self.warn(warning)
        if self.tty:
            self._draw(snap)
        elif time.monotonic() - self._last_line >= self.interval_s:
            self._last_line = time.monotonic()
            self.write(self.view.line(snap))

    def _draw(self, snap: dict[str, Any]) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(
                total=snap["total"],
                initial=snap["step"],
                desc="wf_launch",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                leave=True,
            )  # initial: a rate from here on
        if snap["total"] is not None and self._bar.total != snap["total"]:
            self._bar.total = snap["total"]
        self._bar.n = snap["step"]
        extra = self.view.line(snap).split("; ", 1)
        self._bar.set_postfix_str(extra[1] if len(extra) > 1 else "", refresh=False)
        self._bar.refresh()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            except Exception as exc:  # the view must never take the launch down
                self.write(f"progress display failed: {type(exc).__name__}: {exc}")
                return
