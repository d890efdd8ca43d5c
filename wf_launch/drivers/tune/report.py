"""A tune's report: ``tune_report.md`` / ``.csv``, ``tune_chart.png`` and ``best.yaml`` in the tune
directory.

Every point of the space appears: pruned (and why), or measured in each round it ran
(value and spread), and how it left the search (dropped, failed with its cause, or the
winner). The header compares the time the tune took with what running every valid
layout to full length would have cost, estimated from round 0 (each trial's launch and
end, plus the full length times its steady step time).
"""

from __future__ import annotations

import csv
import io
import shlex
from pathlib import Path

import yaml

from ...config.redact import redact_overrides
from ...readers.sweep.tables import fmt
from ...rundir import files
from ...rundir.io import atomic_write_text
from .chart import render_chart
from .measure import STEP_TIME, Measurement, higher_is_better
from .plan import EXHAUSTIVE, Plan
from .state import TuneState, order_points

__all__ = ["best_command", "describe_measurement", "full_length_cost", "outcome_of", "write_report"]


def _value(m: Measurement) -> str:
    spread = m.spread
    return fmt(m.value) + (f" ±{spread:.0%}" if spread is not None else "")


def describe_measurement(m: Measurement, metric: str) -> str:
    """One line for the console: the value and its spread, or how the trial ended."""
    if m.ok:
        step = (
            f", {fmt(m.step_time)} s/step"
            if m.step_time is not None and metric != STEP_TIME
            else ""
        )
        return f"{_value(m)} {metric} ({m.measured} steady step(s){step})"
    return f"{m.status.upper()}: {m.cause}" if m.cause else m.status.upper()


def _dropped(state: TuneState, index: int, reason: str) -> str:
    if state.args.get("plan", {}).get("search") == EXHAUSTIVE:
        return f"measured at full length: {reason}"
    return f"dropped after round {index}: {reason}"


def _in_round(state: TuneState, rec: dict, trial: str) -> str:
    """How ``trial`` left round ``rec`` (the latest round it ran in)."""
    i = rec["index"]
    m = next((m for m in state.of_round(i) if m.trial == trial), None)
    measured = m is not None and m.ok
    if m is not None and not measured and m.status != "not_run":
        return f"{m.status} in round {i}: {m.cause}"
    if trial in (rec.get("tie") or []):
        return f"tied with the winner in round {i} (the winner is the simpler layout)"
    if trial in (rec.get("dropped") or {}):
        return _dropped(state, i, rec["dropped"][trial])
    if rec.get("status") == "budget" and not measured:
        return f"not measured in round {i}: --budget-s spent"
    if rec.get("status") != "done":
        return f"round {i}: {rec.get('status')}"
    return f"kept after round {i}"


def outcome_of(state: TuneState, trial: str) -> str:
    """How a point left the search: pruned, failed, dropped (and in which round), kept, tied, or
    the winner."""
    verdict = state.point(trial)["verdict"]
    if verdict["status"] != "valid":
        return f"pruned ({verdict['status']}): {verdict['message']}"
    if trial == state.winner:
        return "winner"
    rec = next((r for r in reversed(state.rounds) if trial in r["trials"]), None)
    return "not measured" if rec is None else _in_round(state, rec, trial)


def _full_length_s(m: Measurement | None, full_length: int) -> float | None:
    """A trial's cost at full length, from its round-0 measurement: its launch and end plus the
    full length times its steady step time (a failed trial: what it took)."""
    if m is None:
        return None
    if m.step_time is not None and m.overhead_s is not None:
        return m.overhead_s + full_length * m.step_time
    if m.wall_s is not None and m.status not in ("ok", "not_run"):
        return m.wall_s
    return None


def sweep_start_s(state: TuneState) -> float:
    """What round 0 took beyond its trials (the sweep's own start and end): a sweep of every
    layout pays it once too."""
    first = next((r for r in state.rounds if r["index"] == 0 and r.get("wall_s")), None)
    if first is None:
        return 0.0
    trials = sum(m.wall_s or 0.0 for m in state.of_round(0))
    return max(0.0, first["wall_s"] - trials)


def full_length_cost(state: TuneState) -> tuple[float, int]:
    """(seconds one sweep of every valid layout at full length would take, layouts the estimate
    could not cover)."""
    first = {m.trial: m for m in state.of_round(0)}
    costs = [
        _full_length_s(first.get(p["id"]), state.full_length)
        for p in state.space
        if p["verdict"]["status"] == "valid"
    ]
    known = [c for c in costs if c is not None]
    total = sum(known) + (sweep_start_s(state) if known else 0.0)
    return total, len(costs) - len(known)


def best_overrides(state: TuneState) -> list[str]:
    """The user's overrides plus the winner's sizes and ``--also`` values."""
    assert state.winner is not None
    return [*state.args["overrides"], *state.point(state.winner)["overrides"]]


def best_command(state: TuneState) -> str:
    shown = redact_overrides(best_overrides(state))
    return "python -m wf_launch " + " ".join(shlex.quote(o) for o in shown)


def _task(state: TuneState) -> str:
    given = [o.split("=", 1) for o in state.args["overrides"] if "=" in o]
    return next((value for key, value in given if key == "task"), "?")


def _winner_lines(state: TuneState) -> list[str]:
    if state.winner is None:
        return [f"No winner yet (tune {state.status}).", ""]
    m = state.latest(state.winner)
    won = (
        f"{_value(m)} {state.args['metric']} (round {m.round}, {m.measured} steady steps)"
        if m
        else "no measurement"
    )
    return [
        f"**Winner: {state.point(state.winner)['label']}**: {won}. "
        f"Run it (also in `{files.TUNE_BEST}`):",
        "",
        f"    {best_command(state)}",
        "",
    ]


def tie_line(state: TuneState) -> str | None:
    """The tie the winner was chosen from, when the best measurements overlap within their noise."""
    tie = next((r["tie"] for r in reversed(state.rounds) if r.get("tie")), None)
    if not tie or state.winner is None:
        return None
    shown = []
    for trial in tie:
        m = state.latest(trial)
        shown.append(f"{state.point(trial)['label']} ({_value(m) if m else '?'})")
    return (
        f"Tie: {', '.join(shown)} overlap within their noise (quartiles); the simpler layout "
        f"wins: {state.point(state.winner)['label']}."
    )


def _space_lines(state: TuneState) -> list[str]:
    args, metric = state.args, state.args["metric"]
    pruned = {
        s: sum(p["verdict"]["status"] == s for p in state.space) for s in ("invalid", "memory")
    }
    memory = (
        f", {pruned['memory']} over --mem-gb {args['mem_gb']:g}"
        if args["mem_gb"] is not None
        else " (no --mem-gb)"
    )
    also = "".join(f" × {len(v)} value(s) of {k}" for k, v in args["also"])
    flow = " → ".join(str(len(r["trials"])) for r in state.rounds) + (
        " → 1" if state.winner else ""
    )
    valid = sum(p["verdict"]["status"] == "valid" for p in state.space)
    better = "higher" if higher_is_better(metric) else "lower"
    return [
        f"- Space: {len(state.space)} point(s) = the layouts of {args['world_size']} "
        f"rank(s){also}.",
        f"- Pruned without starting anything: {pruned['invalid']} refused by validation{memory}.",
        f"- Measured: {valid} valid point(s); rounds {flow}; "
        f"{sum(len(r['trials']) for r in state.rounds)} trial(s) in all.",
        f"- Metric: `{metric}` ({better} is better), median over each trial's steady steps "
        f"({args['warmup']} warm-up step(s) dropped); ± is half the interquartile range.",
    ]


def _search_lines(state: TuneState) -> list[str]:
    plan = state.args.get("plan")
    lines = [f"- Search: {Plan.from_json(plan).why()}."] if plan else []
    tie = tie_line(state)
    return [*lines, f"- {tie}"] if tie else lines


def launch_in_steps(state: TuneState) -> float | None:
    """What a trial's launch and end cost, in step times, as round 0 measured it (the median)."""
    ratios = sorted(
        m.overhead_s / m.step_time
        for m in state.of_round(0)
        if m.ok and m.overhead_s is not None and m.step_time
    )
    return ratios[len(ratios) // 2] if ratios else None


def cost_ratio(state: TuneState) -> float | None:
    """The tune's time over the estimated time of every valid layout at full length."""
    cost, _ = full_length_cost(state)
    return state.elapsed_s / cost if cost else None


def cost_line(state: TuneState) -> str | None:
    """The tune's own cost against running every valid layout at full length; a warning when the
    tune cost more."""
    cost, missing = full_length_cost(state)
    ratio = cost_ratio(state)
    if ratio is None:
        return None
    line = (
        f"Time: {state.elapsed_s:.0f} s spent. Running every valid layout to full length "
        f"({state.full_length} steps) would have cost about {cost:.0f} s (from round 0: each "
        f"trial's launch and end, plus {state.full_length} × its steady step time, plus the "
        "sweep's own start"
        + (f"; {missing} layout(s) not measured" if missing else "")
        + f"): **{ratio:.2f}x**."
    )
    launch = launch_in_steps(state)
    if launch is not None:
        line += f" A launch cost about {launch:.0f} step times here."
    if state.args.get("plan", {}).get("search") == EXHAUSTIVE:
        line += " Measured exhaustively: the difference is the tuner's own start."
    elif ratio > 1:
        line += (
            " **Warning: this tune cost more than measuring every layout at full length**"
            " (a small space or short runs: `--search exhaustive`, or a higher `--launch-steps`)."
        )
    return line


def _header(state: TuneState) -> list[str]:
    title = f"# Layout tune: task={_task(state)}, world_size={state.args['world_size']}"
    cost = cost_line(state)
    return [
        title,
        "",
        *_winner_lines(state),
        *_space_lines(state),
        *_search_lines(state),
        *([f"- {cost}"] if cost else []),
        "",
    ]


def _rounds_table(state: TuneState) -> list[str]:
    lines = [
        "## Rounds",
        "",
        "| round | steps | trials | measured | kept | wall_s | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec in state.rounds:
        ms = state.of_round(rec["index"])
        lines.append(
            f"| {rec['index']} | {rec['steps']} | {len(rec['trials'])} | {sum(m.ok for m in ms)} | "
            f"{len(rec.get('kept') or [])} | {fmt(rec.get('wall_s'))} | {rec['status']} |"
        )
    return [*lines, ""]


def render_markdown(state: TuneState) -> str:
    rounds = [r["index"] for r in state.rounds]
    also_keys = [k for k, _ in state.args["also"]]
    head = [
        "point",
        "tp",
        "cp",
        "pp",
        "dp",
        *(k.rpartition(".")[2] for k in also_keys),
        "est. GB",
        *(f"round {r}" for r in rounds),
        "outcome",
    ]
    lines = [
        *_header(state),
        *_rounds_table(state),
        "## Every point",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    by = {(d["trial"], d["round"]): Measurement.from_json(d) for d in state.measurements}
    for point in order_points(state):
        cells = [
            point["id"].split("-", 1)[0],
            *(str(point["sizes"][d]) for d in ("tp", "cp", "pp", "dp")),
            *(str(point["also"].get(k, "")) for k in also_keys),
            fmt(point["verdict"].get("estimate_gb")),
        ]
        for r in rounds:
            m = by.get((point["id"], r))
            cells.append("" if m is None else _value(m) if m.ok else m.status.upper())
        outcome = outcome_of(state, point["id"])
        cells.append(
            f"**{outcome}**"
            if outcome == "winner"
            else outcome.replace("|", "\\|").replace("\n", " ")
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_csv(state: TuneState) -> str:
    also_keys = [k for k, _ in state.args["also"]]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        [
            "point",
            "label",
            "tp",
            "cp",
            "pp",
            "dp",
            *also_keys,
            "estimate_gb",
            "verdict",
            "round",
            "steps",
            "status",
            "value",
            "p25",
            "p75",
            "spread",
            "step_time_s",
            "steady_steps",
            "wall_s",
            "overhead_s",
            "source",
            "outcome",
            "cause",
            "run_dir",
        ]
    )
    for point in order_points(state):
        base = [
            point["id"],
            point["label"],
            *(point["sizes"][d] for d in ("tp", "cp", "pp", "dp")),
            *(point["also"].get(k, "") for k in also_keys),
            point["verdict"].get("estimate_gb") or "",
            point["verdict"]["status"],
        ]
        outcome = outcome_of(state, point["id"])
        ms = sorted(
            (Measurement.from_json(d) for d in state.measurements if d["trial"] == point["id"]),
            key=lambda m: m.round,
        )
        for m in ms:
            writer.writerow(
                [
                    *base,
                    m.round,
                    m.steps,
                    m.status,
                    *(
                        "" if v is None else v
                        for v in (m.value, m.p25, m.p75, m.spread, m.step_time)
                    ),
                    m.measured,
                    *("" if v is None else v for v in (m.wall_s, m.overhead_s)),
                    m.source,
                    outcome,
                    m.cause,
                    m.run_dir,
                ]
            )
        if not ms:
            writer.writerow([*base, *[""] * 12, outcome, point["verdict"]["message"], ""])
    return out.getvalue()


def write_best(state: TuneState) -> Path | None:
    """``best.yaml``: the winning layout, its overrides and the command line that runs it."""
    if state.winner is None:
        return None
    m = state.latest(state.winner)
    point = state.point(state.winner)
    data = {
        "metric": state.args["metric"],
        "value": None if m is None else m.value,
        "spread": None if m is None else [m.p25, m.p75],
        "round": None if m is None else m.round,
        "layout": {**point["sizes"], "world_size": point["world_size"]},
        "also": point["also"],
        "overrides": best_overrides(state),
        "command": best_command(state),
        "tune_dir": str(state.dir),
    }
    path = state.dir / files.TUNE_BEST
    atomic_write_text(
        path,
        f"# The fastest layout found by python -m wf_launch.tune ({files.TUNE_MD})\n"
        + yaml.safe_dump(data, sort_keys=False, width=1 << 16),
    )
    return path


def write_report(state: TuneState, chart: bool = True) -> dict[str, Path]:
    """Write the report files (atomically); returns their paths."""
    written = {"md": state.dir / files.TUNE_MD, "csv": state.dir / files.TUNE_CSV}
    atomic_write_text(written["md"], render_markdown(state))
    atomic_write_text(written["csv"], render_csv(state))
    best = write_best(state)
    if best is not None:
        written["best"] = best
    if chart and state.measurements:
        try:
            render_chart(state, state.dir / files.TUNE_CHART)
            written["png"] = state.dir / files.TUNE_CHART
        except ImportError:
            pass
    return written
