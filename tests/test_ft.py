"""``ft=torchft``: replica groups that drop out and heal while the others keep stepping.

Real processes on loopback, real ``kill -9`` and SIGSTOP, real torchft (its Lighthouse, Manager,
gloo groups and HTTP checkpoint transport): nothing of the quorum is mocked. The real runs:

- one ft drill (``python -m wf_launch.drill``: an uninterrupted reference, then the run it
  interrupts) of two replica groups (FSDP2 over dp=2 inside each): a rank of group 1 hangs at
  step 6, the hang watch tears the group down, and it is killed again in the middle of its heal;
  group 1 alone restarts twice and heals from group 0, whose ranks keep their pids and never
  step back; the final weights are equal;
- one run (one rank per group) whose Lighthouse is killed: the launcher restarts it and the
  run goes on, every socket on loopback;
- one run with ``min_replicas=2`` that loses a replica group for good: the survivor cannot form
  a quorum and the run fails, naming it;
- groups that start apart, and a SIGTERM then a resume.

Bad inputs are checked in-process (fast), and once through the CLI (exit 2, nothing started)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from cli_helpers import cli_env, listening, python_m, run_cli, run_python_m

from wf_launch.launchers.ft_record import read_steps
from wf_launch.rundir import files

pytestmark = pytest.mark.xdist_group("ft")  # its module-scoped runs, launched once

pytest.importorskip("torchft", reason="ft=torchft needs the [ft] extra")

STEPS = 30
HANG_AT = 6
"""Two steps after the checkpoint of step 4 (every 4): the torn-down group restarts from step 4,
behind its peer, so it must heal."""
SLEEP = "task.step_sleep_s=0.3"
"""Steps long enough for the launcher's view; a group back after its peer's last step heals from
it there (the peer holds)."""
LIGHTHOUSE_KILL_AT = 3
DEADLINE_S = 600.0
"""Only an upper bound: every wait below ends on an event (a step reached, a process gone)."""

# ---------------------------------------------------------------------------- bad inputs


@pytest.fixture(scope="module")
def validate():
    """Compose overrides with Hydra and validate them as the CLI does, in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "fuzz_configs", Path(__file__).resolve().parents[1] / "scripts" / "fuzz_configs.py"
    )
    fuzz = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_configs"] = fuzz
    spec.loader.exec_module(fuzz)
    from hydra import compose

    from wf_launch.app import resolve, validate_run_config

    with fuzz.hydra_context():
        yield lambda overrides: validate_run_config(
            resolve(compose(config_name="config", overrides=overrides))
        )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ft.replicas=1"], "ft.replicas=1 is not allowed: expected an integer >= 2"),
        (["ft.min_replicas=3"], "ft.min_replicas=3 is not allowed: an integer from 1 to"),
        (["ft.lighthouse=nowhere"], "ft.lighthouse='nowhere' is not allowed: null (the launcher"),
        (["ft.quorum_timeout_s=0"], "ft.quorum_timeout_s=0.0 is not allowed: expected seconds in"),
        (["ft.join_timeout_s=-5"], "ft.join_timeout_s=-5.0 is not allowed: expected seconds in"),
        (["ft.max_replica_restarts=-1"], "ft.max_replica_restarts=-1 is not allowed"),
        (
            ["ft.hang_timeout_s=60"],
            "ft.hang_timeout_s=60.0 is not allowed: seconds below ft.quorum_timeout_s=60 (a hung",
        ),
        (["ft.hang_timeout_s=0"], "ft.hang_timeout_s=0.0 is not allowed: expected seconds in"),
        (
            ["ft.quorum_timeout_s=5", "ft.hang_timeout_s=5"],
            "ft.hang_timeout_s=5.0 is not allowed: seconds below ft.quorum_timeout_s=5 (a hung",
        ),
        (["task=demo"], "ft='torchft' is not allowed: task 'demo' does not step through"),
        (
            ["launcher=slurm", "launcher.tasks_per_node=2"],
            "launcher.tasks_per_node=2 is not allowed: null under ft=torchft",
        ),
        (
            ["launcher=ray", "launcher.address=127.0.0.1:6379", "launcher.wait=false"],
            "launcher.wait=False is not allowed: true under ft=torchft: the launching command",
        ),
    ],
)
def test_bad_ft_inputs_are_refused_naming_field_value_and_what_is_allowed(
    validate, overrides, message
):
    from wf_launch.config import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(["task=train", "ft=torchft", *overrides])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_lighthouse_that_does_not_answer_is_refused(validate):
    from wf_launch.config import ConfigError

    port = _closed_port()
    with pytest.raises(ConfigError, match=rf"ft.lighthouse='127.0.0.1:{port}' .*does not|failed"):
        validate(["task=train", "ft=torchft", f"ft.lighthouse=127.0.0.1:{port}"])


def test_ft_none_ignores_the_ft_fields_and_torchft_accepts_a_good_config(validate):
    assert validate(["ft.replicas=1"]).world_size == 1
    assert validate(["task=train", "ft=torchft", "ft.replicas=3"]).world_size == 1


def test_the_cli_refuses_bad_ft_with_exit_2_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["task=train", "ft=torchft", "ft.replicas=1"], run_dir)
    assert proc.returncode == 2, proc.stderr
    assert "ft.replicas=1 is not allowed" in proc.stderr
    assert not (run_dir / "replicas").exists()
    assert not (run_dir / "lighthouse.log").exists()


@pytest.mark.parametrize(
    ("launcher", "each", "shape"),
    [
        ("local", "each group its own agent, store and groups", "rendezvous"),
        ("ray", "each group its own placement group", "placement"),
        ("slurm", "each group a job step of one job", "#SBATCH --cpus-per-task=4"),
    ],
)
def test_the_dry_run_of_every_launcher_shows_the_replica_groups(tmp_path, launcher, each, shape):
    """SLURM under ft: one task per node; its CPUs hold the node's groups (2 x 2 ranks here)."""
    overrides = ["task=train", "ft=torchft", "engine.dp_size=2", f"launcher={launcher}"]
    proc = run_cli([*overrides, "launcher.dry_run=true"], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "torchft: 2 replica groups x 2 rank(s) = 4 ranks" in proc.stdout, proc.stdout
    assert each in proc.stdout and shape in proc.stdout
    if launcher == "slurm":
        assert "#SBATCH --ntasks-per-node=1" in proc.stdout


# ---------------------------------------------------------------------------- real runs


def _launch(run_dir: Path, *overrides: str) -> subprocess.Popen:
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")  # noqa: SIM115 - closed by the OS
    return python_m(
        "wf_launch",
        ["task=train", "ft=torchft", f"hydra.run.dir={run_dir}", *overrides],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=cli_env({"WF_PROGRESS_PUBLISH_S": "0"}),
        cwd=run_dir.parent,
        start_new_session=True,
    )


def _steps(run_dir: Path, k: int) -> list[int]:
    """The steps rank 0 of replica group ``k`` reported."""
    return [step for _, step, _ in read_steps(files.ft_replica_dir(run_dir, k))]


def _wait_step(proc: subprocess.Popen, run_dir: Path, k: int, step: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while max(_steps(run_dir, k), default=0) < step:
        assert proc.poll() is None, f"the run ended before replica group {k} reached step {step}"
        assert time.monotonic() < deadline, f"replica group {k} never reached step {step}"
        time.sleep(0.1)


def _pids(run_dir: Path, k: int, ranks: int) -> dict[int, int]:
    logs = run_dir / "replicas" / str(k) / "logs"
    return {r: json.loads((logs / f"rank{r}.pid").read_text())["pid"] for r in range(ranks)}


def _lighthouse(proc: subprocess.Popen) -> psutil.Process:
    return next(
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if any("ft_lighthouse" in part for part in p.cmdline())
    )


def _finish(proc: subprocess.Popen, run_dir: Path) -> dict[str, Any]:
    try:
        proc.wait(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return {
        "rc": proc.returncode,
        "record": json.loads((run_dir / "result.json").read_text()),
        "out": (run_dir.parent / f"{run_dir.name}.out").read_text(),
    }


QUICK_FT = [
    "task.modules=[wf_ft_tasks]",
    "ft=torchft",
    "engine.dp_size=2",
    "ft.timeout_s=5",
    "ft.hang_timeout_s=4",
    "ft.quorum_timeout_s=30",
]
"""Two replica groups of 2 ranks that give up on a lost peer in seconds (the test tasks' module
on the path)."""
DRILL = [
    "task=train_slow_heal",
    *QUICK_FT,
    f"task.steps={STEPS}",
    "task.checkpoint_every=4",
    SLEEP,
]
"""Two replica groups of 2 ranks; heals that take 3 s (``wf_ft_tasks``), so that a drill can kill
a group in the middle of one."""
INJECT = f"hang:replica1.rank1@{HANG_AT},kill9:replica1@heal"


def _run_drill(
    directory: Path,
    overrides: list[str],
    inject: str,
    timeout: float = DEADLINE_S,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``python -m wf_launch.drill OVERRIDES --inject INJECT --dir DIRECTORY``, its output
    captured as text (``env``: more variables for it)."""
    return run_python_m(
        "wf_launch.drill",
        [*overrides, "--inject", inject, "--dir", str(directory)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(env),
        cwd=directory.parent,
    )


def _ft_drill(
    directory: Path, overrides: list[str], inject: str
) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """``python -m wf_launch.drill OVERRIDES --inject INJECT --dir DIRECTORY``, which must pass;
    (the command, its ``drill.json``)."""
    done = _run_drill(directory, overrides, inject)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads((directory / "drill.json").read_text())


@pytest.fixture(scope="module")
def drilled(tmp_path_factory) -> dict[str, Any]:
    """The ft drill of :data:`INJECT`, two faults of replica group 1. The first stops its rank 1
    (SIGSTOP: not even a stack dump); its rank 0 waits for it, group 0 waits in its all-reduce
    with it until ``ft.timeout_s``, then for a quorum (the Lighthouse holds it while group 1
    heartbeats). The launcher's hang watch finds group 1 hung and kills its ranks; it restarts
    and heals, and the second kills it (-9) in the middle of that heal. It restarts again and
    heals from group 0. The drill passed (group 0 kept its processes and never stepped back, the
    weights end equal to each other and the loss to the uninterrupted run's)."""
    directory = tmp_path_factory.mktemp("ft") / "drill"
    _, summary = _ft_drill(directory, DRILL, INJECT)
    run_dir = directory / "interrupted"
    return {
        "summary": summary,
        "run_dir": run_dir,
        "record": json.loads((run_dir / "result.json").read_text()),
        "log": (directory / "interrupted.log").read_text(),
    }


@pytest.mark.slow
def test_the_run_completes_through_the_failures(drilled):
    assert drilled["record"]["status"] == "ok"
    ft = drilled["record"]["ft"]
    assert ft["steps_completed"] == {"0": STEPS, "1": STEPS}
    assert ft["lighthouse_restarts"] == 0
    assert drilled["summary"]["survivor_steps_lost"] == 0


@pytest.mark.slow
def test_survivors_keep_their_processes_and_never_step_back(drilled):
    steps = _steps(drilled["run_dir"], 0)
    assert steps == sorted(set(steps)), "replica group 0 repeated or went back a step"
    assert steps[-1] == STEPS
    ft = drilled["record"]["ft"]
    assert ft["survivor_restarts"] == 0
    assert ft["stepped_back"]["0"] is False
    # the survivors never reloaded a checkpoint: one attempt, started fresh
    logs = drilled["run_dir"] / "replicas" / "0" / "logs"
    assert len(list(logs.glob("attempt*.json"))) == 1
    assert drilled["record"]["results"]["0"]["resumed_from"] is None
    assert "resumes from step" not in (logs / "rank0.log").read_text()


@pytest.mark.slow
def test_a_hung_rank_is_found_and_only_its_group_is_torn_down(drilled):
    hung = drilled["record"]["ft"]["recoveries"][0]
    assert (hung["replica"], hung["rank"], hung["global_rank"]) == (1, 1, 3)
    assert hung["cause"] == "hang" and hung["failed_at_step"] >= HANG_AT
    assert hung["rejoined_at_step"] is None  # it died healing
    (event,) = [e for e in _events(drilled["run_dir"], 1) if e["event"] == "hung"]
    assert event["stopped"] == [1] and event["while_going"] == [0]
    if event["stuck"]:  # stopped in its step, or after its quorum request: a rank in a step
        said = f"rank(s) {event['stuck']} did not end step"
        assert "(stopped: rank(s) [1]," in drilled["log"]
    else:  # stopped before its quorum request: every rank waits; found by being stopped
        said = "rank(s) [1] stopped (by a signal) at step"
    assert f"ft: replica group 1 is hung: {said}" in drilled["log"]
    assert "replica group 0 is hung" not in drilled["log"]


@pytest.mark.slow
def test_a_group_killed_while_it_heals_restarts_and_heals_from_its_peer(drilled):
    _, rec = drilled["record"]["ft"]["recoveries"]
    assert rec["replica"] == 1 and rec["cause"] == "SIGKILL"
    assert rec["global_rank"] == 2 + rec["rank"]
    assert rec["rejoined_at_step"] >= HANG_AT
    assert rec["healed_from"] == 0
    assert 0 < rec["seconds_to_rejoin"] < 120
    kinds = [e["event"] for e in _events(drilled["run_dir"], 1)]
    assert kinds.count("failed") == 2 and kinds.count("healing") >= 2, kinds
    assert "healed" in kinds, kinds
    from wf_launch.launchers.ft_record import ft_status_lines  # what `status` shows

    lines = ft_status_lines(drilled["run_dir"])
    quorum = 1 if rec["rejoined_at_step"] == STEPS else 2  # healed from group 0 holding at 30
    assert lines[0].startswith(f"replica group 0: step {STEPS}, quorum of {quorum} replica")
    assert "healed to step" in lines[1] and lines[1].endswith("(2 restart(s))")


@pytest.mark.slow
def test_every_replica_group_ends_with_the_same_weights(drilled):
    assert drilled["record"]["ft"]["weights_equal"] is True
    results = drilled["record"]["results"]
    assert set(results) == {"0", "1", "2", "3"}  # global ranks: replica group x its 2 ranks
    assert results["0"]["weights_sha256"] == results["2"]["weights_sha256"]


def _events(run_dir: Path, k: int) -> list[dict[str, Any]]:
    text = files.ft_events(files.ft_replica_dir(run_dir, k)).read_text()
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.slow
def test_a_rank_hung_in_python_is_torn_down_only_once_its_peer_group_moved_on(tmp_path):
    """A hang that is not a stopped process (a rank asleep in its step, as in a deadlock): group
    0 waits for it in their all-reduce until ``ft.timeout_s``, then for a quorum; only then is
    group 1 torn down, and it heals. Group 0, longer in that step than ``ft.hang_timeout_s``
    too, is never taken for the hung one."""
    run_dir = tmp_path / "run"
    done = run_python_m(
        "wf_launch",
        [
            "task=train_hangs_once",
            *QUICK_FT,
            "task.steps=16",
            "task.step_sleep_s=0.3",
            "launcher.console_ranks=[]",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env({"WF_TEST_HANG_AT": "1:6"}),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = json.loads((run_dir / "result.json").read_text())["ft"]
    recoveries = [(r["replica"], r["rank"], r["cause"]) for r in section["recoveries"]]
    assert recoveries == [(1, 0, "hang")]
    assert section["recoveries"][0]["healed_from"] == 0
    assert section["survivor_restarts"] == 0 and section["weights_equal"]
    assert section["steps_completed"] == {"0": 16, "1": 16}
    events = files.ft_events(files.ft_replica_dir(run_dir, 1)).read_text().splitlines()
    (hung,) = [e for e in map(json.loads, events) if e["event"] == "hung"]
    # its rank 1 waits in the step's collective with rank 0: stuck too
    assert (hung["stuck"], hung["stopped"], hung["while_going"]) == ([0, 1], [], [0])
    assert hung["seconds"] >= 5  # not before group 0 gave up on the all-reduce and moved on


@pytest.mark.slow
@pytest.mark.parametrize("asks", ["at-once", "after-a-quorum-without-it"])
def test_a_group_back_after_its_peer_ended_its_steps_heals_from_it_at_the_last_step(tmp_path, asks):
    """Group 1 is killed at step 6 and comes back only once group 0 has run all 12 steps
    (``WF_TEST_BACK_LATE``: a restart slower than the rest of the run). Group 0 holds at its last
    step, joins group 1's first quorum and group 1 heals from it to step 12: equal weights, not
    12 steps trained alone from scratch. ``after-a-quorum-without-it`` (``WF_TEST_ASK_LATE``):
    group 0 asks first and the Lighthouse's fast quorum forms without group 1, which then waited
    alone until its timeout (the last CI run): group 0 must ask again."""
    directory = tmp_path / "drill"
    overrides = [
        "task=train",
        *QUICK_FT,
        "engine.dp_size=1",
        "task.steps=12",
        "task.step_sleep_s=0.1",
        "launcher.console_ranks=[]",
        "--no-reference",
    ]
    env = {"WF_TEST_BACK_LATE": "1", "WF_TEST_ASK_LATE": "1" if asks != "at-once" else "0"}
    done = _run_drill(directory, overrides, "kill9:replica1@6", 300, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "ft drill: PASS" in done.stdout
    run_dir = directory / "interrupted"
    section = json.loads((run_dir / "result.json").read_text())["ft"]
    (rec,) = section["recoveries"]
    assert (rec["replica"], rec["failed_at_step"], rec["healed_from"]) == (1, 6, 0), rec
    assert rec["rejoined_at_step"] == 12  # back after group 0's last step
    assert section["steps_completed"] == {"0": 12, "1": 12}
    assert section["survivor_restarts"] == 0 and section["weights_equal"]
    log = (files.ft_replica_dir(run_dir, 0) / "logs" / "rank0.log").read_text()
    assert "ft: holding at step 12: replica group(s) [1] back, joining their quorum" in log
    assert "not back within" not in log
    if asks != "at-once":
        assert "the quorum formed without replica group(s) [1]" in log


@pytest.mark.slow
def test_min_replicas_not_met_fails_the_run_naming_the_replica_group(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(
        run_dir,
        "task.steps=400",
        "ft.min_replicas=2",
        "ft.max_replica_restarts=0",
        "ft.quorum_timeout_s=5",
        "ft.hang_timeout_s=4.5",  # not a slow step on a loaded host: a group lost for good
    )
    _wait_step(proc, run_dir, 1, 2)
    os.kill(_pids(run_dir, 1, 1)[0], signal.SIGKILL)
    done = _finish(proc, run_dir)
    assert done["rc"] == 1, done["out"][-3000:]
    record = done["record"]
    assert record["status"] == "failed"
    assert record["failure"]["replica"] in (0, 1)
    assert record["failure"]["message"].startswith("replica group ")
    assert (
        "no quorum of ft.min_replicas=2 replica group(s) formed within ft.quorum_timeout_s=5.0"
        in record["failure"]["message"]
    )
    assert record["ft"]["exit_codes"]["1"] != 0 and record["ft"]["exit_codes"]["0"] != 0
    assert max(_steps(run_dir, 0)) < 400


def _probe(
    run_dir: Path, replica: int, ft: dict[str, Any], env: dict[str, str]
) -> subprocess.Popen:
    probe = Path(__file__).with_name("ft_join_probe.py")
    return subprocess.Popen(
        [sys.executable, str(probe), str(run_dir), str(replica), json.dumps(ft)],
        stdout=subprocess.PIPE,
        text=True,
        env=cli_env(env),
    )


@pytest.mark.slow
def test_replica_groups_that_start_apart_start_training_together(tmp_path):
    """A group started after the others' ``ft.quorum_timeout_s`` is waited for: the first quorum
    holds both groups. Without peers, the start fails after ``ft.join_timeout_s``, naming it."""
    from dataclasses import asdict

    from wf_launch.config.ft import FtConfig
    from wf_launch.launchers.ft_lighthouse import Lighthouse

    quorum_s, late_s = 0.5, 2.0
    ft = FtConfig(name="torchft", min_replicas=1, quorum_timeout_s=quorum_s, join_timeout_s=60)
    lighthouse = Lighthouse(ft, tmp_path / "lighthouse.log").start()
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address, "RUST_LOG": "warn"}
    try:
        first = _probe(tmp_path / "apart", 0, asdict(ft), env)
        assert first.stdout.readline().strip() == "started"
        time.sleep(late_s)  # the late group: well past the first group's quorum timeout
        late = _probe(tmp_path / "apart", 1, asdict(ft), env)
        waited = json.loads(first.communicate(timeout=DEADLINE_S)[0])
        came = json.loads(late.communicate(timeout=DEADLINE_S)[0].splitlines()[-1])
    finally:
        lighthouse.stop()
    assert waited.get("seconds", 0) > late_s, waited
    assert waited["participants"] == came["participants"] == 2, (waited, came)
    alone = FtConfig(name="torchft", min_replicas=2, quorum_timeout_s=60, join_timeout_s=1)
    lighthouse = Lighthouse(alone, tmp_path / "lighthouse2.log").start()
    env["TORCHFT_LIGHTHOUSE"] = lighthouse.address
    try:
        lone = _probe(tmp_path / "alone", 0, asdict(alone), env)
        t0 = time.monotonic()
        out = json.loads(lone.communicate(timeout=DEADLINE_S)[0].splitlines()[-1])
        assert time.monotonic() - t0 < 30  # not the 60 s of ft.quorum_timeout_s
    finally:
        lighthouse.stop()
    assert out["error"].startswith(
        "no quorum of ft.min_replicas=2 replica group(s) formed within ft.join_timeout_s=1"
    ), out
    assert "the other groups did not start in time" in out["error"]


@pytest.mark.slow
def test_a_lighthouse_that_dies_is_restarted_and_every_socket_is_on_loopback(tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, "task.steps=20")
    _wait_step(proc, run_dir, 0, LIGHTHOUSE_KILL_AT)
    sockets = listening(proc.pid)
    first = _lighthouse(proc)
    recorded = json.loads(files.ft_lighthouse_pid(run_dir).read_text())
    assert recorded["pid"] == first.pid  # what the drill's lighthouse@STEP kills
    first.kill()
    done = _finish(proc, run_dir)
    assert done["rc"] == 0, done["out"][-3000:]
    again = json.loads(files.ft_lighthouse_pid(run_dir).read_text())
    assert again["pid"] != first.pid and again["address"] == recorded["address"]
    ft = done["record"]["ft"]
    assert ft["lighthouse_restarts"] == 1
    assert ft["steps_completed"] == {"0": 20, "1": 20}
    assert ft["weights_equal"] is True
    # torchft binds its Manager and checkpoint servers on every interface; under the launcher
    # they listen on loopback, as the Lighthouse, the stores and gloo do
    assert len(sockets) >= 6, sockets
    assert [a for a in sockets if not a.startswith("127.")] == []


@pytest.mark.parametrize(
    ("came_back", "rejoined_at", "healed_from", "status"),
    [
        (
            [{"event": "healed", "step": 12, "source": "http://127.0.0.1:0/checkpoint/"}],
            12,
            0,
            "healed to step 12",
        ),
        (
            [{"event": "rejoined", "step": 8, "replica_groups": 2}],
            8,
            None,
            "back at step 8 from its own checkpoint (nothing to heal)",
        ),
        ([], None, None, "restarting after a failure at step 10, to heal"),
        (
            [{"event": "healing", "step": 12, "source": "http://127.0.0.1:0/checkpoint/"}],
            None,
            None,
            "healing from replica group 0 to step 12 (1 restart(s))",
        ),
    ],
)
def test_a_restarted_group_is_recorded_back_whether_it_healed_or_not(
    tmp_path, came_back, rejoined_at, healed_from, status
):
    """A group back at the quorum's step from its own checkpoint had nothing to heal: it still
    rejoined, and the record and ``status`` say so (not "restarting" forever)."""
    from wf_launch.config.ft import FtConfig
    from wf_launch.launchers.ft_record import compose_ft, ft_status_lines

    for k in (0, 1):
        replica = files.ft_replica_dir(tmp_path, k)
        (replica / "logs").mkdir(parents=True)
        (replica / "logs" / "rank0.ft_address").write_text(f"http://127.0.0.1:{k}/checkpoint/\n")
    events = [{"event": "failed", "exit_codes": {"1": -9}, "failed_at_step": 10}, *came_back]
    lines = [json.dumps({"time": 100.0 + i, **e}) for i, e in enumerate(events)]
    files.ft_events(files.ft_replica_dir(tmp_path, 1)).write_text("\n".join(lines) + "\n")
    ft = FtConfig(name="torchft")
    section, _ = compose_ft(tmp_path, ft, 1, {0: 0, 1: 0})
    (rec,) = section["recoveries"]
    assert (rec["rank"], rec["cause"], rec["failed_at_step"]) == (1, "SIGKILL", 10)
    assert (rec["rejoined_at_step"], rec["healed_from"]) == (rejoined_at, healed_from)
    assert rec["seconds_to_rejoin"] == (1.0 if rejoined_at is not None else None)
    assert status in ft_status_lines(tmp_path)[1]


def test_a_group_that_left_no_exit_code_fails_the_run_with_a_message_naming_it(tmp_path):
    """A group whose node was lost leaves no exit code and no record: the run still gets a
    ``result.json`` that says it failed and names the group (not a crash while recording)."""
    from wf_launch.config.ft import FtConfig
    from wf_launch.launchers.ft_replicas import record_replicas
    from wf_launch.launchers.launch_plan import LaunchPlan
    from wf_launch.rundir.record import RunRecord
    from worldfoundry.core.distributed.topology import Layout

    config = {"task": {"name": "train"}, "launcher": {"name": "ray"}}
    plan = LaunchPlan(config=config, layout=Layout(1), run_dir=tmp_path)
    ft = FtConfig(name="torchft")
    outcome = record_replicas(plan, ft, {0: 0, 1: None}, 0, None, 1.0)
    record = RunRecord.read(tmp_path)
    assert record is not None and record.status == "failed"
    assert record.failure["replica"] == 1
    assert "replica group 1 failed: no record" in outcome.summary
    assert record.extra["ft"]["exit_codes"] == {"0": 0, "1": None}


def test_runs_marks_a_run_that_recovered_and_counts_every_replica_group(tmp_path):
    from wf_launch.readers.runs import list_runs, render
    from wf_launch.rundir.record import RunRecord

    sizes = {"tp": 1, "cp": 1, "pp": 1, "dp": 2}
    ft = {"replicas": 2, "min_replicas": 1, "recoveries": [{"replica": 1, "rank": 0}]}
    for name, section in (("healed", ft), ("quiet", {**ft, "recoveries": []})):
        (tmp_path / name).mkdir()
        RunRecord.finalize(tmp_path / name, "ok", task="train", layout=sizes, ft=section)
    rows = {Path(r.run_dir).name: r for r in list_runs([tmp_path])}
    assert rows["healed"].recovered == 1 and rows["quiet"].recovered == 0
    assert rows["healed"].layout == "2x1/1/1/2" and rows["healed"].world == 4
    table = render(list(rows.values()))
    assert "ok, recovered 1x" in table
    assert table.count("recovered 1x") == 1


@pytest.mark.slow
def test_sigterm_saves_every_group_and_a_resume_ends_with_equal_weights(tmp_path):
    run_dir = tmp_path / "run"
    args = ["task.steps=30", "task.step_sleep_s=0.2"]
    proc = _launch(run_dir, *args)
    _wait_step(proc, run_dir, 1, 6)
    os.kill(proc.pid, signal.SIGTERM)
    first = _finish(proc, run_dir)
    assert first["rc"] == 143, first["out"][-3000:]
    assert first["record"]["status"] == "interrupted"
    assert "continue it from its checkpoint of step" in first["out"]
    for k in (0, 1):
        assert list((run_dir / "replicas" / str(k) / "checkpoints").glob("step_*"))
    done = _finish(_launch(run_dir, *args, "launcher.resume=true"), run_dir)
    assert done["rc"] == 0, done["out"][-3000:]
    ft = done["record"]["ft"]
    assert ft["steps_completed"] == {"0": 30, "1": 30}
    assert ft["weights_equal"] is True
    assert done["record"]["results"]["0"]["resumed_from"] >= 6


@pytest.mark.parametrize(
    ("inject", "message"),
    [
        ("kill9:replica2@8", "replica2 does not exist: ft.replicas=2"),
        ("usr2:replica1@8", "usr2 is not drilled under ft=torchft"),
        ("kill9@8", "expected KIND:replicaK@STEP"),
        ("kill9:replica1@heal", "list a kill of replica1 at a step before it"),
        ("kill9:replica0@4,kill9:replica1@heal", "list a kill of replica1 at a step before it"),
        ("nodekill:replica1@8", "nodekill is not drilled under ft=torchft on this launcher"),
        ("lighthouse:replica1@8", "the Lighthouse is the run's, not a replica group's"),
        ("lighthouse@heal", "the Lighthouse is the run's, not a replica group's"),
    ],
)
def test_the_ft_drill_refuses_a_bad_injection_with_exit_2(tmp_path, capsys, inject, message):
    from wf_launch.drivers.drill import main

    argv = ["task=train", "ft=torchft", "--inject", inject, "--dir", str(tmp_path / "d")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["task=train", "--inject", "kill9@4"], "--no-reference: only under ft=torchft"),
        (
            ["task=train", "ft=torchft", "--inject", "kill9:replica1@4", "--atol", "0.1"],
            "--atol 0.1 with --no-reference",
        ),
    ],
)
def test_the_drill_refuses_no_reference_where_it_has_no_meaning(tmp_path, capsys, argv, message):
    from wf_launch.drivers.drill import main

    assert main([*argv, "--no-reference", "--dir", str(tmp_path / "d")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_an_ft_drill_without_a_reference_plans_one_run_and_checks_no_loss(capsys):
    from wf_launch.drivers.drill import main
    from wf_launch.drivers.drill_ft import render, verdict
    from wf_launch.rundir.record import RunRecord

    argv = ["task=train", "ft=torchft", "--inject", "kill9:replica1@8", "--dry-run"]
    assert main([*argv, "--no-reference"]) == 0
    assert "ft drill (no reference run): the run with:" in capsys.readouterr().out
    ft = {"recoveries": [], "survivor_restarts": 0, "weights_equal": True}
    run = RunRecord(status="ok", extra={"ft": ft}, results={"0": {"final_loss": 1.5}})
    summary = verdict(None, run, [], {}, 0.05, compared=False)
    assert summary["ok"] and "loss_within_atol" not in summary["checks"]
    assert summary["checks"]["runs_ok"]
    assert "final loss: 1.5 (no reference run: --no-reference)" in render(summary)
    assert not verdict(None, run, [], {}, 0.05)["ok"]  # compared, a missing reference fails


def test_an_ft_drill_whose_reference_run_fails_stops_naming_why(tmp_path):
    """A reference run that fails (here a task module that cannot be imported) ends the drill
    with exit 2 and the run's own last word, not a report that nothing was struck."""
    directory = tmp_path / "d"
    argv = ["task=train", "ft=torchft", "task.modules=[no_such_tasks]"]
    done = _run_drill(directory, argv, "kill9:replica1@4", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "the reference run failed (exit 2)" in done.stderr
    assert "cannot import 'no_such_tasks'" in done.stderr
    assert not (directory / "interrupted").exists()


def test_the_ft_drill_plans_the_kill_it_was_asked_for(capsys):
    from wf_launch.drivers.drill import main

    argv = ["task=train", "ft=torchft", "--inject", "kill9:replica1.rank1@8", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "kill -9 of rank 1 of replica1 at its step 8" in out
    assert "ft.max_replica_restarts=1" in out


@pytest.mark.parametrize(
    ("backend", "inject", "plans", "restarts"),
    [
        ("local", "lighthouse@12,kill9:replica1@8", "kill -9 of the Lighthouse at replica0's", 1),
        ("ray", "nodekill:replica1@8", "kill of the node (raylet) of the last rank of replica1", 1),
    ],
)
def test_the_ft_drill_plans_a_lighthouse_or_node_kill_where_it_can(
    capsys, backend, inject, plans, restarts
):
    from wf_launch.drivers.drill import main

    argv = ["task=train", "ft=torchft", "--inject", inject, "--dry-run", "--backend", backend]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert plans in out
    assert f"ft.max_replica_restarts={restarts}" in out


def test_the_ft_drill_plans_a_kill_during_a_heal_after_the_kill_it_follows(capsys):
    from wf_launch.drivers.drill import main

    inject = "kill9:replica1@heal,kill9:replica0@3,kill9:replica1@8"
    assert main(["task=train", "ft=torchft", "--inject", inject, "--dry-run"]) == 2
    assert "list a kill of replica1 at a step before it" in capsys.readouterr().err
    inject = "kill9:replica1@8,kill9:replica1@heal,kill9:replica0@3"
    assert main(["task=train", "ft=torchft", "--inject", inject, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.index("replica0 at its step 3") < out.index("replica1 at its step 8")
    assert out.index("replica1 at its step 8") < out.index("replica1 while it heals after that")
    assert "ft.max_replica_restarts=3" in out


@pytest.mark.parametrize(
    ("groups", "hung"),
    [
        ({0: "QQ", 1: "SS"}, {1: [0]}),  # 1 stuck while 0 waits for a quorum since
        ({0: "nn", 1: "SS"}, {1: [0]}),  # 1 stuck while 0 stepped on without it
        ({0: "Qn", 1: "SS"}, {1: [0]}),  # each of 0's ranks moved on, one way or the other
        ({0: "QQ", 1: "QS"}, {1: [0]}),  # 1's rank 0 waits for its stuck rank 1 in the quorum
        ({0: "ss", 1: "SS"}, {}),  # 0 came late into the same step: 1 waits for it there
        ({0: "qq", 1: "SS"}, {}),  # 0 just ended the step: 1 may be about to
        ({0: "OO", 1: "SS"}, {}),  # 0 waits since before 1's step began: no news of it
        ({0: "SS", 1: "QS"}, {}),  # 0 still in its collective with 1's stuck rank: neither yet
        ({0: "QS", 1: "QS"}, {}),  # each has a stuck rank: neither is seen going on
        ({0: "SS", 1: "SS"}, {}),  # both in one long step: neither
        ({0: "QQ", 1: "QQ"}, {}),  # both wait for a quorum: neither
        ({0: "QQ", 1: "ss"}, {}),  # 1 stepping, within the timeout
        ({0: "SS"}, {}),  # alone (the other restarting): nobody waits for it
        ({0: "Q-", 1: "SS"}, {}),  # 0's rank 1 not back yet in its new attempt: not going
        ({0: "FF", 1: "SS"}, {}),  # 0 joining or healing: 1 may be timing out on it
        ({0: "QQ", 1: "SS", 2: "SS"}, {1: [0], 2: [0]}),
    ],
)
def test_the_hang_watch_tears_down_a_group_stuck_in_a_step_while_another_goes_on(groups, hung):
    """Where every rank is, and since when, tells a hung group from the ones waiting for it (none
    steps). Per rank, at step 3 unless said: S in the step since 0 s, s since 95 s; Q waiting for
    a quorum since 50 s, q at step 4 since 98 s, O since before the step (-1 s), F for its
    attempt's first since 50 s; n at step 5 since 99 s; - none yet. Timeout 10 s, now 100 s."""
    from wf_launch.launchers.ft_hang import Phase, hung_groups

    kinds = {
        "S": ("step", 0.0, 3, False),
        "s": ("step", 95.0, 3, False),
        "Q": ("quorum", 50.0, 3, False),
        "q": ("quorum", 98.0, 4, False),
        "O": ("quorum", -1.0, 3, False),
        "F": ("quorum", 50.0, 3, True),
        "n": ("step", 99.0, 5, False),
    }

    def phase(kind: str) -> Phase:
        name, since, step, first = kinds[kind]
        return Phase(name, since, step, first=first)

    phases = {
        k: {r: phase(c) for r, c in enumerate(ranks) if c != "-"} for k, ranks in groups.items()
    }
    assert hung_groups(phases, 100.0, 10.0, 2) == hung


def test_a_rank_stopped_while_every_rank_waits_for_a_quorum_is_hung_but_not_its_peers():
    """Stopped between writing its quorum phase and asking for the quorum, a rank leaves every
    rank looking like waiting; its being stopped for the timeout tells its group apart."""
    from wf_launch.launchers.ft_hang import Phase, hung_groups

    waiting = {r: Phase("quorum", 0.0, 3) for r in range(2)}
    groups = {0: waiting, 1: waiting}
    assert hung_groups(groups, 100.0, 10.0, 2) == {}
    assert hung_groups(groups, 100.0, 10.0, 2, {0: [], 1: [1]}) == {1: [0]}
    assert hung_groups(groups, 100.0, 10.0, 2, {0: [0], 1: [1]}) == {}  # both: neither


def test_the_hang_watch_kills_a_hung_groups_ranks_once_and_records_why(tmp_path):
    """A phase of an earlier launch (a resume) or of a torn-down attempt is not evidence; a stopped
    rank is killed and named."""
    from wf_launch.launchers.ft_hang import HangWatch
    from wf_launch.rank.ft import QUORUM, STEP, write_phase
    from wf_launch.rundir.pids import process_start

    watch = HangWatch(tmp_path, 2, 1, 10.0)
    for k in (0, 1):
        (files.ft_replica_dir(tmp_path, k) / "logs").mkdir(parents=True)
    write_phase(files.ft_replica_dir(tmp_path, 0), 0, QUORUM, 5)
    write_phase(files.ft_replica_dir(tmp_path, 1), 0, STEP, 5)
    rank = subprocess.Popen(["sleep", "120"])
    try:
        record = {"pid": rank.pid, "host": socket.gethostname(), "start": process_start(rank.pid)}
        files.rank_pid(files.ft_replica_dir(tmp_path, 1), 0).write_text(json.dumps(record))
        os.kill(rank.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while psutil.Process(rank.pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        watch.timeout_s = 0.0  # every step is too long, but both phases predate the watch
        watch.started = time.time()
        assert watch.check({0, 1}) == []
        watch.started = 0.0  # as if written in this launch
        assert watch.check({0, 1}) == [1]
        assert rank.wait(timeout=30) == -signal.SIGKILL
        assert watch.check({0, 1}) == []  # torn down: waits for the group's next attempt
    finally:
        rank.kill()
        rank.wait()
    (hung,) = [
        json.loads(line)
        for line in files.ft_events(files.ft_replica_dir(tmp_path, 1)).read_text().splitlines()
    ]
    assert (hung["event"], hung["step"], hung["stuck"], hung["while_going"]) == (
        "hung",
        5,
        [0],
        [0],
    )
    assert hung["stopped"] == [0]
