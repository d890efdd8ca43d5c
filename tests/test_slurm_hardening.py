"""The SLURM launcher against hostile and unlucky input: no injection, no stray ids, no endless
waits."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import USER_TASKS, cli_env, load_script, run_python_m
from slurm_fixture import SlurmCluster

from wf_launch.launchers.slurm.rank_entry import master_port, requeue_target

SLURM = "launcher=slurm"
TEST_TASKS = "task.modules=[wf_test_tasks]"


fuzz_configs = load_script("fuzz_configs")


@pytest.fixture(scope="module")
def hydra_ctx() -> Iterator[None]:
    with fuzz_configs.hydra_context():
        yield


def _cli(
    args: list[str],
    run_dir: Path,
    env: dict[str, str] | None = None,
    timeout: float = 180,
    multirun: bool = False,
) -> subprocess.CompletedProcess[str]:
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    return run_python_m(
        "wf_launch",
        [*(["-m"] if multirun else []), *args, where],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        cwd=run_dir.parent,
    )


@pytest.mark.parametrize(
    "override, fragment",
    [
        (
            "launcher.partition='a\ntouch /tmp/wf_injected #'",
            "launcher.partition='a\\ntouch /tmp/wf_injected #' is not allowed: a single line",
        ),
        ("launcher.job_name='x\r--begin=now+1year'", "launcher.job_name="),
        (
            "+launcher.sbatch_extra={comment: 'ok\n#SBATCH --begin=now+1year'}",
            "launcher.sbatch_extra.comment=",
        ),
        ("launcher.setup=['echo a\necho b']", "launcher.setup[0]="),
        (
            "launcher.srun_args=['--ntasks=3']",
            "launcher.srun_args[0]='--ntasks=3' is not allowed: --ntasks is set by the launcher",
        ),
        (
            "launcher.srun_args=['--kill-on-bad-exit=0']",
            "--kill-on-bad-exit is set by the launcher",
        ),
        ("launcher.srun_args=[-n3]", "launcher.srun_args[0]='-n3' is not allowed"),
        ("launcher.mem_gb=inf", "launcher.mem_gb=inf is not allowed"),
        (
            "launcher.poll_interval_s=1e12",
            "launcher.poll_interval_s=1000000000000.0 is not allowed",
        ),
        (
            "launcher.folder=/etc",
            "launcher.folder='/etc' is not allowed: a relative folder inside the run directory",
        ),
        ("launcher.folder=../..", "launcher.folder='../..' is not allowed"),
    ],
)
def test_hostile_slurm_values_are_refused_by_validation(
    hydra_ctx: None, override: str, fragment: str
) -> None:
    """In this process: what the CLI runs before anything starts (compose, resolve, validate)."""
    result = fuzz_configs.check([SLURM, override])
    assert result.outcome == "config_error" and fragment in result.detail, result


def test_a_hostile_slurm_value_is_refused_by_the_cli_before_any_script_exists(
    tmp_path: Path,
) -> None:
    proc = _cli(
        [SLURM, "launcher.partition='a\ntouch /tmp/wf_injected #'", "launcher.dry_run=true"],
        tmp_path / "run",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "launcher.partition='a\\ntouch /tmp/wf_injected #' is not allowed: a single line"
        in proc.stderr
    ), proc.stderr
    assert "#SBATCH" not in proc.stdout and not Path("/tmp/wf_injected").exists()


@pytest.mark.parametrize("key", ["mail-type\nx", "mail type", "-begin", ""])
def test_malformed_sbatch_keys_are_refused(key: str) -> None:
    from wf_launch.config import ConfigError, EngineConfig
    from wf_launch.launchers.slurm import SlurmLauncherConfig, validate_slurm_launcher

    with pytest.raises(ConfigError, match="keys are sbatch option names"):
        validate_slurm_launcher(SlurmLauncherConfig(sbatch_extra={key: "END"}), EngineConfig(), 1)


def test_a_crafted_job_id_never_reaches_scancel(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(
        "launcher: {name: slurm}\nengine: {tp_size: 1, cp_size: 1, pp_size: 1, "
        "dp_size: 1, order: tp-cp-pp-dp}\n"
    )
    (run_dir / "slurm_job.json").write_text(json.dumps({"job_id": "--me", "world_size": 1}))
    shims = tmp_path / "bin"
    shims.mkdir()
    called = tmp_path / "called"
    for tool in ("scancel", "sacct", "squeue", "scontrol"):
        (shims / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {called}\n')
        (shims / tool).chmod(0o755)
    env = {**cli_env(), "PATH": f"{shims}:{os.environ['PATH']}"}
    proc = run_python_m(
        "wf_launch.status",
        ["--cancel", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "'--me' is not a SLURM job id" in proc.stderr
    assert not called.exists(), called.read_text()


def test_ports_and_requeue_targets() -> None:
    ports = [master_port(str(j), 0, {}) for j in range(5000, 5100)]
    assert len(set(ports)) == 100, (
        "consecutive job ids (sweep points on one node) must not share a port"
    )
    assert master_port("5000", 1, {}) != master_port("5000", 0, {})
    assert master_port("9", 0, {"SLURM_STEP_RESV_PORTS": "12000-12004"}) == 12000
    assert (
        requeue_target(
            {"SLURM_JOB_ID": "10", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "0"}
        )
        == "10_0"
    )
    assert requeue_target({"SLURM_JOB_ID": "11"}) == "11"


def _env(cluster: SlurmCluster, extra_path: Path | None = None) -> dict[str, str]:
    env = dict(cluster.env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    if extra_path is not None:
        env["PATH"] = f"{extra_path}:{env['PATH']}"
    return env


@pytest.mark.slurm
@pytest.mark.slow
def test_without_accounting_the_wait_still_ends(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "sacct").write_text(
        "#!/bin/sh\necho 'sacct: error: Slurm accounting storage is disabled' >&2\nexit 1\n"
    )
    (shims / "sacct").chmod(stat.S_IRWXU)
    run_dir = tmp_path / "run"
    proc = _cli(
        [SLURM, "task=noop", "engine.dp_size=2", "launcher.poll_interval_s=0.5"],
        run_dir,
        env=_env(slurm_cluster, shims),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads((run_dir / "result.json").read_text())
    assert res["status"] == "ok" and res["exit_code"] == 0


@pytest.mark.slurm
@pytest.mark.slow
def test_sigterm_to_a_waiting_launcher_stops_a_task_that_never_polls(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wf_launch",
            SLURM,
            "task=misbehave",
            TEST_TASKS,
            "task.how=sleep_all",
            "task.sleep_s=300",
            "engine.dp_size=2",
            f"hydra.run.dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(slurm_cluster),
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 120
    while not (
        (run_dir / "logs" / "rank1.log").exists()
        and "sleeping" in (run_dir / "logs" / "rank1.log").read_text()
    ):
        assert time.monotonic() < deadline and proc.poll() is None, "ranks never started"
        time.sleep(0.3)
    job_id = json.loads((run_dir / "slurm_job.json").read_text())["job_id"]
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        launcher_log = (run_dir / "launcher.log").read_text()[-4000:]
        pytest.fail(f"the launcher did not end within 180 s of SIGTERM:\n{err}\n{launcher_log}")
    assert proc.returncode == 143, err
    res = json.loads((run_dir / "result.json").read_text())
    assert res["status"] == "interrupted" and res["exit_code"] == 143, res
    assert res["signal"] == "SIGTERM" and res["failure"]["cause"] == "interrupt", res
    assert "continue it from the start (it saved no checkpoint)" in err, err
    assert slurm_cluster.run(["squeue", "-h", "-j", job_id], check=False).stdout.strip() == ""


@pytest.mark.slurm
@pytest.mark.slow
def test_a_stuck_rank_on_slurm_is_named_with_its_frame(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(
        [
            SLURM,
            "task=misbehave",
            TEST_TASKS,
            "task.how=stuck",
            "task.rank=2",
            "task.sleep_s=120",
            "engine.cp_size=2",
            "engine.dp_size=2",
            "launcher.nodes=2",
            "engine.distributed_timeout_minutes=0.1",
        ],
        run_dir,
        env=_env(slurm_cluster),
        timeout=240,
    )
    assert proc.returncode == 1, proc.stderr
    failure = json.loads((run_dir / "result.json").read_text())["failure"]
    assert failure["cause"] == "stuck" and failure["missing_ranks"] == [2], failure
    assert failure["stuck"]["2"]["function"] == "misbehave"
    # from a code snapshot the frame is the file's path in the project; without one (wheel), its
    # name
    assert (
        failure["stuck"]["2"]["frame"]
        .removeprefix("tests/user_tasks/")
        .startswith("wf_test_tasks.py:")
    )
    assert Path(failure["stuck"]["2"]["dump"]).is_file()


@pytest.mark.slurm
@pytest.mark.slow
def test_status_stacks_on_a_live_slurm_run(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(
        [
            SLURM,
            "task=misbehave",
            TEST_TASKS,
            "task.how=stuck",
            "task.rank=1",
            "task.sleep_s=300",
            "engine.dp_size=2",
            "launcher.wait=false",
        ],
        run_dir,
        env=_env(slurm_cluster),
    )
    assert proc.returncode == 0, proc.stderr
    try:
        deadline = time.monotonic() + 120
        while not all(
            (run_dir / "logs" / f"rank{r}.log").exists()
            and "ready" in (run_dir / "logs" / f"rank{r}.log").read_text()
            for r in range(2)
        ):
            assert time.monotonic() < deadline, "ranks never started"
            time.sleep(0.3)
        out = run_python_m(
            "wf_launch.status",
            ["--stacks", str(run_dir)],
            capture_output=True,
            text=True,
            env=_env(slurm_cluster),
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "stacks of 2/2 ranks" in out.stdout
        assert "rank 0 (tp0 cp0 pp0 dp0) waits in barrier at " in out.stdout
        assert "rank 1 (tp0 cp0 pp0 dp1) is at " in out.stdout and "in misbehave" in out.stdout
    finally:
        run_python_m(
            "wf_launch.status",
            ["--cancel", str(run_dir)],
            capture_output=True,
            text=True,
            env=_env(slurm_cluster),
            timeout=180,
        )


def test_status_lists_an_unreadable_record_and_goes_on(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    shims = tmp_path / "bin"
    shims.mkdir()
    for tool in ("sacct", "squeue", "scontrol"):
        (shims / tool).write_text("#!/bin/sh\nexit 1\n")
        (shims / tool).chmod(0o755)
    for n in range(2):
        run_dir = sweep / str(n)
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(
            "launcher: {name: slurm}\nengine: {tp_size: 1, cp_size: 1, pp_size: 1, "
            "dp_size: 1, order: tp-cp-pp-dp}\n"
        )
        (run_dir / "slurm_job.json").write_text(json.dumps({"job_id": f"4{n}", "world_size": 1}))
    (sweep / "0" / "result.json").write_text('{"status": "ok", "exit_co')
    (sweep / "1" / "result.json").write_text(
        json.dumps({"status": "ok", "exit_code": 0, "results": {"0": {}}})
    )
    env = {**cli_env(), "PATH": f"{shims}:{os.environ['PATH']}"}
    proc = run_python_m(
        "wf_launch.status",
        [str(sweep)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert f"{sweep / '0'}: unreadable: " in proc.stdout and "may be truncated" in proc.stdout, (
        proc.stdout + proc.stderr
    )
    assert f"{sweep / '1'}: SLURM job 41" in proc.stdout and "-> ok (exit 0)" in proc.stdout
    assert "sweep report: " in proc.stdout


@pytest.mark.slurm
@pytest.mark.slow
def test_a_one_node_slurm_job_listens_on_loopback_only(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(
        [SLURM, "task=listeners", TEST_TASKS, "engine.dp_size=2"],
        run_dir,
        env=_env(slurm_cluster),
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads((run_dir / "result.json").read_text())["results"]
    listening = [a for r in results.values() for a in r["listening"]]
    assert listening and [a for a in listening if not a.startswith("127.")] == [], results
