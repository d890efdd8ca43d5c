"""The drill across a layout change (``--resume-with``, ``--atol``), locally and on the real SLURM
cluster.

The measured bug this guards: a ``train`` run stopped at dp=4 and relaunched with
``launcher.resume=true engine.dp_size=2 engine.cp_size=2`` used to finish "ok" with a
loss curve 3.3e-2 away from the straight run (the global batch halved, per-rank state
went to ranks of other roles). Now it continues the same training within float
tolerance, says so in the attempts, and ``check_reference`` still holds.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_helpers import cli_env, run_python_m

from wf_launch.drivers.drill_layout import DEFAULT_ATOL


def _drill(
    args: list[str], directory: Path, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_python_m(
        "wf_launch.drill",
        [*args, "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        cwd=directory.parent,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--inject", "kill9@3", "--resume-with", "engine.dp_size=2"],
            "--resume-with needs --inject with a sigterm@STEP",
        ),
        (
            ["--random", "2", "--resume-with", "engine.dp_size=2"],
            "--resume-with needs --inject with a sigterm@STEP",
        ),
        (["--inject", "sigterm@3", "--resume-with", ""], "--resume-with: no override given"),
        (
            ["--inject", "sigterm@3", "--resume-with", "launcher.resume=false"],
            "the drill sets launcher.resume itself",
        ),
        (
            ["--inject", "sigterm@3", "--resume-with", "engine.dp_size"],
            "'engine.dp_size': not a Hydra override",
        ),
        (["--inject", "sigterm@3", "--atol", "0"], "--atol 0.0: expected a finite tolerance > 0"),
        (["--inject", "sigterm@3", "--atol", "nan"], "--atol nan: expected a finite tolerance > 0"),
    ],
)
def test_bad_layout_drill_arguments_are_refused_before_anything_runs(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from wf_launch.drivers.drill import main

    assert main(["task=train", *args, "--dir", str(tmp_path / "drill")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "drill").exists()


def _check_layout_change(summary: dict, before: dict, after: dict) -> None:
    tol = summary["tolerance"]
    assert tol["within"] and tol["atol"] == DEFAULT_ATOL and not tol["problems"], tol
    assert set(tol["weights"]) == {"model", "ema"} and tol["loss_curve_max_abs"] <= DEFAULT_ATOL
    first, resumed = (
        summary["attempts"][0],
        summary["attempts"][-1],
    )  # on SLURM a requeue may start in between
    assert first["layout_from"] is None and first["layout_to"] is None
    assert resumed["resumed_from"] is not None and resumed["resumed_from"] >= first["last_step"]
    assert {k: resumed["layout_from"][k] for k in before} == before
    assert {k: resumed["layout_to"][k] for k in after} == after


@pytest.mark.slow
def test_a_stopped_dp4_run_resumes_at_cp2_dp2_within_tolerance(tmp_path: Path) -> None:
    directory = tmp_path / "drill"
    # Steps of 0.2 s: on a loaded machine the stop must still land well before the last step (10).
    proc = _drill(
        [
            "task=train",
            "engine.dp_size=4",
            "task.check_reference=true",
            "task.step_sleep_s=0.2",
            "--inject",
            "sigterm@6",
            "--resume-with",
            "engine.dp_size=2 engine.cp_size=2",
        ],
        directory,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "drill verdict: WITHIN TOLERANCE (atol=0.0001: loss curve, final_loss, ema weights, model "
        "weights)" in proc.stdout
    ), proc.stdout
    assert "at a new layout (dp=4 -> cp=2 dp=2)" in proc.stdout
    summary = json.loads((directory / "drill.json").read_text())
    _check_layout_change(
        summary, {"dp": 4, "cp": 1, "world_size": 4}, {"dp": 2, "cp": 2, "world_size": 4}
    )
    first, resumed = summary["attempts"]
    assert (
        resumed["resumed_from"] == first["last_step"] and resumed["steps_lost"] == 0
    )  # the stop saved its step
    got = json.loads((directory / "interrupted" / "result.json").read_text())["results"]["0"]
    assert (
        got["global_batch"] == 16 and got["micro_batches"] == 4
    )  # the run's batch, split for dp=2
    assert got["reference_ok"] is True, got  # check_reference holds after the change
    status = run_python_m(
        "wf_launch.status",
        [str(directory / "interrupted")],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert "at a new layout (dp=4 -> cp=2 dp=2)" in status.stdout, status.stdout
    listing = run_python_m(
        "wf_launch.checkpoint",
        ["list", str(directory / "interrupted")],
        capture_output=True,
        text=True,
        timeout=60,
        env=cli_env(),
    )
    assert listing.returncode == 0 and "tp=1 cp=2 pp=1 dp=2" in listing.stdout, listing.stdout


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_drill_resumes_on_one_node_within_tolerance(slurm_cluster, tmp_path: Path) -> None:
    from cli_helpers import USER_TASKS

    env = dict(slurm_cluster.env)
    env["PYTHONPATH"] = ":".join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    directory = tmp_path / "drill"
    proc = _drill(
        [
            "task=train",
            "task.steps=16",
            "task.step_sleep_s=0.1",
            "engine.dp_size=2",
            "launcher.nodes=2",
            "--backend",
            "slurm",
            "--inject",
            "usr2@4",
            "--resume-with",
            "launcher.nodes=1 engine.dp_size=1",
            "--timeout",
            "400",
        ],
        directory,
        timeout=900,
        env=env,
    )
    logs = "".join(
        f"\n--- {log.name}\n{log.read_text()[-4000:]}" for log in sorted(directory.glob("*.log"))
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    assert "drill verdict: WITHIN TOLERANCE" in proc.stdout, proc.stdout
    summary = json.loads((directory / "drill.json").read_text())
    _check_layout_change(summary, {"dp": 2, "world_size": 2}, {"dp": 1, "world_size": 1})
    assert json.loads((directory / "interrupted" / "slurm_job.json").read_text())["nodes"] == 1
