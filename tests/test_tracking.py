"""Experiment trackers: the hub's rules (no step twice, no step back, replay, a failing tracker
switched off), the config group, and each library's own reader over a real run interrupted by kill
-9 and by SIGTERM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import cli_env, result, run_cli, run_python_m, start_cli

from wf_launch.config import ConfigError
from wf_launch.config.tracking import TrackingConfig, enabled_trackers
from wf_launch.rank.progress import ProgressReporter
from wf_launch.rank.trackers.base import Tracker, TrackerSettings, flat_params
from wf_launch.rank.trackers.hub import TrackerHub, read_state

TASKS = "task.modules=[wf_identity_tasks]"


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def warning(self, text: str) -> None:
        self.lines.append(("warning", text))

    def debug(self, text: str) -> None:
        self.lines.append(("debug", text))


class _Fake(Tracker):
    """Records what the hub hands it; ``held`` is what it says it already holds; ``fail_at`` its
    failing call."""

    def __init__(
        self, name: str, settings: TrackerSettings, held: int | None = None, fail_at: int = 0
    ) -> None:
        super().__init__(settings)
        self.name, self.held, self.fail_at = name, held, fail_at
        self.points: list[tuple[int, dict[str, float]]] = []
        self.calls = 0
        self.closed: str | None = None

    def open(self) -> int | None:
        return self.held

    def log(self, points: list[tuple[int, dict[str, float]]]) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise OSError(28, "No space left on device")
        self.points += points

    def close(self, status: str) -> None:
        self.closed = status


def _settings(run_dir: Path) -> TrackerSettings:
    return TrackerSettings(
        run_dir=run_dir, run_id="r1", rank=0, attempt=1, tagged=False, config={}, section={}
    )


def test_a_resumed_attempt_gets_neither_a_step_it_holds_nor_a_step_back_and_the_gap_is_replayed(
    tmp_path: Path,
) -> None:
    (tmp_path / "logs").mkdir()
    earlier = ProgressReporter(
        tmp_path, 0, publish_s=0.0
    )  # attempt 0 reached step 9 before a kill -9
    for step in range(1, 10):
        earlier(step, 20, loss=float(step))
    earlier.close()
    mlflow_like, tb_like = (
        _Fake("exact", _settings(tmp_path), held=9),
        _Fake("lagging", _settings(tmp_path), held=3),
    )
    hub = TrackerHub([mlflow_like, tb_like], tmp_path, 0, _Log(), flush_s=0.05)
    reporter = ProgressReporter(tmp_path, 0, publish_s=0.0, sink=hub)
    for step in range(7, 13):  # resumed from the checkpoint of step 6: steps 7-9 run again
        reporter(step, 20, loss=100.0 + step)
        reporter(step, 20, acc=0.5)  # a second call at the same step: one point with both metrics
    reporter.close("ok")
    assert [s for s, _ in mlflow_like.points] == [10, 11, 12]
    assert [s for s, _ in tb_like.points] == [
        4,
        5,
        6,
        7,
        8,
        9,
        10,
        11,
        12,
    ]  # 4-6 replayed from metrics.jsonl
    assert tb_like.points[0] == (4, {"loss": 4.0}) and tb_like.points[3] == (
        7,
        {"loss": 107.0, "acc": 0.5},
    )
    assert mlflow_like.closed == tb_like.closed == "ok"
    state = read_state(tmp_path, "lagging", 0)
    assert state["last_step"] == 12 and state["status"] == "ok" and state["attempt"] == 1


def test_a_failing_tracker_is_switched_off_with_one_warning_and_the_others_go_on(
    tmp_path: Path,
) -> None:
    (tmp_path / "logs").mkdir()
    log = _Log()
    broken, fine = (
        _Fake("broken", _settings(tmp_path), fail_at=2),
        _Fake("fine", _settings(tmp_path)),
    )
    hub = TrackerHub([broken, fine], tmp_path, 0, log, flush_s=0.02)
    reporter = ProgressReporter(tmp_path, 0, publish_s=0.0, sink=hub)
    for step in range(1, 31):
        reporter(step, 30, loss=1.0 / step)
        time.sleep(0.005)
    reporter.close("ok")
    warnings = [text for kind, text in log.lines if kind == "warning"]
    assert len(warnings) == 1 and "tracker broken failed to log (OSError" in warnings[0], warnings
    assert "the run goes on" in warnings[0] and "metrics.jsonl keeps every metric" in warnings[0]
    assert (
        [s for s, _ in fine.points] == list(range(1, 31))
        and fine.closed == "ok"
        and broken.closed is None
    )
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 31))


def test_a_tracker_stuck_on_a_dead_server_never_holds_up_the_rank(tmp_path: Path) -> None:
    class Stuck(_Fake):
        def log(self, points: list[tuple[int, dict[str, float]]]) -> None:
            time.sleep(30)

    (tmp_path / "logs").mkdir()
    log = _Log()
    hub = TrackerHub(
        [Stuck("stuck", _settings(tmp_path))], tmp_path, 0, log, flush_s=0.01, close_timeout_s=0.5
    )
    reporter = ProgressReporter(tmp_path, 0, publish_s=0.0, sink=hub)
    t0 = time.monotonic()
    for step in range(1, 2001):
        reporter(step, 2000, loss=1.0)
    reporter.close("ok")
    assert time.monotonic() - t0 < 10
    assert any("still writing after tracking.close_timeout_s=0.5" in text for _, text in log.lines)


def test_the_config_becomes_flat_hyperparameters() -> None:
    params = flat_params(
        {"engine": {"cp_size": 2, "order": "tp-cp-pp-dp"}, "task": {"patch": [1, 2, 2], "x": None}}
    )
    assert params == {
        "engine.cp_size": 2,
        "engine.order": "tp-cp-pp-dp",
        "task.patch": "[1, 2, 2]",
        "task.x": "null",
    }


def test_tracking_config_values_are_checked() -> None:
    assert enabled_trackers(TrackingConfig.from_dict(None)) == []
    on = TrackingConfig.from_dict(
        {"tensorboard": {"enabled": True}, "wandb": {"enabled": True, "mode": "offline"}}
    )
    assert enabled_trackers(on) == ["tensorboard", "wandb"]
    for section, needle in [
        ({"flush_s": 0}, "tracking.flush_s=0 is not allowed"),
        ({"wandb": {"enabled": True, "mode": "sometimes"}}, "tracking.wandb.mode='sometimes'"),
        ({"mlflow": {"enabled": True, "experiment": ""}}, "tracking.mlflow.experiment=''"),
        ({"wandb": {"projct": "x"}}, "did you mean tracking.wandb.project?"),
        ({"all_ranks": "yes"}, "tracking.all_ranks='yes' is not allowed: expected true or false"),
    ]:
        with pytest.raises(ConfigError, match=None) as info:
            TrackingConfig.from_dict(section)
        assert needle in str(info.value), str(info.value)


def test_a_tracker_whose_library_is_missing_is_refused_with_the_install_command(
    tmp_path: Path,
) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'wandb' or name.startswith('wandb.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Hide())\n"
    )
    env = cli_env({"PYTHONPATH": f"{hide}{os.pathsep}{cli_env()['PYTHONPATH']}"})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "tracking=[tensorboard,wandb]",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert (
        "wf_launch: config error: tracking='wandb' is not allowed: the wandb library is not "
        "installed in this "
        "environment; install it with: pip install 'worldfoundry-launch[wandb]'"
    ) in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()


# ------------------------------------------------------------------ end to end, read back with each
# library's reader
def _drill(
    args: list[str], directory: Path, env: dict[str, str], timeout: float = 400
) -> subprocess.CompletedProcess:
    return run_python_m(
        "wf_launch.drill",
        [*args, "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=directory.parent,
    )


def _tensorboard(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def _texts(acc: Any, tag: str) -> list[str]:
    return [
        b"".join(e.tensor_proto.string_val).decode() for e in acc.Tensors(f"{tag}/text_summary")
    ]


def _session_status(acc: Any) -> int:
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    data = HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_end_info"]
    )
    return data.session_end_info.status


def _wandb_records(run: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_every_tracker_continues_one_run_across_a_kill9_restart_and_a_sigterm_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of rank 0 (its trackers lose what they had not flushed) at step 5, then SIGTERM to
    the launcher at step 7 and a relaunch with launcher.resume=true: TensorBoard, MLflow and W&B
    each hold one curve, steps 1-10 once each and in order, equal to the run's loss curve, under the
    run's one id."""
    directory = tmp_path / "drill"
    env = cli_env({"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    proc = _drill(
        [
            "task=train",
            "engine.dp_size=2",
            "task.steps=10",
            "task.checkpoint_every=2",
            "task.step_sleep_s=0.15",
            "tracking=[tensorboard,mlflow,wandb]",
            "--inject",
            "kill9:0@5,sigterm@7",
        ],
        directory,
        env,
    )
    assert proc.returncode == 0 and "drill verdict: IDENTICAL" in proc.stdout, (
        proc.stdout + proc.stderr
    )
    run = directory / "interrupted"
    run_id = (run / "run_id").read_text().strip()
    record = result(run)
    assert record["run_id"] == run_id != result(directory / "reference")["run_id"]
    assert [a["cause"] for a in record["attempts"]] == [
        "launch",
        "rank 0 killed by SIGKILL",
        "stop flag: SIGTERM",
    ]
    curve = record["results"]["0"]["loss_curve"]
    steps = list(range(1, 11))
    assert len(curve) == 10

    board = _tensorboard(run / "tensorboard")
    assert [e.step for e in board.Scalars("loss")] == steps
    assert [e.value for e in board.Scalars("loss")] == pytest.approx(
        curve, rel=1e-6
    )  # float32 in event files
    assert (
        set(_texts(board, "wf_launch/run_id")) == {run_id}
        and _texts(board, "wf_launch/status")[-1] == "ok"
    )
    assert _session_status(board) == 1  # STATUS_SUCCESS

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores behind it
    client = MlflowClient(tracking_uri=(directory / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("wf_launch")
    found = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`wf_launch.run_id` = '{run_id}'"
    )
    assert len(found) == 1, "every attempt must continue the one MLflow run"
    history = client.get_metric_history(found[0].info.run_id, "loss")
    assert [m.step for m in history] == steps and [m.value for m in history] == pytest.approx(
        curve, rel=1e-9
    )
    assert found[0].info.status == "FINISHED" and found[0].data.params["task.steps"] == "10"
    assert found[0].data.tags["wf_launch.status"] == "ok"

    offline = sorted((run / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(offline) == 3, offline  # one per attempt, all of the run's id
    rows, last = [], []
    for (
        attempt_dir
    ) in offline:  # the killed attempt's file may hold nothing: W&B had not written it yet
        records = _wandb_records(attempt_dir)
        assert {r["run"]["run_id"] for r in records if r["type"] == "run"} <= {run_id}
        rows += [
            (r["history"]["step"]["num"], r["history"]["item"]["loss"])
            for r in records
            if r["type"] == "history"
        ]
        last = records
    assert [s for s, _ in rows] == steps and [v for _, v in rows] == pytest.approx(curve, rel=1e-9)
    summary = {
        k: v
        for r in last
        if r["type"] == "summary"
        for k, v in r["summary"].get("update", {}).items()
    }
    assert summary["wf_launch/status"] == "ok" and [
        r["exit"].get("exit_code") for r in last if r["type"] == "exit"
    ] == [0]


def _mlflow_run(store: Path, run_dir: Path) -> tuple[Any, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.as_uri())
    return client, client.get_run((run_dir / "tracking" / "mlflow.run").read_text().strip())


@pytest.mark.slow
def test_a_tracker_that_fails_mid_run_warns_once_and_the_run_and_metrics_jsonl_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, store = tmp_path / "run", tmp_path / "store"
    proc = start_cli(
        [
            "task=chatty",
            TASKS,
            "task.steps=40",
            "task.step_sleep_s=0.1",
            "task.say_every=100",
            "tracking=[tensorboard,mlflow]",
            f"tracking.mlflow.uri={store.as_uri()}",
            "tracking.flush_s=0.2",
        ],
        run_dir,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = read_state(run_dir, "mlflow", 0)
            if (state.get("last_step") or 0) >= 5:
                break
            time.sleep(0.05)
        import shutil

        shutil.rmtree(store)
        store.write_text(
            "the disk that held the store is gone\n"
        )  # every later write to the store fails
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert err.count("tracker mlflow failed to log") == 1 and "the run goes on" in err, err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert [e.step for e in _tensorboard(run_dir / "tensorboard").Scalars("loss")] == list(
        range(1, 41)
    )


@pytest.mark.slow
def test_with_all_ranks_every_rank_tracks_under_its_own_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "task=chatty",
            TASKS,
            "engine.dp_size=2",
            "task.steps=12",
            "task.step_sleep_s=0.02",
            "tracking=[tensorboard,mlflow]",
            "tracking.all_ranks=true",
        ],
        run_dir,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert [
            e.step for e in _tensorboard(run_dir / "tensorboard" / f"rank{rank}").Scalars("loss")
        ] == list(range(1, 13))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client, run = _mlflow_run(tmp_path / "mlruns", run_dir)
    assert sorted(k for k in run.data.metrics) == ["rank0/loss", "rank1/loss"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "rank1/loss")] == list(
        range(1, 13)
    )
    assert (
        run.info.status == "FINISHED"
        and run.data.tags["wf_launch.run_id"] == (run_dir / "run_id").read_text().strip()
    )
