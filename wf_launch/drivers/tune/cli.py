"""``python -m wf_launch.tune task=train world_size=8 [OVERRIDES...] [--also KEY=V1,V2] [--mem-gb G]
...``

Finds the fastest valid layout for a task (docs/tune.md): the space is every
(tp, cp, pp, dp) whose product is ``world_size`` times the ``--also`` values; layouts
that validation refuses or whose memory estimate exceeds ``--mem-gb`` are pruned
without starting anything; the rest are measured by successive halving. Exit codes:
0 a winner was found, 1 no trial could be measured (every one failed), 2 bad input
(nothing started, or the task has no metric), 128 + signal when interrupted
(``--resume DIR`` continues).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

from ...config.redact import redact_overrides
from ...rundir import files
from ...rundir.claim import RunDirClaim, RunDirInUse, claim_tool_dir, private_umask, refuse_shared
from .measure import higher_is_better
from .plan import AUTO, EXHAUSTIVE, HALVING, LAUNCH_STEPS, Plan, choose
from .prune import (
    VALID,
    check_also_fields,
    check_conflicts,
    check_steps_field,
    compose,
    explain_empty,
    full_length,
    prune,
)
from .report import (
    best_command,
    cost_ratio,
    describe_measurement,
    full_length_cost,
    tie_line,
    write_report,
)
from .rounds import Interrupt
from .search import Options, Search
from .space import TuneError, build_space, parse_also, split_command
from .state import DONE, TuneState

__all__ = ["main"]

DEFAULTS = {
    "metric": "tokens_per_s",
    "warmup": 2,
    "min_steps": 4,
    "cutoff": 0.3,
    "steps_field": "steps",
    "stall_s": 120.0,
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m wf_launch.tune",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Find the fastest valid parallel layout for a task: every tp/cp/pp/dp whose "
        "product is "
        "world_size (times the --also values), pruned by validation and memory estimate without "
        "starting anything, then measured by successive halving. Writes tune_report.md/.csv, "
        "tune_chart.png and best.yaml to the tune directory.",
        epilog="examples:\n  python -m wf_launch.tune task=train world_size=8 task.steps=100 "
        "--also task.micro_batches=1,2\n  python -m wf_launch.tune task=train world_size=8 "
        "--mem-gb 40 "
        "--budget-s 600\n  python -m wf_launch.tune --resume tunes/2026-12-03/10-00-00",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="world_size=N and the Hydra overrides every trial gets (the task, "
        "its sizes, the launcher; not engine.*_size: the tuner chooses those)",
    )
    p.add_argument(
        "--also",
        action="append",
        default=None,
        metavar="KEY=V1,V2",
        help="another axis to search, e.g. task.micro_batches=1,2,4 (repeatable: every "
        "combination)",
    )
    p.add_argument(
        "--mem-gb",
        type=float,
        default=None,
        help="prune layouts whose estimated peak memory per rank "
        "(the task config's estimate_memory_gb) exceeds this",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop measuring after this many seconds: the best of the latest measurements wins",
    )
    p.add_argument(
        "--metric",
        default=None,
        help="what to maximise: a result field of the task (default "
        "tokens_per_s), or step_time (minimised)",
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="the tune directory (default tunes/DATE/TIME)"
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="DIR",
        help="continue the interrupted tune in DIR",
    )
    _measuring_options(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the space, what is pruned and the rounds; start nothing",
    )
    return p


def _measuring_options(p: argparse.ArgumentParser) -> None:
    """The options of how trials are measured and the search decides."""
    p.add_argument(
        "--warmup", type=int, default=None, help="steps of each trial not timed (default 2)"
    )
    p.add_argument(
        "--min-steps",
        type=int,
        default=None,
        help="steady steps timed in round 0; doubled each round (default 4)",
    )
    p.add_argument(
        "--cutoff",
        type=float,
        default=None,
        help="after each round also drop layouts more than this "
        "fraction below the round's best (default 0.3; 0: halving only)",
    )
    p.add_argument(
        "--stall-s",
        type=float,
        default=None,
        help="stop a trial whose ranks report no progress for this long (default 120)",
    )
    p.add_argument("--steps-field", default=None, help="the task's field of steps (default steps)")
    p.add_argument(
        "--search",
        choices=(AUTO, HALVING, EXHAUSTIVE),
        default=AUTO,
        help="successive halving, or every valid layout at full length (default auto: the one "
        "estimated cheaper; a small space is measured exhaustively)",
    )
    p.add_argument(
        "--launch-steps",
        type=float,
        default=None,
        help=f"what a trial's launch and end cost, in steps, for --search auto (default "
        f"{LAUNCH_STEPS:g}; the report gives the measured figure)",
    )


def _check_options(args: argparse.Namespace) -> None:
    checks = [
        ("--mem-gb", args.mem_gb, lambda v: v > 0, "a number of GB > 0"),
        ("--budget-s", args.budget_s, lambda v: v > 0, "seconds > 0"),
        ("--warmup", args.warmup, lambda v: 0 <= v <= 10_000, "an integer >= 0"),
        ("--min-steps", args.min_steps, lambda v: 1 <= v <= 1_000_000, "an integer >= 1"),
        ("--cutoff", args.cutoff, lambda v: 0 <= v < 1, "a fraction in [0, 1)"),
        ("--stall-s", args.stall_s, lambda v: v > 0, "seconds > 0"),
        ("--launch-steps", args.launch_steps, lambda v: 0 <= v <= 1e9, "a number of steps >= 0"),
    ]
    for name, value, ok, allowed in checks:
        if value is not None and (not math.isfinite(value) or not ok(value)):
            raise TuneError(f"{name} {value:g} is not allowed: expected {allowed}")
    if args.metric is not None and (not args.metric.isidentifier()):
        raise TuneError(
            f"--metric {args.metric!r} is not allowed: expected a result field name (tokens_per_s) "
            "or "
            "step_time"
        )


def _identity(args: argparse.Namespace) -> dict[str, Any]:
    """The tune's identity from the command line (defaults filled in)."""
    steps_field = args.steps_field or DEFAULTS["steps_field"]
    world, overrides = split_command(args.overrides, steps_field)
    axes = parse_also(args.also or [])
    check_conflicts(overrides, axes)
    return {
        "world_size": world,
        "overrides": overrides,
        "also": [[k, v] for k, v in axes],
        "mem_gb": args.mem_gb,
        "metric": args.metric or DEFAULTS["metric"],
        "warmup": DEFAULTS["warmup"] if args.warmup is None else args.warmup,
        "min_steps": args.min_steps or DEFAULTS["min_steps"],
        "cutoff": DEFAULTS["cutoff"] if args.cutoff is None else args.cutoff,
        "steps_field": steps_field,
    }


def _plan(ident: dict[str, Any], directory: Path) -> TuneState:
    """Compose, validate and prune the space; the state of a tune about to start. :class:`TuneError`
    on bad input."""
    axes = [(k, list(v)) for k, v in ident["also"]]
    points = build_space(ident["world_size"], axes)
    combos = sorted({p.also for p in points})
    check_also_fields(compose([ident["overrides"]])[0], axes)
    configs = dict(
        zip(combos, compose([[*ident["overrides"], *(f"{k}={v}" for k, v in c)] for c in combos]))
    )
    first = configs[combos[0]]
    check_steps_field(first, ident["steps_field"])
    full = full_length(first, ident["steps_field"])
    if full < ident["warmup"] + 2:
        raise TuneError(
            f"task.{ident['steps_field']}={full} (the full length of a run) leaves fewer than 2 "
            "steps to "
            f"time after --warmup {ident['warmup']}; give a longer task.{ident['steps_field']}"
        )
    verdicts = prune(points, configs, ident["mem_gb"])
    if not any(v.status == VALID for v in verdicts):
        raise TuneError(explain_empty(verdicts, ident["world_size"], ident["mem_gb"]))
    return TuneState(
        directory,
        ident,
        command=["python -m wf_launch.tune", *redact_overrides(sys.argv[1:])],
        full_length=full,
        launcher=str((first.get("launcher") or {}).get("name", "local")),
        space=[{**v.point.to_json(), "verdict": v.to_json()} for v in verdicts],
    )


def _holds_files(directory: Path) -> bool:
    """Whether ``directory`` holds anything but a tool's lock file."""
    return any(p.name != files.LOCK for p in directory.iterdir())


def _claim(args: argparse.Namespace, state: TuneState) -> RunDirClaim:
    """The tune directory, owner-only and locked for this tune; a second tune is refused."""
    option = "--resume" if args.resume is not None else "--dir"
    try:
        held = claim_tool_dir(state.dir, option)
    except RunDirInUse as exc:
        raise TuneError(str(exc)) from None
    if args.resume is None and _holds_files(state.dir):
        held.release()
        raise TuneError(f"--dir {state.dir}: not empty (another tune started there first)")
    return held


def _new(args: argparse.Namespace) -> TuneState:
    ident = _identity(args)
    directory = (
        args.dir or Path("tunes") / time.strftime("%Y-%m-%d") / time.strftime("%H-%M-%S")
    ).absolute()
    if not args.dry_run and directory.exists() and _holds_files(directory):
        raise TuneError(
            f"--dir {directory}: not empty (a tune directory holds one tune; --resume {directory} "
            "continues the one there)"
        )
    state = _plan(ident, directory)
    valid = sum(p["verdict"]["status"] == VALID for p in state.space)
    launch = LAUNCH_STEPS if args.launch_steps is None else args.launch_steps
    plan = choose(
        valid, ident["warmup"], ident["min_steps"], state.full_length, launch, args.search
    )
    state.args["plan"] = plan.to_json()
    state.args["settings"] = {
        "budget_s": args.budget_s,
        "stall_s": args.stall_s or DEFAULTS["stall_s"],
    }
    return state


def _resumed(args: argparse.Namespace) -> TuneState:
    if args.dir is not None and args.dir.absolute() != args.resume.absolute():
        raise TuneError(
            "--dir and --resume name different directories: --resume DIR continues the tune in DIR"
        )
    try:
        refuse_shared(args.resume.absolute(), "--resume", files.TUNE_STATE)
    except RunDirInUse as exc:
        raise TuneError(str(exc)) from None
    state = TuneState.load(args.resume.absolute())
    if args.overrides or args.also:
        wanted = _identity(args)
    else:
        wanted = dict(state.args)
        for key, value in (
            ("mem_gb", args.mem_gb),
            ("metric", args.metric),
            ("warmup", args.warmup),
            ("min_steps", args.min_steps),
            ("cutoff", args.cutoff),
            ("steps_field", args.steps_field),
        ):
            if value is not None:
                wanted[key] = value
    diff = state.differences(wanted)
    if diff:
        raise TuneError(
            f"--resume {args.resume}: that directory holds another tune; what differs:\n  "
            + "\n  ".join(diff)
        )
    settings = state.args.setdefault("settings", {})
    for key, value in (("budget_s", args.budget_s), ("stall_s", args.stall_s)):
        if value is not None:
            settings[key] = value
    return state


def _options(state: TuneState) -> Options:
    a, s = state.args, state.args.get("settings") or {}
    return Options(
        metric=a["metric"],
        warmup=a["warmup"],
        min_steps=a["min_steps"],
        cutoff=a["cutoff"],
        stall_s=s.get("stall_s") or DEFAULTS["stall_s"],
        budget_s=s.get("budget_s"),
        steps_field=a["steps_field"],
        exhaustive=(a.get("plan") or {}).get("search") == EXHAUSTIVE,
    )


def _print_plan(state: TuneState, opts: Options) -> None:
    valid = [p for p in state.space if p["verdict"]["status"] == VALID]
    counts = {
        s: sum(p["verdict"]["status"] == s for p in state.space) for s in ("invalid", "memory")
    }
    also = "".join(f" x {len(v)} value(s) of {k}" for k, v in state.args["also"])
    mem = state.args["mem_gb"]
    plan = Plan.from_json(state.args["plan"])
    rounds = [(len(valid), state.full_length)] if plan.exhaustive else plan.rounds
    flow = " -> ".join(str(n) for n, _ in rounds) + (" -> 1" if rounds[-1][0] > 1 else "")
    better = "max" if higher_is_better(opts.metric) else "min"
    print(
        f"space: {len(state.space)} point(s): the layouts of {state.args['world_size']} "
        f"rank(s){also}\npruned by validation: {counts['invalid']}\n"
        f"pruned by memory: {counts['memory']}"
        + (f" (--mem-gb {mem:g})" if mem is not None else " (no --mem-gb)")
        + f"\nto measure: {len(valid)}\nsearch: {plan.why()}\n"
        f"rounds (at most): {flow}; trials of {', '.join(str(s) for _, s in rounds)} steps "
        f"(full length {state.full_length}); metric {opts.metric} ({better})"
    )
    for p in state.space:
        v = p["verdict"]
        est = "" if v["estimate_gb"] is None else f" est {v['estimate_gb']:.3g} GB"
        print(
            f"  {p['id']:<40} {v['status']:<8}{est}" + (f"  {v['message']}" if v["message"] else "")
        )


def _summary(state: TuneState) -> None:
    if state.winner is None:
        return
    m = state.latest(state.winner)
    won = describe_measurement(m, state.args["metric"]) if m is not None else "not measured"
    cost, _ = full_length_cost(state)
    ratio = cost_ratio(state)
    vs = f"; every valid layout at full length: about {cost:.0f} s ({ratio:.2f}x)" if ratio else ""
    exhaustive = state.args.get("plan", {}).get("search") == EXHAUSTIVE
    warn = ""
    if ratio and ratio > 1 and not exhaustive:
        warn = "\nwarning: the tune cost more than every layout at full length"
    cut = " (--budget-s spent)" if state.status != DONE else ""
    tie = tie_line(state)
    print(
        f"winner{cut}: {state.point(state.winner)['label']}: {won}\n"
        + (f"{tie}\n" if tie else "")
        + f"time: {state.elapsed_s:.0f} s{vs}{warn}\n"
        f"report: {state.dir / files.TUNE_MD}\nbest:   {state.dir / files.TUNE_BEST}\n"
        f"run it: {best_command(state)}",
        flush=True,
    )


def _run(state: TuneState, interrupt: Interrupt) -> int:
    def on_round() -> None:
        state.save()
        write_report(state, chart=False)  # the chart (matplotlib: seconds) once, at the end

    state.status = "running"
    state.save()
    opts = _options(state)
    try:
        code = Search(
            state,
            opts,
            state.args["overrides"],
            interrupt,
            lambda line: print(line, flush=True),
            on_round,
        ).run()
    finally:
        state.save()
        write_report(state)
    if code == 0:
        _summary(state)
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    interrupt = Interrupt()
    try:
        _check_options(args)
        state = _resumed(args) if args.resume is not None else _new(args)
        if args.dry_run:
            _print_plan(state, _options(state))
            return 0
        if state.status == DONE:
            print(f"the tune in {state.dir} has finished; nothing to resume")
            _summary(state)
            return 0
        private_umask()
        with _claim(args, state):
            previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                return _run(state, interrupt)
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)
    except TuneError as exc:
        print(f"wf_launch.tune: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
