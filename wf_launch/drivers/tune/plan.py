"""How a tune measures its space: by successive halving, or, when the space is small, every valid
layout at full length (exhaustively).

Halving runs more, shorter trials than measuring every layout once at full length; each trial
pays a launch (start-up, the first collectives, the end) and each round a sweep's start. On a
small space or a short run those launches cost more than the steps halving saves: the tune then
measures exhaustively, which also gives every layout's full-length figure. The choice is made
before anything starts, from the trial counts and lengths alone, counting a launch as
``launch_steps`` steps (``--launch-steps``; a trial's launch and end cost 10 to 60 steps of
``train`` on this machine kind, the report shows the measured figure).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["AUTO", "EXHAUSTIVE", "HALVING", "LAUNCH_STEPS", "Plan", "choose", "halving_rounds"]

AUTO, HALVING, EXHAUSTIVE = "auto", "halving", "exhaustive"
LAUNCH_STEPS = 20.0
"""What one trial's launch and end cost, in steps of the task (the default of
``--launch-steps``)."""


def halving_rounds(points: int, warmup: int, min_steps: int, full: int) -> list[tuple[int, int]]:
    """(trials, steps) of each round successive halving runs at most: the better half goes on, each
    round's trials ``warmup + min_steps * 2**round`` steps long (never beyond ``full``)."""
    rounds, n = [], points
    while True:
        rounds.append((n, min(full, warmup + min_steps * 2 ** len(rounds))))
        n = max(1, n // 2)
        if n == 1:
            return rounds


@dataclass
class Plan:
    """The search chosen, and the estimate it was chosen on (in steps; a launch = launch_steps)."""

    search: str
    points: int
    full_length: int
    rounds: list[tuple[int, int]]
    launch_steps: float
    asked: str = AUTO

    @property
    def exhaustive(self) -> bool:
        return self.search == EXHAUSTIVE

    def halving_cost(self) -> float:
        """Successive halving's cost in steps: each round's start, its launches and its steps."""
        k = self.launch_steps
        return sum(k + n * (k + steps) for n, steps in self.rounds)

    def exhaustive_cost(self) -> float:
        """Every valid layout once at full length, in steps: one round, a launch per layout."""
        return self.launch_steps + self.points * (self.launch_steps + self.full_length)

    def why(self) -> str:
        """One sentence: the search, and the estimate that chose it."""
        trials = sum(n for n, _ in self.rounds)
        steps = sum(n * s for n, s in self.rounds)
        compared = (
            f"successive halving would run {trials} trial(s), {steps} steps in all, over "
            f"{len(self.rounds)} round(s); every layout once at full length is {self.points} "
            f"trial(s) of {self.full_length} steps"
        )
        if self.asked != AUTO:
            return f"{self.search} (--search {self.asked}): {compared}"
        costs = (
            f"about {self.halving_cost():.0f} against {self.exhaustive_cost():.0f} step times "
            f"(a launch counted as {self.launch_steps:g} steps, --launch-steps)"
        )
        if self.exhaustive:
            return f"exhaustive, the space is small: {compared}; {costs}"
        return f"successive halving: {compared}; {costs}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        rounds = [(int(n), int(s)) for n, s in data["rounds"]]
        return cls(**{**data, "rounds": rounds})


def choose(
    points: int,
    warmup: int,
    min_steps: int,
    full: int,
    launch_steps: float = LAUNCH_STEPS,
    asked: str = AUTO,
) -> Plan:
    """The plan for ``points`` valid layouts: ``asked``, or (auto) the cheaper search by
    estimate."""
    rounds = halving_rounds(points, warmup, min_steps, full)
    plan = Plan(HALVING, points, full, rounds, launch_steps, asked)
    if asked != AUTO:
        plan.search = asked
    elif plan.exhaustive_cost() <= plan.halving_cost():
        plan.search = EXHAUSTIVE
    return plan
