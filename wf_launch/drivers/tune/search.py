"""Successive halving: measure every survivor briefly, keep the better half, measure those longer,
repeat.

Round ``r`` runs each survivor for ``warmup + min_steps * 2**r`` steps (at most the full
length). After a round, trials that failed, ran out of memory or stalled are dropped
with their cause; of the rest the better half is kept, less any layout more than
``cutoff`` below the round's best (even counting its spread in its favour). The search
ends when one layout is left, or when ``--budget-s`` is spent (the best of the latest
measurements wins).
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...launchers.sweep_resume import still_running
from ...rundir import files
from ...rundir.record import RecordError, RunRecord, Status
from . import state as st
from .measure import Measurement, higher_is_better
from .report import describe_measurement
from .rounds import (
    BUDGET,
    DONE,
    INTERRUPTED,
    NO_METRIC_STOP,
    Interrupt,
    RoundRunner,
    Watch,
    job_dirs,
    sweep_argv,
    write_trial_configs,
)
from .space import TuneError

__all__ = [
    "Options",
    "Search",
    "pick_winner",
    "rank",
    "round_steps",
    "select",
    "simplicity",
    "tie_group",
]


@dataclass
class Options:
    """How the search measures and decides (the tune's command-line options)."""

    metric: str = "tokens_per_s"
    warmup: int = 2
    min_steps: int = 4
    cutoff: float = 0.3
    stall_s: float = 120.0
    budget_s: float | None = None
    steps_field: str = "steps"
    exhaustive: bool = False


def round_steps(index: int, opts: Options, full: int) -> int:
    """The length of round ``index``'s trials: the warm-up plus ``min_steps * 2**index``, at most
    ``full`` (``full`` itself when the tune measures exhaustively)."""
    if opts.exhaustive:
        return full
    return min(full, opts.warmup + opts.min_steps * 2**index)


def rank(measurements: list[Measurement], metric: str) -> list[Measurement]:
    """The measured trials, best first."""
    ok = [m for m in measurements if m.ok]
    return sorted(
        ok, key=lambda m: (m.value if higher_is_better(metric) else -m.value, m.trial), reverse=True
    )


def _clearly_worse(m: Measurement, best: Measurement, metric: str, cutoff: float) -> bool:
    """Whether ``m`` is more than ``cutoff`` below ``best`` even at the favourable end of its
    spread."""
    if cutoff <= 0:
        return False
    if higher_is_better(metric):
        return max(m.value, m.p75 or m.value) < best.value * (1 - cutoff)
    return min(m.value, m.p25 or m.value) > best.value / (1 - cutoff)


def select(
    measurements: list[Measurement], metric: str, cutoff: float
) -> tuple[list[str], dict[str, str]]:
    """(the trials kept, best first; why each other measured trial was dropped)."""
    ranked = rank(measurements, metric)
    if not ranked:
        return [], {}
    keep_n = max(1, len(ranked) // 2)
    kept, dropped = [], {}
    for i, m in enumerate(ranked):
        if i >= keep_n:
            dropped[m.trial] = f"in the worse half ({i + 1} of {len(ranked)})"
        elif i and _clearly_worse(m, ranked[0], metric, cutoff):
            dropped[m.trial] = f"more than {cutoff:.0%} below the round's best"
        else:
            kept.append(m.trial)
    return kept, dropped


def _interval(m: Measurement) -> tuple[float, float]:
    lo = m.value if m.p25 is None else m.p25
    hi = m.value if m.p75 is None else m.p75
    return min(lo, hi, m.value), max(lo, hi, m.value)


def tie_group(ranked: list[Measurement]) -> list[Measurement]:
    """The best measurement and every other whose quartiles overlap its quartiles (within noise)."""
    if not ranked:
        return []
    lo, hi = _interval(ranked[0])
    return [ranked[0], *(m for m in ranked[1:] if _interval(m)[0] <= hi and lo <= _interval(m)[1])]


def simplicity(point: dict) -> tuple[int, int, int]:
    """How complex a layout is (smaller is simpler): the model-parallel dimensions it splits over
    (tp, cp, pp above 1), their product, then tensor parallelism (the most communication)."""
    sizes = point["sizes"]
    split = [sizes[d] for d in ("tp", "cp", "pp")]
    return sum(n > 1 for n in split), split[0] * split[1] * split[2], sizes["tp"]


def pick_winner(ranked: list[Measurement], point: Callable[[str], dict]) -> tuple[str, list[str]]:
    """(the winner, the trials tied with the best): the best measured, or, when others overlap it
    within their noise, the simplest layout of the tie (then the better measured)."""
    tied = [m.trial for m in tie_group(ranked)]
    return min(tied, key=lambda t: (simplicity(point(t)), tied.index(t))), tied


def set_aside(tune_dir: Path, round_index: int) -> list[str]:
    """Before a round is resumed: move its trials that did not end ok to ``DIR/aside/`` (they rerun
    from the start:
    a measurement is not continued); :class:`TuneError` if one is still running."""
    moved = []
    for trial, job_dir in job_dirs(files.tune_round_dir(tune_dir, round_index)).items():
        try:
            record = RunRecord.read(job_dir)
        except RecordError:
            record = None
        if record is not None and record.final and record.status is Status.OK:
            continue
        if still_running(job_dir, record):
            raise TuneError(
                f"--resume {tune_dir}: trial {trial} of round {round_index} is still running "
                f"({job_dir}); stop it first (python -m wf_launch.status --cancel, or kill its "
                "launcher)"
            )
        aside = (
            tune_dir
            / files.TUNE_ASIDE
            / f"r{round_index}-{job_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        aside.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(job_dir), aside)
        moved.append(trial)
    return moved


class Search:
    """The tune's rounds, from wherever ``state`` stands; :meth:`run` returns the exit code."""

    def __init__(
        self,
        state: st.TuneState,
        opts: Options,
        overrides: list[str],
        interrupt: Interrupt,
        say: Callable[[str], None],
        on_round: Callable[[], None],
    ) -> None:
        self.state = state
        self.opts = opts
        self.overrides = overrides
        self.interrupt = interrupt
        self.say = say
        self.on_round = on_round

    def _deadline(self) -> float | None:
        if self.opts.budget_s is None:
            return None
        return time.monotonic() + self.opts.budget_s - self.state.elapsed()

    def _survivors(self) -> tuple[int, list[str], bool]:
        """(the round to run next, its trials, whether it resumes an unfinished round)."""
        rounds = self.state.rounds
        if rounds and rounds[-1]["status"] != DONE:
            return rounds[-1]["index"], list(rounds[-1]["trials"]), True
        if rounds:
            return rounds[-1]["index"] + 1, list(rounds[-1].get("kept") or []), False
        return 0, [p["id"] for p in self.state.space if p["verdict"]["status"] == "valid"], False

    def run(self) -> int:
        index, trials, resuming = self._survivors()
        while True:
            if self.interrupt.signum is not None:
                return self._after_round(
                    {"index": index}, INTERRUPTED, "interrupted between rounds", []
                )
            outcome = self._round(index, trials, resuming)
            resuming = False
            if outcome is not None:
                return outcome
            last = self.state.rounds[-1]
            kept = last.get("kept") or []
            budget = last["status"] == BUDGET or (len(kept) > 1 and self._spent())
            if budget or len(kept) <= 1 or self.opts.exhaustive:
                return self._finish(last, budget)
            index, trials = index + 1, kept

    def _argv(self, index: int, trials: list[str], steps: int) -> list[str]:
        """The round's command, built from the tune's checked fields (a stored command is never
        run: whoever could change ``tune.json`` would choose it)."""
        return sweep_argv(
            self.state.dir,
            index,
            trials,
            steps,
            self.overrides,
            self.opts.steps_field,
            self.state.launcher,
        )

    def _spent(self) -> bool:
        deadline = self._deadline()
        return deadline is not None and time.monotonic() >= deadline

    def _round(self, index: int, trials: list[str], resuming: bool) -> int | None:
        """Run round ``index``; None to go on, else the tune's exit code."""
        state, opts = self.state, self.opts
        known: dict[str, Measurement] = {}
        if resuming:
            rec = state.rounds[-1]
            moved = set_aside(state.dir, index)
            argv = [*self._argv(index, trials, rec["steps"]), "launcher.resume=true"]
            known = {m.trial: m for m in state.of_round(index) if m.ok and m.trial not in moved}
            self.say(
                f"round {index}: resuming: {len(known)} of {len(trials)} trial(s) measured before "
                "are kept; "
                f"{len(trials) - len(known)} run"
                + (f" ({len(moved)} from the start again)" if moved else "")
            )
        else:
            steps = round_steps(index, opts, state.full_length)
            argv = self._argv(index, trials, steps)
            rec = {"index": index, "steps": steps, "trials": trials, "status": "running"}
            state.rounds.append(rec)
            self.say(
                f"round {index}: {len(trials)} trial(s) of {steps} steps ({opts.warmup} warm-up), "
                f"sweep {files.tune_round_dir(state.dir, index)}"
            )
        rec["status"], rec["started_at"] = "running", time.time()
        write_trial_configs(state.dir, [state.point(t) for t in trials])
        state.save()
        watch = Watch(
            opts.metric,
            opts.warmup,
            opts.stall_s,
            self._deadline(),
            not any(m["status"] == "ok" for m in state.measurements),
            state.launcher,
        )
        runner = RoundRunner(
            state.dir,
            index,
            [state.point(t) for t in trials],
            rec["steps"],
            argv,
            watch,
            self.interrupt,
            self._heard,
            known,
        )
        t0 = time.monotonic()
        outcome = runner.run()
        for m in outcome.measurements:
            state.add(m)
        rec.update(
            status=outcome.status,
            ended_at=time.time(),
            wall_s=round(rec.get("wall_s", 0.0) + time.monotonic() - t0, 3),
            exit_code=outcome.exit_code,
        )
        return self._after_round(rec, outcome.status, outcome.message, outcome.measurements)

    def _heard(self, m: Measurement) -> None:
        self.state.add(m)
        self.state.save()
        self.say(
            f"  {self.state.point(m.trial)['label']:<36} "
            f"{describe_measurement(m, self.opts.metric)}"
        )

    def _after_round(
        self, rec: dict, status: str, message: str, ms: list[Measurement]
    ) -> int | None:
        state, opts = self.state, self.opts
        if status == INTERRUPTED:
            state.status = st.INTERRUPTED
            self.on_round()
            self.say(
                f"tune interrupted ({message}); continue it with: python -m wf_launch.tune "
                f"--resume {state.dir}"
            )
            return 128 + int(self.interrupt.signum or signal.SIGINT)
        if status == NO_METRIC_STOP:
            state.status = st.FAILED
            self.on_round()
            raise TuneError(f"the task has no metric to tune: {message}")
        if status not in (DONE, BUDGET):
            state.status = st.FAILED
            self.on_round()
            self.say(f"wf_launch.tune: round {rec['index']}: {message}")
            return 1
        kept, dropped = self._kept(rec, status, ms)
        rec.update(kept=kept, dropped=dropped)
        self.on_round()
        if not kept:
            state.status = st.FAILED
            self.on_round()
            why = (
                "--budget-s was spent before any trial was measured"
                if status == BUDGET
                else f"no trial of round {rec['index']} measured {opts.metric}: every one failed"
            )
            self.say(f"wf_launch.tune: {why} (see {state.dir / files.TUNE_MD})")
            return 1
        failed = [m for m in ms if not m.ok]
        if status == BUDGET:
            self.say(
                f"round {rec['index']}: cut by --budget-s after {len(ms) - len(failed)} of "
                f"{len(ms)} trial(s)"
            )
        else:
            self.say(
                f"round {rec['index']}: kept {len(kept)} of {len(ms)}"
                + (f" ({len(failed)} did not finish)" if failed else "")
            )
        return None

    def _kept(
        self, rec: dict, status: str, ms: list[Measurement]
    ) -> tuple[list[str], dict[str, str]]:
        """(the trials that go on, best first; why each other was dropped) after a round."""
        if status == BUDGET:  # no halving: the trials as their latest measurements rank them
            return self._best_latest(rec["trials"]), {}
        if self.opts.exhaustive:  # one round, every layout at full length: a ranking, no halving
            ranked = [m.trial for m in rank(ms, self.opts.metric)]
            return ranked[:1], {
                t: f"{i} of {len(ranked)}" for i, t in enumerate(ranked, 1) if i > 1
            }
        return select(ms, self.opts.metric, self.opts.cutoff)

    def _best_latest(self, trials: list[str]) -> list[str]:
        """Budget spent: the trials ranked by their latest measurement (from any round)."""
        latest = [m for t in trials if (m := self.state.latest(t)) is not None]
        return [m.trial for m in rank(latest, self.opts.metric)]

    def _finalists(self, rec: dict, budget: bool) -> list[Measurement]:
        """The last round's trials as measured, best first (their latest measurement when the
        budget cut the round)."""
        if budget:
            found = [self.state.latest(t) for t in rec["trials"]]
        else:
            found = [m for m in self.state.of_round(rec["index"]) if m.trial in rec["trials"]]
        return rank([m for m in found if m is not None], self.opts.metric)

    def _finish(self, rec: dict, budget: bool) -> int:
        """The winner: the best of the last round, or, when others tie with it within their noise
        (overlapping quartiles), the simplest layout of the tie."""
        state = self.state
        state.winner, tied = pick_winner(self._finalists(rec, budget), state.point)
        if len(tied) > 1:
            rec["tie"] = tied
        state.status = st.BUDGET if budget else st.DONE
        state.finished_at = time.time()
        self.on_round()
        return 0
