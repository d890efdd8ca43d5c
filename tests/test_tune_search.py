"""The layout tuner end to end on ``task=clockwork``, whose step time is a known function of the
layout: the search finds the known best, failures / out-of-memory / stalls are recorded with their
cause and dropped, an interrupted tune resumes without rerunning finished trials."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_helpers import USER_TASKS, cli_env, leftover_processes, popen_argv, run_argv

sys.path.insert(0, str(USER_TASKS))
from wf_tune_tasks import layout_key, tokens_per_s

from wf_launch.drivers.tune.space import layouts

pytestmark = pytest.mark.slow
CLOCKWORK = ["task=clockwork", "task.modules=[wf_tune_tasks]"]
FAST = ["--warmup", "1", "--min-steps", "3", "--cutoff", "0", "--search", "halving"]
PNG = b"\x89PNG\r\n\x1a\n"


def tune_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "wf_launch.tune", *args]


def best_of(
    world: int, mbs: tuple[int, ...], exclude: set[str] = frozenset(), unit: float = 0.03
) -> str:
    """The layout key the known function ranks first among the valid, not excluded points."""
    scored = [
        (
            tokens_per_s(lay["tp"], lay["cp"], lay["pp"], lay["dp"], mb, unit),
            layout_key(lay["tp"], lay["cp"], lay["pp"], lay["dp"], mb),
        )
        for lay in layouts(world)
        for mb in mbs
        if 2 % lay["cp"] == 0 and lay["pp"] <= mb
    ]
    return max(s for s in scored if s[1] not in exclude)[1]


def key_of(point: dict) -> str:
    s = point["sizes"]
    return layout_key(s["tp"], s["cp"], s["pp"], s["dp"], int(point["also"]["task.micro_batches"]))


def test_search_finds_the_known_best_and_records_failures(tmp_path: Path) -> None:
    failing = {
        "raise_at": "tp2-cp1-pp1-dp1-mb1",
        "oom_at": "tp1-cp1-pp1-dp2-mb2",
        "stall_at": "tp1-cp2-pp1-dp1-mb2",
    }
    d = tmp_path / "tune"
    proc = run_argv(
        tune_cmd(
            [
                *CLOCKWORK,
                "world_size=2",
                "task.steps=20",
                "--also",
                "task.micro_batches=1,2",
                *FAST,
                "--stall-s",
                "3",
                "--dir",
                str(d),
                *(f"task.{k}=[{v}]" for k, v in failing.items()),
            ]
        ),
        capture_output=True,
        text=True,
        timeout=240,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = json.loads((d / "tune.json").read_text())
    by_key = {key_of(p): p for p in state["space"]}
    expected = best_of(2, (1, 2), set(failing.values()))
    assert state["winner"] == by_key[expected]["id"] and state["status"] == "done"
    assert [p["verdict"]["status"] for p in state["space"]].count(
        "invalid"
    ) == 1  # pp2 with one micro-batch
    assert [len(r["trials"]) for r in state["rounds"]] == [
        7,
        2,
    ]  # 4 measured in round 0: the better 2 go on

    r0 = {m["trial"]: m for m in state["measurements"] if m["round"] == 0}
    raised, oom, stalled = (
        r0[by_key[failing[k]]["id"]] for k in ("raise_at", "oom_at", "stall_at")
    )
    assert (
        raised["status"] == "failed"
        and "ValueError: clockwork: layout tp2-cp1-pp1-dp1-mb1 refuses" in raised["cause"]
    )
    assert oom["status"] == "oom" and "MemoryError" in oom["cause"]
    assert stalled["status"] == "stalled" and "no progress for 3 s" in stalled["cause"]
    assert (
        "wf_tune_tasks.py" in stalled["cause"] and "time.sleep(3600)" in stalled["cause"]
    )  # where its ranks were
    for m in r0.values():
        if m["status"] == "ok":
            key = next(k for k, p in by_key.items() if p["id"] == m["trial"])
            truth = tokens_per_s(*(int(key.split("-")[i][2:]) for i in range(5)))
            # the known function, measured: its steps are sleeps, which a loaded machine only
            # lengthens (a CI run beside other tests measured 0.64 of it), never shortens
            assert truth * 0.5 <= m["value"] <= truth * 1.1, (key, m)

    md = (d / "tune_report.md").read_text()
    assert f"**Winner: {by_key[expected]['label']}**" in md and md.count("\n| t0") == 8
    for word in (
        "refuses at step 2",
        "oom in round 0",
        "stalled in round 0",
        "pruned (invalid)",
        "dropped after round",
    ):
        assert word in md, word
    assert (d / "tune_chart.png").read_bytes().startswith(PNG)
    assert (
        len((d / "tune_report.csv").read_text().splitlines()) == 1 + 7 + 2 + 1
    )  # a row per measurement, pruned

    best = yaml.safe_load((d / "best.yaml").read_text())
    assert best["layout"] == {**by_key[expected]["sizes"], "world_size": 2}
    command = shlex.split(best["command"])
    assert command[:3] == ["python", "-m", "wf_launch"] and command[3:] == best["overrides"]
    run = run_argv(
        [sys.executable, *command[1:], f"hydra.run.dir={tmp_path / 'best'}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr  # best.yaml's command runs the winner
    ran = json.loads((tmp_path / "best" / "result.json").read_text())
    assert {k: ran["layout"][k] for k in ("tp", "cp", "pp", "dp")} == by_key[expected]["sizes"]
    assert leftover_processes(str(d)) == []


def _measured(d: Path) -> int:
    try:
        state = json.loads((d / "tune.json").read_text())
    except (OSError, ValueError):
        return 0
    return sum(m["status"] == "ok" for m in state["measurements"])


def test_interrupted_tune_resumes_without_rerunning_finished_trials(tmp_path: Path) -> None:
    d = tmp_path / "tune"
    args = [
        *CLOCKWORK,
        "world_size=2",
        "task.steps=20",
        "task.unit_s=0.05",
        "--also",
        "task.micro_batches=1,2",
        "--warmup",
        "1",
        "--min-steps",
        "3",
        "--search",
        "halving",
        "--dir",
        str(d),
    ]
    proc = popen_argv(
        tune_cmd(args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while _measured(d) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert f"python -m wf_launch.tune --resume {d}" in out
    state = json.loads((d / "tune.json").read_text())
    assert state["status"] == "interrupted" and state["rounds"][0]["status"] == "interrupted"
    done = {m["trial"]: m["run_dir"] for m in state["measurements"] if m["status"] == "ok"}
    assert len(done) >= 2
    stamps = {
        t: json.loads((Path(r) / "result.json").read_text())["finished_at"] for t, r in done.items()
    }

    resumed = run_argv(
        tune_cmd(["--resume", str(d)]),
        capture_output=True,
        text=True,
        timeout=240,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"{len(done)} of 7 trial(s) measured before are kept" in resumed.stdout
    for trial, run_dir in done.items():  # not rerun: the same record, one attempt
        record = json.loads((Path(run_dir) / "result.json").read_text())
        assert record["finished_at"] == stamps[trial] and len(record.get("attempts", [])) <= 1
    state = json.loads((d / "tune.json").read_text())
    assert state["status"] == "done" and state["sessions"] == 2
    round0 = sorted(p.name for p in (d / "rounds" / "r0").iterdir() if p.name.isdigit())
    assert len(round0) == 7  # every valid trial once in round 0's sweep
    winner = next(p for p in state["space"] if p["id"] == state["winner"])
    assert key_of(winner) == best_of(2, (1, 2), unit=0.05)

    again = run_argv(
        tune_cmd(["--resume", str(d)]),
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert again.returncode == 0 and "has finished; nothing to resume" in again.stdout
    other = run_argv(
        tune_cmd(["--resume", str(d), *CLOCKWORK, "world_size=4"]),
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert (
        other.returncode == 2
        and "holds another tune" in other.stderr
        and "world_size: 2" in other.stderr
    )
    assert leftover_processes(str(d)) == []


def test_a_task_without_a_metric_is_refused_after_its_first_trial(tmp_path: Path) -> None:
    d = tmp_path / "tune"
    proc = run_argv(
        tune_cmd([*CLOCKWORK, "world_size=4", "task.report=false", *FAST, "--dir", str(d)]),
        capture_output=True,
        text=True,
        timeout=120,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "the task has no metric to tune" in proc.stderr and "neither 'tokens_per_s'" in proc.stderr
    )
    assert "--metric step_time" in proc.stderr
    state = json.loads((d / "tune.json").read_text())
    assert state["status"] == "failed" and len(state["rounds"][0]["trials"]) == 5
    started = [p for p in (d / "rounds" / "r0").iterdir() if p.name.isdigit()]
    assert len(started) < 5  # stopped at the first trial that measured nothing, not after the round


def test_budget_cuts_the_search_and_the_best_measured_wins(tmp_path: Path) -> None:
    d = tmp_path / "tune"
    t0 = time.monotonic()
    # Steps of 0.75 s and more (sleeps: the same on a loaded machine) make round 0's 13 trials take
    # over 60 s anywhere, so the 30 s budget cuts it; its first trial ends within the budget even
    # on a machine loaded enough to take 20 s to start four ranks.
    proc = run_argv(
        tune_cmd(
            [
                *CLOCKWORK,
                "world_size=4",
                "task.steps=30",
                "task.unit_s=0.5",
                "--also",
                "task.micro_batches=1,2",
                *FAST,
                "--budget-s",
                "30",
                "--dir",
                str(d),
            ]
        ),
        capture_output=True,
        text=True,
        timeout=240,
        env=cli_env(),
        cwd=tmp_path,
    )
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "winner (--budget-s spent):" in proc.stdout
    state = json.loads((d / "tune.json").read_text())
    assert state["status"] == "budget" and state["rounds"][-1]["status"] == "budget"
    measured = [m for m in state["measurements"] if m["status"] == "ok"]
    unmeasured = [m for m in state["measurements"] if m["round"] == 0 and m["status"] != "ok"]
    assert measured and unmeasured  # cut in round 0, with some of its 13 trials measured
    best = max(measured, key=lambda m: m["value"])
    assert state["winner"] == best["trial"]
    assert "not measured in round 0: --budget-s spent" in (d / "tune_report.md").read_text()
    assert wall < 30 + 30  # stopped once the budget was spent (plus stopping and the report)
