"""A tune's report: ``tune_report.md`` / ``.csv``, ``tune_chart.png`` and ``best.yaml`` in the tune directory.

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

from ...readers.sweep.tables import fmt
from ...rundir import files
from ...rundir.io import atomic_write_text
from .chart import render_chart
from .measure import STEP_TIME, Measurement, higher_is_better
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


def outcome_of(state: TuneState, trial: str) -> str:
    """How a point left the search: pruned, failed, dropped (and in which round), kept, or the winner."""
    point = state.point(trial)
    verdict = point["verdict"]
    if verdict["status"] != "valid":
        return f"pruned ({verdict['status']}): {verdict['message']}"
    if trial == state.winner:
        return "winner"
    for rec in reversed(state.rounds):
        if trial not in rec["trials"]:
            continue
        m = next((m for m in state.of_round(rec["index"]) if m.trial == trial), None)
        if m is not None and not m.ok and m.status != "not_run":
            return f"{m.status} in round {rec['index']}: {m.cause}"
        if trial in (rec.get("dropped") or {}):
            return f"dropped after round {rec['index']}: {rec['dropped'][trial]}"
        if rec.get("status") == "budget" and (m is None or not m.ok):
            return f"not measured in round {rec['index']}: --budget-s spent"
        if rec.get("status") != "done":
            return f"round {rec['index']}: {rec.get('status')}"
        return f"kept after round {rec['index']}"
    return "not measured"


def full_length_cost(state: TuneState) -> tuple[float, int]:
    """(seconds every valid layout would take at full length, layouts the estimate could not cover)."""
    total, missing = 0.0, 0
    for point in state.space:
        if point["verdict"]["status"] != "valid":
            continue
        first = next(
            (
                Measurement.from_json(d)
                for d in state.measurements
                if d["trial"] == point["id"] and d["round"] == 0
            ),
            None,
        )
        if first is not None and first.step_time is not None and first.overhead_s is not None:
            total += first.overhead_s + state.full_length * first.step_time
        elif (
            first is not None and first.wall_s is not None and first.status not in ("ok", "not_run")
        ):
            total += first.wall_s
        else:
            missing += 1
    return total, missing


def best_overrides(state: TuneState) -> list[str]:
    """The user's overrides plus the winner's sizes and ``--also`` values."""
    assert state.winner is not None
    return [*state.args["overrides"], *state.point(state.winner)["overrides"]]


def best_command(state: TuneState) -> str:
    return "python -m wf_launch " + " ".join(shlex.quote(o) for o in best_overrides(state))


def _header(state: TuneState) -> list[str]:
    args, metric = state.args, state.args["metric"]
    task = next(
        (o.split("=", 1)[1] for o in args["overrides"] if o.split("=", 1)[0] == "task"), "?"
    )
    lines = [f"# Layout tune: task={task}, world_size={args['world_size']}", ""]
    if state.winner is not None:
        m = state.latest(state.winner)
        won = (
            f"{_value(m)} {metric} (round {m.round}, {m.measured} steady steps)"
            if m
            else "no measurement"
        )
        lines += [
            f"**Winner: {state.point(state.winner)['label']}**: {won}. Run it (also in `{files.TUNE_BEST}`):",
            "",
            f"    {best_command(state)}",
            "",
        ]
    else:
        lines += [f"No winner yet (tune {state.status}).", ""]
    valid = [p for p in state.space if p["verdict"]["status"] == "valid"]
    pruned = {
        s: sum(p["verdict"]["status"] == s for p in state.space) for s in ("invalid", "memory")
    }
    also = "".join(f" × {len(v)} value(s) of {k}" for k, v in args["also"])
    flow = " → ".join(str(len(r["trials"])) for r in state.rounds) + (
        " → 1" if state.winner else ""
    )
    lines += [
        f"- Space: {len(state.space)} point(s) = the layouts of {args['world_size']} rank(s){also}.",
        f"- Pruned without starting anything: {pruned['invalid']} refused by validation, {pruned['memory']} "
        f"over --mem-gb {args['mem_gb']:g}."
        if args["mem_gb"] is not None
        else f"- Pruned without starting anything: {pruned['invalid']} refused by validation (no --mem-gb).",
        f"- Measured: {len(valid)} valid point(s); rounds {flow}; "
        f"{sum(len(r['trials']) for r in state.rounds)} trial(s) in all.",
        f"- Metric: `{metric}` ({'higher' if higher_is_better(metric) else 'lower'} is better), median over "
        f"each trial's steady steps ({args['warmup']} warm-up step(s) dropped); ± is half the interquartile "
        "range.",
    ]
    cost, missing = full_length_cost(state)
    if cost:
        ratio = state.elapsed_s / cost
        lines.append(
            f"- Time: {state.elapsed_s:.0f} s spent. Running every valid layout to full length "
            f"({state.full_length} steps) would have cost about {cost:.0f} s (from round 0: each trial's "
            f"launch and end, plus {state.full_length} × its steady step time"
            + (f"; {missing} layout(s) not measured" if missing else "")
            + f"): **{ratio:.2f}x**."
        )
    return [*lines, ""]


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
