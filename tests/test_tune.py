"""The layout tuner without starting ranks: the space, selection, measurement, pruning counts and
the bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import USER_TASKS, cli_env, run_python_m

sys.path.insert(0, str(USER_TASKS))
from wf_tune_tasks import layout_key, memory_gb, tokens_per_s

from wf_launch.drivers.tune.cli import main as tune_main
from wf_launch.drivers.tune.measure import Measurement, measure_point
from wf_launch.drivers.tune.plan import EXHAUSTIVE, HALVING, choose
from wf_launch.drivers.tune.report import render_markdown
from wf_launch.drivers.tune.search import Options, pick_winner, round_steps, select, tie_group
from wf_launch.drivers.tune.space import (
    TuneError,
    build_space,
    layouts,
    parse_also,
    split_command,
)
from wf_launch.drivers.tune.state import TuneState
from wf_launch.rundir.record import RunRecord, Status

CLOCKWORK = ["task=clockwork", "task.modules=[wf_tune_tasks]"]


def tune(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_python_m(
        "wf_launch.tune",
        [*args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=cwd,
    )


# ------------------------------------------------------------------ space and selection
@pytest.mark.parametrize("world", [1, 4, 8, 12])
def test_layouts_are_every_factorisation_once(world: int) -> None:
    found = layouts(world)
    assert all(d["tp"] * d["cp"] * d["pp"] * d["dp"] == world for d in found)
    assert len({tuple(d.values()) for d in found}) == len(found)
    brute = [
        (a, b, c, d)
        for a in range(1, world + 1)
        for b in range(1, world + 1)
        for c in range(1, world + 1)
        for d in range(1, world + 1)
        if a * b * c * d == world
    ]
    assert len(found) == len(brute)


def test_space_is_layouts_times_also_values() -> None:
    axes = parse_also(["task.micro_batches=1,2,4", "task.batch=range(1,3)"])
    assert axes == [("task.micro_batches", ["1", "2", "4"]), ("task.batch", ["1", "2"])]
    points = build_space(8, axes)
    assert len(points) == 20 * 3 * 2 and len({p.id for p in points}) == len(points)
    p = points[5]
    assert p.overrides()[:4] == [f"engine.{d}_size={p.layout[d]}" for d in ("tp", "cp", "pp", "dp")]
    assert (
        p.label.endswith("micro_batches=4 batch=2")
        and p.id == "t05-tp1-cp1-pp1-dp8-micro_batches4-batch2"
    )


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The tuner's CLI in this process (the slow tests run ``python -m wf_launch.tune``) on input
    it must refuse with exit code 2; what it printed on stderr."""
    code = tune_main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    return err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["task=train"], "world_size=N is required"),
        (["task=train", "world_size=0"], "world_size=0 is not allowed"),
        (["task=train", "world_size=8", "engine.pp_size=2"], "fixes a size the tuner must choose"),
        (
            ["task=train", "world_size=8", "hydra.sweep.dir=x"],
            "the tuner sets hydra.sweep.dir itself",
        ),
        (["task=train", "world_size=8", "task.steps=1,2"], "the full length of a run"),
    ],
)
def test_command_line_checks(args: list[str], message: str) -> None:
    with pytest.raises(TuneError, match=message):
        split_command(args, "steps")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("engine.cp_size=1,2", "chooses engine.cp_size itself"),
        ("task.micro_batches", "expected KEY=V1,V2"),
        ("task.x=interval(0,1)", "only discrete values"),
        ("task.x=1,1", "a value is given twice"),
    ],
)
def test_also_checks(spec: str, message: str) -> None:
    with pytest.raises(TuneError, match=message):
        parse_also([spec])


def _m(trial: str, value: float, spread: float = 0.0, status: str = "ok") -> Measurement:
    return Measurement(
        trial, 0, status, value=value, p25=value * (1 - spread), p75=value * (1 + spread)
    )


def test_select_keeps_the_better_half_less_the_clearly_worse() -> None:
    ms = [
        _m("a", 100),
        _m("b", 95),
        _m("c", 60, 0.05),
        _m("d", 50),
        _m("e", 10),
        _m("g", 5),
        _m("f", 0, status="failed"),
    ]
    kept, dropped = select(ms, "tokens_per_s", cutoff=0.3)
    assert kept == ["a", "b"] and set(dropped) == {
        "c",
        "d",
        "e",
        "g",
    }  # the failed one is not ranked at all
    assert "more than 30% below" in dropped["c"] and "worse half" in dropped["d"]
    kept, _ = select(
        [_m("a", 100), _m("b", 72, 0.05), _m("c", 50), _m("d", 40)], "tokens_per_s", cutoff=0.3
    )
    assert kept == ["a", "b"]  # 72 +5% = 75.6 is within 30% of 100: its spread counts in its favour
    kept, _ = select([_m("a", 1.0), _m("b", 2.0), _m("c", 1.2)], "step_time", cutoff=0.0)
    assert kept == ["a"]  # step time: lower is better; 3 // 2 = 1 kept


def test_round_lengths_double_and_stop_at_full_length() -> None:
    opts = Options(warmup=2, min_steps=4)
    assert [round_steps(r, opts, 40) for r in range(5)] == [6, 10, 18, 34, 40]


def test_measurement_from_progress_timestamps(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    lines = []
    for step, t in enumerate([10.0, 10.5, 10.7, 10.9, 11.2, 11.4], start=1):
        lines += [json.dumps({"rank": r, "step": step, "time": t - 0.01 * r}) for r in (1, 0)]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    RunRecord(
        Status.OK,
        run_dir=str(run),
        final=True,
        results={"0": {"tokens_per_step": 100}},
        timings={"wall_s": 3.0},
        layout={"tp": 1, "cp": 1, "pp": 1, "dp": 2},
    ).write()
    m = measure_point(
        run, "t00", 0, "tokens_per_s", warmup=2, steps=6, sizes={"tp": 1, "cp": 1, "pp": 1, "dp": 2}
    )
    assert m.status == "ok" and m.measured == 4  # steps 3..6; steps 1 and 2 are the warm-up
    assert m.step_time == pytest.approx(0.2) and m.value == pytest.approx(500.0)
    assert m.p25 <= m.value <= m.p75 and m.overhead_s == pytest.approx(3.0 - 6 * 0.2)
    wrong = measure_point(
        run, "t00", 0, "tokens_per_s", 2, 6, sizes={"tp": 1, "cp": 2, "pp": 1, "dp": 1}
    )
    assert wrong.status == "failed" and "not its layout tp1 cp2 pp1 dp1" in wrong.cause
    none = measure_point(run, "t00", 0, "loss", 2, 6)
    assert none.status == "no_metric" and "'loss'" in none.cause


# ------------------------------------------------------------------ pruning, through the real CLI
def test_dry_run_prunes_by_validation_and_memory_exactly(tmp_path: Path) -> None:
    proc = tune(
        [
            *CLOCKWORK,
            "world_size=4",
            "--also",
            "task.micro_batches=1,2",
            "--mem-gb",
            "4",
            "--dry-run",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    expect = {"invalid": 0, "memory": 0, "valid": 0}
    for point in build_space(4, [("task.micro_batches", ["1", "2"])]):
        lay, mb = point.layout, int(point.also[0][1])
        if 2 % lay["cp"] or lay["pp"] > mb:
            expect["invalid"] += 1
        elif memory_gb(lay["tp"], lay["cp"], lay["pp"], lay["dp"], mb) > 4:
            expect["memory"] += 1
        else:
            expect["valid"] += 1
    assert expect == {"invalid": 7, "memory": 3, "valid": 10}
    out = proc.stdout
    assert (
        f"pruned by validation: {expect['invalid']}\n" in out
        and f"pruned by memory: {expect['memory']} " in out
    )
    assert f"to measure: {expect['valid']}\n" in out
    assert "search: exhaustive, the space is small: successive halving would run 17 trial(s)" in out
    assert "rounds (at most): 10 -> 1; trials of 20 steps (full length 20)" in out
    assert "engine.cp_size=4 is not allowed: must divide task.seq=2" in out
    assert "estimated 4.5 GB per rank > --mem-gb 4" in out
    assert not (tmp_path / "tunes").exists()  # a dry run writes nothing


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["world_size=4", "engine.dp_size=2"],
            "'engine.dp_size=2' fixes a size the tuner must choose",
        ),
        (
            ["world_size=4", "--mem-gb", "0.1"],
            "--mem-gb 0.1 prunes every valid layout (5): the smallest estimate is "
            "1.5 GB per rank (tp1 cp2 pp1 dp2)",
        ),
        (
            ["world_size=3", "launcher=slurm", "launcher.nodes=2"],
            "world_size=3: no layout fits: all 4 point(s) were refused by validation",
        ),
        (
            ["world_size=4", "--also", "task.micro_batches=1,2", "task.micro_batches=2"],
            "give the values to search in --also only",
        ),
        (["world_size=4", "task.steps=2"], "leaves fewer than 2 steps to time after --warmup 2"),
        (
            ["world_size=4", "--also", "task.nosuch=1,2"],
            "--also task.nosuch=1,2: task=clockwork has no field 'nosuch' (its fields: ",
        ),
        (
            ["world_size=4", "--also", "task.unit=1,2"],
            "; did you mean unit_s?",
        ),
        (
            ["world_size=4", "--cutoff", "1.5"],
            "--cutoff 1.5 is not allowed: expected a fraction in [0, 1)",
        ),
    ],
)
def test_bad_input_exits_2_with_the_reason(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused([*CLOCKWORK, *args, "--dir", str(tmp_path / "t")], capsys)
    assert message in err and "+task." not in err  # never Hydra's append advice
    assert not (tmp_path / "t").exists()


def test_a_task_without_a_steps_field_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    err = refused(["task=noop", "world_size=2"], capsys)
    assert "task=noop has no integer field 'steps'" in err
    assert list(tmp_path.iterdir()) == []


def test_resume_refuses_another_tunes_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other"
    state = TuneState(
        other,
        {
            "world_size": 2,
            "overrides": CLOCKWORK,
            "also": [],
            "mem_gb": None,
            "metric": "tokens_per_s",
            "warmup": 2,
            "min_steps": 4,
            "cutoff": 0.3,
            "steps_field": "steps",
        },
        full_length=8,
        space=[p.to_json() | {"verdict": {"status": "valid"}} for p in build_space(2, [])],
    )
    other.mkdir()
    state.save()
    err = refused(["--resume", str(other), *CLOCKWORK, "world_size=4"], capsys)
    assert "holds another tune" in err and "world_size: 2 in" in err and "4 now" in err
    assert "not a tune directory (no tune.json" in refused(["--resume", str(tmp_path)], capsys)


def test_known_function_has_a_clear_best() -> None:
    """The tests' task ranks its layouts by construction (guards the other tests' expectations)."""
    values = sorted(
        (
            tokens_per_s(lay["tp"], lay["cp"], lay["pp"], lay["dp"], mb),
            layout_key(lay["tp"], lay["cp"], lay["pp"], lay["dp"], mb),
        )
        for lay in layouts(2)
        for mb in (1, 2)
    )
    assert values[-1][1] == "tp1-cp1-pp1-dp2-mb2" and values[-1][0] > 1.1 * values[-2][0]


def test_state_round_trips_and_counts_time_over_sessions(tmp_path: Path) -> None:
    args = {"world_size": 2, "overrides": [], "also": [], "mem_gb": None, "metric": "tokens_per_s"}
    args |= {"warmup": 2, "min_steps": 4, "cutoff": 0.3, "steps_field": "steps"}
    state = TuneState(tmp_path, args, full_length=8)
    state.space = [p.to_json() | {"verdict": {"status": "valid"}} for p in build_space(2, [])]
    state.rounds = [{"index": 0, "steps": 6, "trials": [state.space[0]["id"]], "status": "done"}]
    state.add(_m("t00-tp1-cp1-pp1-dp2", 5.0))
    time.sleep(0.05)
    state.save()
    again = TuneState.load(tmp_path)
    assert again.sessions == 2 and again.elapsed() >= state.elapsed_s >= 0.05
    assert again.latest("t00-tp1-cp1-pp1-dp2").value == 5.0


def test_round_command_runs_private_ray_trials_one_after_another(tmp_path: Path) -> None:
    """A private Ray instance shares this machine's cores: its trials go one by one; a cluster's
    side by side."""
    from wf_launch.drivers.tune.rounds import sweep_argv

    private = sweep_argv(
        tmp_path, 0, ["t0", "t1"], 6, ["task=train", "launcher=ray"], "steps", "ray"
    )
    cluster = sweep_argv(
        tmp_path,
        0,
        ["t0", "t1"],
        6,
        ["task=train", "launcher=ray", "launcher.address=h:6379"],
        "steps",
        "ray",
    )
    local = sweep_argv(tmp_path, 0, ["t0", "t1"], 6, ["task=train"], "steps", "local")
    assert "hydra/launcher=basic" in private
    assert "hydra/launcher=basic" not in cluster and "hydra/launcher=basic" not in local


# ------------------------------------------------------------------ search plan, ties, cost
def test_a_small_space_is_measured_exhaustively_a_large_one_by_halving() -> None:
    small = choose(8, warmup=2, min_steps=4, full=20)  # issue 30: train, 2 ranks, 2 micro-batches
    assert small.search == EXHAUSTIVE and small.rounds == [(8, 6), (4, 10), (2, 18)]
    assert small.exhaustive_cost() < small.halving_cost()
    assert small.why().startswith("exhaustive, the space is small: successive halving would run 14")
    large = choose(26, warmup=2, min_steps=4, full=80)  # docs/tune.md: train, 8 ranks
    assert large.search == HALVING and large.halving_cost() < large.exhaustive_cost()
    assert choose(8, 2, 4, 20, launch_steps=0).search == HALVING  # free launches: halving saves
    assert choose(26, 2, 4, 80, asked=EXHAUSTIVE).search == EXHAUSTIVE


def test_a_tie_within_noise_goes_to_the_simpler_layout() -> None:
    points = {
        "pp2": {"sizes": {"tp": 1, "cp": 1, "pp": 2, "dp": 1}},
        "dp2": {"sizes": {"tp": 1, "cp": 1, "pp": 1, "dp": 2}},
        "tp2": {"sizes": {"tp": 2, "cp": 1, "pp": 1, "dp": 1}},
    }
    ranked = [_m("pp2", 4572, 0.30), _m("dp2", 4335, 0.06), _m("tp2", 2000, 0.05)]
    assert [m.trial for m in tie_group(ranked)] == ["pp2", "dp2"]  # issue 30's noise-level margin
    assert pick_winner(ranked, points.__getitem__) == ("dp2", ["pp2", "dp2"])
    clear = [_m("pp2", 7112, 0.12), _m("dp2", 5565, 0.05)]
    assert pick_winner(clear, points.__getitem__) == ("pp2", ["pp2"])  # apart: the best wins


def _state(
    tmp_path: Path, elapsed: float, tie: list[str] | None, search: str = "auto"
) -> TuneState:
    space = [
        {**p.to_json(), "verdict": {"status": "valid", "message": "", "estimate_gb": None}}
        for p in build_space(2, [])
    ]
    ids = [p["id"] for p in space]
    plan = choose(len(ids), 2, 4, 20, asked=search)
    args = {
        "metric": "tokens_per_s",
        "world_size": 2,
        "also": [],
        "overrides": ["task=train"],
        "mem_gb": None,
        "warmup": 2,
        "plan": plan.to_json(),
    }
    rec = {
        "index": 0,
        "steps": 20,
        "trials": ids,
        "status": "done",
        "kept": ids[:1],
        "dropped": {t: f"{i} of 4" for i, t in enumerate(ids, 1) if i > 1},
    }
    if tie:
        rec["tie"] = tie
    state = TuneState(tmp_path, args, full_length=20, space=space, rounds=[rec], winner=ids[0])
    for i, t in enumerate(ids):
        m = _m(t, 1000.0 - 100 * i, 0.05)
        m.step_time, m.overhead_s = 0.1, 2.0  # a launch: 20 step times
        state.add(m)
    state.elapsed_s = elapsed
    return state


def test_the_report_states_its_cost_and_warns_when_it_cost_more(tmp_path: Path) -> None:
    cheap = render_markdown(_state(tmp_path, 10.0, None))  # every layout: 4 x (2 + 20 x 0.1) = 16 s
    assert "would have cost about 16 s" in cheap and "**0.62x**" in cheap
    assert "A launch cost about 20 step times here." in cheap and "Warning" not in cheap
    assert "- Search: exhaustive, the space is small" in cheap
    assert "measured at full length: 2 of 4" in cheap
    dear = _state(tmp_path, 32.0, None, HALVING)
    md = render_markdown(dear)
    assert "**2.00x**" in md
    assert "**Warning: this tune cost more than measuring every layout at full length**" in md
    md = render_markdown(_state(tmp_path, 17.0, None))
    assert "Measured exhaustively: the difference is the tuner's own start." in md
    assert "Warning" not in md
    tied = _state(tmp_path, 10.0, [dear.space[0]["id"], dear.space[1]["id"]])
    md = render_markdown(tied)
    assert "- Tie: tp1 cp1 pp1 dp2 (1000 ±5%), tp1 cp1 pp2 dp1 (900 ±5%) overlap" in md
    assert "tied with the winner in round 0" in md
