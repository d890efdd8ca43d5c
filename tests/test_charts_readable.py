"""The sweep's and the tuner's charts are readable: rendered, their text is measured (matplotlib's
window extents): no two texts overlap, none is cut by the figure's edge, every label is whole, and
each caption (the summary's, the chart's title) names the metric the chart actually draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chart_text import figure_texts, readability_faults
from matplotlib import pyplot as plt

from wf_launch.drivers.tune.chart import caption, chart_figure
from wf_launch.drivers.tune.measure import Measurement
from wf_launch.drivers.tune.space import build_space
from wf_launch.drivers.tune.state import TuneState
from wf_launch.rank.progress import ProgressReporter
from wf_launch.readers.sweep import collect_points, write_report
from wf_launch.readers.sweep.charts import bar_figure, scaling_figure, steps_figure
from wf_launch.rundir.record import RunRecord, Status

LONG = "engine.cp_size={cp} engine.pp_size={pp} task.micro_batches={mb} task.learning_rate=0.0003"


def _point(sweep: Path, job: int, cp: int, pp: int, mb: int, status: Status, metrics: bool) -> None:
    job_dir = sweep / str(job)
    (job_dir / "logs").mkdir(parents=True)
    world = cp * pp
    layout = {"tp": 1, "cp": cp, "pp": pp, "dp": 1, "order": "tp-cp-pp-dp", "world_size": world}
    RunRecord(
        status,
        run_dir=str(job_dir),
        layout=layout,
        final=True,
        overrides=LONG.format(cp=cp, pp=pp, mb=mb).split(),
        results={"0": {"loss_final": 0.5}} if status is Status.OK else {},
        timings={"wall_s": 1.0 + job},
    ).write()
    if metrics:
        rep = ProgressReporter(job_dir, 0)
        for step in range(12):
            rep(step, 12, loss=2.0 / (1 + step * (job + 1)))
        rep.close()


def _sweep(tmp_path: Path, n: int) -> list[dict]:
    statuses = [Status.OK, Status.FAILED, Status.OK, Status.INTERRUPTED]
    for job in range(n):
        cp, pp, mb = (1, 2, 4)[job % 3], (1, 2)[job % 2], (2, 4, 8)[job % 3]
        _point(tmp_path, job, cp, pp, mb, statuses[job % len(statuses)], metrics=True)
    return collect_points(tmp_path)


def _assert_readable(fig) -> list[str]:
    texts = figure_texts(fig)
    faults = readability_faults(fig)
    plt.close(fig)
    assert faults == []
    return texts


@pytest.mark.parametrize("n", [3, 12])
def test_the_bar_chart_is_readable_and_says_it_draws_wall_s(tmp_path: Path, n: int) -> None:
    fig, said = bar_figure(_sweep(tmp_path, n), "tokens_per_s")
    assert said == "wall_s per point (no point reported tokens_per_s)"
    assert fig.axes[0].get_ylabel() == "wall_s"
    texts = _assert_readable(fig)
    assert said in texts
    for job in range(n):  # every point's label is whole: its varying overrides, untruncated
        mb = (2, 4, 8)[job % 3]
        assert any(f"#{job} " in t and f"task.micro_batches={mb}" in t for t in texts), texts


def test_the_steps_legend_names_each_point_whole(tmp_path: Path) -> None:
    points = _sweep(tmp_path, 6)
    fig, said = steps_figure(points)
    assert said == "loss over steps, one line per point"
    texts = _assert_readable(fig)
    legend = [t for t in texts if t.startswith("job ")]
    assert len(legend) == 6
    for job, text in enumerate(legend):  # the overrides that set each point apart, none cut
        own = " ".join(o for o in LONG.split() if "learning_rate" not in o)
        cp, pp, mb = (1, 2, 4)[job % 3], (1, 2)[job % 2], (2, 4, 8)[job % 3]
        assert text.replace("\n", " ") == f"job {job}: " + own.format(cp=cp, pp=pp, mb=mb)


def test_the_scaling_chart_is_readable(tmp_path: Path) -> None:
    points = _sweep(tmp_path, 6)
    for p in points:
        p["metrics"]["tokens_per_s"] = 100.0 * (p["world"] or 1)
    fig, said = scaling_figure(points, "tokens_per_s")
    assert said == "tokens_per_s against world size"
    assert said in _assert_readable(fig)


def test_the_summary_captions_name_what_each_chart_draws(tmp_path: Path) -> None:
    points = _sweep(tmp_path, 4)
    written = write_report(tmp_path, points, "tokens_per_s")
    md = (tmp_path / "sweep_summary.md").read_text()
    assert "- `sweep_chart.png`: wall_s per point (no point reported tokens_per_s)\n" in md
    assert "- `sweep_steps.png`: loss over steps, one line per point\n" in md
    assert "Chart metric" not in md and {"png", "steps"} <= set(written)


def _tune_state(tmp_path: Path, world: int, mbs: list[str], measured: int) -> TuneState:
    points = build_space(world, [("task.micro_batches", mbs)])
    space = [
        {**p.to_json(), "verdict": {"status": "valid", "message": "", "estimate_gb": 0.3}}
        for p in points
    ]
    ids = [p["id"] for p in space[:measured]]
    rounds = [
        {"index": 0, "steps": 6, "trials": ids, "status": "done", "kept": ids[:2]},
        {"index": 1, "steps": 10, "trials": ids[:2], "status": "done", "kept": ids[:1]},
    ]
    ms = [
        Measurement(
            t,
            r["index"],
            "ok",
            value=4000.0 + 97 * i,
            p25=3800.0 + 97 * i,
            p75=4300.0 + 97 * i,
            measured=4,
        ).to_json()
        for r in rounds
        for i, t in enumerate(r["trials"])
    ]
    ms.append(Measurement(ids[-1], 0, "failed", cause="boom").to_json())
    args = {
        "metric": "tokens_per_s",
        "world_size": world,
        "also": [["task.micro_batches", mbs]],
        "overrides": ["task=train"],
    }
    return TuneState(
        tmp_path,
        args,
        space=space,
        rounds=rounds,
        measurements=json.loads(json.dumps(ms)),
        winner=ids[0],
    )


@pytest.mark.parametrize(("world", "mbs"), [(2, ["2", "4"]), (8, ["1", "2"])])
def test_the_tune_chart_is_readable(tmp_path: Path, world: int, mbs: list[str]) -> None:
    state = _tune_state(tmp_path, world, mbs, measured=8 if world == 2 else 26)
    fig = chart_figure(state)
    assert fig.axes[0].get_ylabel() == "tokens_per_s"
    texts = _assert_readable(fig)
    assert caption(state) in texts and caption(state).startswith("tokens_per_s per layout")
    labels = [t for t in texts if "micro_batches=" in t]
    assert len(labels) == len({m["trial"] for m in state.measurements})
    assert all(t.count("micro_batches=") == 1 for t in labels)  # one label each, whole
