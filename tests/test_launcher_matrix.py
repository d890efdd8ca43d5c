"""One console and one record, whatever the launcher (issue 30, section 1).

Each scenario is launched once per launcher (a module-scoped fixture) and checked by several
tests: the same console contract and the same ``result.json`` fields on local, SLURM and Ray.
The scenarios: one rank raises; all ranks raise alike; a rank is killed with kill -9; a rank
hangs; Ctrl-C after a checkpoint and before one; SIGTERM; a resume.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import USER_TASKS, cli_env, python_m

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("matrix")]  # module-scoped runs: once

TEST_TASKS = "task.modules=[wf_test_tasks,wf_identity_tasks]"
TRAIN = ["task=train", "engine.dp_size=2", "task.checkpoint_every=2", "task.step_sleep_s=0.3"]
PLACE = r"(?: on node \w+, host [\w.-]+)?"
"""Where a launcher that knows its ranks' nodes (Ray) adds it to a rank's label."""


def _rank(rank: int) -> str:
    """A pattern of ``rank 1 (r1 tp0 cp0 pp0 dp1)`` as every launcher writes it (dp=2)."""
    return rf"rank {rank} \(r{rank} tp0 cp0 pp0 dp{rank}{PLACE}\)"


@dataclass
class Target:
    """A launcher to run the scenarios on: its overrides and the environment its CLI needs."""

    name: str
    args: list[str]
    env: dict[str, str]


@dataclass
class Launch:
    """One scenario's launch: its exit code, console (stderr) and record."""

    run_dir: Path
    code: int
    err: str

    @property
    def record(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "result.json").read_text())


@pytest.fixture(
    scope="module",
    params=[
        "local",
        pytest.param("slurm", marks=pytest.mark.slurm),
        pytest.param("ray", marks=pytest.mark.ray),
    ],
)
def target(request: pytest.FixtureRequest) -> Target:
    if request.param == "local":
        return Target("local", [], cli_env())
    if request.param == "slurm":
        cluster = request.getfixturevalue("slurm_cluster")
        env = dict(cluster.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
        return Target("slurm", ["launcher=slurm"], env)
    cluster = request.getfixturevalue("ray_cluster")
    return Target("ray", ["launcher=ray", f"launcher.address={cluster.address}"], cluster.env)


def _start(target: Target, args: list[str], run_dir: Path) -> subprocess.Popen[str]:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return python_m(
        "wf_launch",
        [*target.args, *args, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=target.env,
        cwd=run_dir.parent,
        start_new_session=True,
    )


def _launch(target: Target, args: list[str], run_dir: Path, timeout: float = 300) -> Launch:
    proc = _start(target, args, run_dir)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return Launch(run_dir, proc.returncode, err)


def _wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen[str]) -> None:
    """Until every rank has published ``step`` (their progress files: events, not a delay)."""
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        steps = []
        for rank in (0, 1):
            try:
                steps.append(
                    json.loads((run_dir / "logs" / f"rank{rank}.progress.json").read_text())["step"]
                )
            except (OSError, ValueError, KeyError):
                steps.append(0)
        if min(steps) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} never reached in {run_dir}{_why_ended(run_dir, proc)}")


def _why_ended(run_dir: Path, proc: subprocess.Popen[str]) -> str:
    """What a launch that ended early left: its exit code, stderr and ``result.json`` (the run
    directory is gone once the suite's temporary folder is)."""
    if proc.poll() is None:
        return " (the launch still runs)"
    _, err = proc.communicate()
    try:
        result = (run_dir / "result.json").read_text()
    except OSError as exc:
        result = f"no result.json ({exc})"
    return f": the launch exited {proc.returncode}\n{(err or '')[-3000:]}\n{result[-3000:]}"


def _signalled(
    target: Target, args: list[str], run_dir: Path, sig: signal.Signals, at_step: int
) -> Launch:
    """Launch, then send ``sig`` once every rank reached ``at_step``: SIGINT as a terminal's
    Ctrl-C does (to the whole foreground process group), SIGTERM to the launcher alone."""
    proc = _start(target, args, run_dir)
    try:
        _wait_for_step(run_dir, at_step, proc)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return Launch(run_dir, proc.returncode, err)


@pytest.fixture(scope="module")
def scratch(target: Target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(f"matrix-{target.name}")


# ------------------------------------------------------------------ the scenarios, launched once
@pytest.fixture(scope="module")
def one_raises(target: Target, scratch: Path) -> Launch:
    return _launch(target, ["task=misbehave", TEST_TASKS, "engine.dp_size=2"], scratch / "raise")


@pytest.fixture(scope="module")
def all_alike(target: Target, scratch: Path) -> Launch:
    return _launch(target, ["task=fail_alike", TEST_TASKS, "engine.dp_size=2"], scratch / "alike")


@pytest.fixture(scope="module")
def killed(target: Target, scratch: Path) -> Launch:
    args = ["task=misbehave", TEST_TASKS, "task.how=kill", "engine.dp_size=2"]
    return _launch(target, args, scratch / "kill9")


@pytest.fixture(scope="module")
def hung(target: Target, scratch: Path) -> Launch:
    args = [
        "task=misbehave",
        TEST_TASKS,
        "task.how=stuck",
        "task.sleep_s=240",
        "engine.dp_size=2",
        "engine.distributed_timeout_minutes=0.1",
    ]
    return _launch(target, args, scratch / "hang")


@pytest.fixture(scope="module")
def ctrl_c_saved(target: Target, scratch: Path) -> Launch:
    return _signalled(target, [*TRAIN, "task.steps=60"], scratch / "ctrlc", signal.SIGINT, 3)


@pytest.fixture(scope="module")
def ctrl_c_unsaved(target: Target, scratch: Path) -> Launch:
    args = ["task=slow_steps", TEST_TASKS, "task.steps=60", "task.step_sleep_s=0.5"]
    args += ["engine.dp_size=2"]
    return _signalled(target, args, scratch / "ctrlc0", signal.SIGINT, 1)


@pytest.fixture(scope="module")
def sigterm(target: Target, scratch: Path) -> Launch:
    return _signalled(target, [*TRAIN, "task.steps=60"], scratch / "term", signal.SIGTERM, 3)


@pytest.fixture(scope="module")
def resumed(target: Target, ctrl_c_saved: Launch) -> Launch:
    args = [*TRAIN, "task.steps=12", "task.step_sleep_s=0", "launcher.resume=true"]
    return _launch(target, args, ctrl_c_saved.run_dir)


# ------------------------------------------------------------------ what every launch shows
def _console_contract(launch: Launch, status: str) -> None:
    """One final line, at most one traceback (ranks failing alike once), no torch noise."""
    assert re.search(rf"\[wf_launch\] INFO +run {status} in [\d.]+s: ", launch.err), launch.err
    assert launch.err.count("Traceback (most recent call last)") <= 1, launch.err
    assert "Terminating process" not in launch.err and "W1203" not in launch.err, launch.err
    assert "wf_launch/rank/entrypoint.py" not in launch.err, launch.err  # the user's frames only


def _record_contract(launch: Launch, status: str, code: int) -> dict[str, Any]:
    """The fields every run that ran its ranks records, whatever the launcher."""
    record = launch.record
    assert record["status"] == status and record["exit_code"] == code, record
    assert record["run_id"] and record["finished_at"], record
    assert record["layout"] == {
        "tp": 1,
        "cp": 1,
        "pp": 1,
        "dp": 2,
        "order": "tp-cp-pp-dp",
        "world_size": 2,
    }, record
    assert record["hosts"] and set(record["placement"]) == {"0", "1"}, record
    assert record["attempts"] and record["timings"]["wall_s"] > 0, record
    return record


def test_one_rank_raises(one_raises: Launch) -> None:
    assert one_raises.code == 1, one_raises.err
    _console_contract(one_raises, "failed")
    said = f"{_rank(1)} failed first: ValueError: rank 1 refuses: bad batch 17"
    assert re.search(said, one_raises.err), one_raises.err
    assert one_raises.err.count('raise ValueError(f"rank {ctx.rank} refuses: bad batch 17")') == 1
    failure = _record_contract(one_raises, "failed", 1)["failure"]
    assert (failure["rank"], failure["cause"], failure["type"]) == (1, "exception", "ValueError")
    assert failure["coords"] == {"tp": 0, "cp": 0, "pp": 0, "dp": 1}


def test_all_ranks_raise_alike(all_alike: Launch) -> None:
    assert all_alike.code == 1, all_alike.err
    _console_contract(all_alike, "failed")
    assert "ranks 0,1 (2 ranks) failed alike: ValueError: bad shape [4, 4]" in all_alike.err
    assert all_alike.err.count('raise ValueError(f"bad shape {[4, 4]}")') == 1, all_alike.err
    failure = _record_contract(all_alike, "failed", 1)["failure"]
    assert failure["cause"] == "exception" and failure["type"] == "ValueError"


def test_a_rank_killed_with_kill_9(target: Target, killed: Launch) -> None:
    assert killed.code == 1, killed.err
    _console_contract(killed, "failed")
    failure = _record_contract(killed, "failed", 1)["failure"]
    if target.name in ("ray", "slurm"):
        # A Ray actor's exit status goes to its raylet, which does not report it, and SLURM has
        # none per task: the launcher knows the rank died without a record (its peers only lost
        # it), not which signal ended it. srun's word on the task comes with it.
        said = rf"{_rank(1)} died: its process ended without a failure record \(killed: SIGKILL"
        assert re.search(said, killed.err), killed.err
        assert (failure["rank"], failure["cause"]) == (1, "died"), failure
        if target.name == "slurm":
            assert "  srun: task 1: Killed" in killed.err and failure["srun"] == "Killed"
            assert re.search(r"rank 0 \(.*\) lost a peer \(a consequence\)", killed.err)
        return
    assert re.search(f"{_rank(1)} was killed by SIGKILL", killed.err), killed.err
    assert (failure["rank"], failure["cause"], failure["signal"]) == (1, "signal", "SIGKILL")


def test_a_rank_hangs(hung: Launch) -> None:
    assert hung.code == 1, hung.err
    _console_contract(hung, "failed")
    assert re.search(f"collective timed out: {_rank(1)} never arrived", hung.err), hung.err
    assert "in misbehave" in hung.err  # where the stuck rank was
    failure = _record_contract(hung, "failed", 1)["failure"]
    assert failure["cause"] == "stuck" and failure["missing_ranks"] == [1], failure


def _hint(launch: Launch) -> re.Match[str] | None:
    return re.search(r"continue it from (.*?): (python -m wf_launch .*)$", launch.err, re.M)


def test_ctrl_c_after_a_checkpoint(ctrl_c_saved: Launch) -> None:
    assert ctrl_c_saved.code == 130, ctrl_c_saved.err
    _console_contract(ctrl_c_saved, "interrupted")
    assert "Ctrl-C: every rank stops at its next step boundary" in ctrl_c_saved.err
    record = _record_contract(ctrl_c_saved, "interrupted", 130)
    assert record["signal"] == "SIGINT" and record["failure"]["cause"] == "interrupt"
    hint = _hint(ctrl_c_saved)
    assert hint and hint.group(1).startswith("its checkpoint of step "), ctrl_c_saved.err
    assert f"launcher.resume=true hydra.run.dir={ctrl_c_saved.run_dir}" in hint.group(2)
    assert record["attempts"][-1]["ended_by"] == "stop flag: SIGINT (Ctrl-C)", record


def test_ctrl_c_before_a_checkpoint(ctrl_c_unsaved: Launch) -> None:
    assert ctrl_c_unsaved.code == 130, ctrl_c_unsaved.err
    _console_contract(ctrl_c_unsaved, "interrupted")
    assert "Ctrl-C: every rank stops at its next step boundary" in ctrl_c_unsaved.err
    record = _record_contract(ctrl_c_unsaved, "interrupted", 130)
    assert record["signal"] == "SIGINT"
    hint = _hint(ctrl_c_unsaved)
    assert hint and hint.group(1) == "the start (it saved no checkpoint)", ctrl_c_unsaved.err


def test_sigterm(sigterm: Launch) -> None:
    assert sigterm.code == 143, sigterm.err
    _console_contract(sigterm, "interrupted")
    record = _record_contract(sigterm, "interrupted", 143)
    assert record["signal"] == "SIGTERM" and record["failure"]["cause"] == "interrupt"
    hint = _hint(sigterm)
    assert hint and hint.group(1).startswith("its checkpoint of step "), sigterm.err
    assert record["attempts"][-1]["ended_by"] == "stop flag: SIGTERM", record


def test_a_resume(ctrl_c_saved: Launch, resumed: Launch) -> None:
    saved = int(re.search(r"checkpoint of step (\d+)", ctrl_c_saved.err).group(1))
    assert resumed.code == 0, resumed.err
    _console_contract(resumed, "ok")
    totals = re.findall(r"\[wf_launch\] INFO +step \d+/(\d+)", resumed.err)
    assert totals and set(totals) == {"12"}, resumed.err  # this attempt's total from the start
    record = _record_contract(resumed, "ok", 0)
    assert [a["attempt"] for a in record["attempts"]] == [0, 1]
    assert record["attempts"][1]["resumed_from"] == saved, record["attempts"]
    assert record["attempts"][1]["cause"] == "stop flag: SIGINT (Ctrl-C)"


def test_nothing_is_left_on_the_cluster(
    target: Target, request: pytest.FixtureRequest, resumed: Launch, sigterm: Launch
) -> None:
    """After every scenario (the last ones: a resume, a SIGTERM): no actor, placement group or
    process of the runs is left (on the local launcher: no rank process)."""
    if target.name == "slurm":
        cluster = request.getfixturevalue("slurm_cluster")
        for run in (resumed, sigterm):
            job = json.loads((run.run_dir / "slurm_job.json").read_text())["job_id"]
            queue = cluster.run(["squeue", "-h", "-j", job], check=False)
            assert queue.stdout.strip() == "", queue.stdout
        return
    if target.name != "ray":
        import psutil

        mine = [
            p for p in psutil.process_iter(["cmdline"]) if "wf_launch" in str(p.info["cmdline"])
        ]
        assert [p for p in mine if str(sigterm.run_dir) in str(p.info["cmdline"])] == []
        return
    assert request.getfixturevalue("ray_cluster").leftovers() == []
