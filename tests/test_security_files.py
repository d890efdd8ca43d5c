"""Run directories: owner-only whatever the umask, a refused or dry launch writes nothing, a live
run is never moved or written over, and liveness is the lock itself (issue 19, items 3, 10, 11, 13;
issue 24's dry run)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cli_helpers import cli_env, result, run_cli, run_python_m

from wf_launch.rundir.claim import RunDirInUse, claim, launch_alive

SLURM_CONFIG = (
    "launcher: {name: slurm}\nengine: {tp_size: 1, cp_size: 1, pp_size: 1, dp_size: 1, "
    "order: tp-cp-pp-dp}\ntask: {name: noop}\n"
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cli(
    args: list[str],
    cwd: Path,
    umask: int = 0o002,
    env: dict[str, str] | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess:
    """The CLI with a group-writable umask (as on many shared clusters)."""
    return run_python_m(
        "wf_launch",
        [*args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or cli_env(),
        cwd=cwd,
        preexec_fn=lambda: os.umask(umask),
    )


def _group_or_other_writable(root: Path) -> list[str]:
    return [
        str(p) for p in [root, *root.rglob("*")] if not p.is_symlink() and p.stat().st_mode & 0o022
    ]


# ----------------------------------------------------------------------------------- item 3:
# permissions


@pytest.mark.slow
def test_overwrite_moves_the_old_run_into_an_owner_only_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert _cli(["task=noop", f"hydra.run.dir={run_dir}"], tmp_path).returncode == 0
    proc = _cli(["task=noop", "launcher.overwrite=true", f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    aside = next(p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-"))
    assert _mode(aside) == 0o700 and _mode(run_dir) == 0o700
    assert result(aside)["status"] == "ok" and (aside / ".hydra" / "overrides.yaml").is_file()
    assert _group_or_other_writable(run_dir) == [] and _group_or_other_writable(aside) == []


def test_an_invalid_config_leaves_an_owner_only_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _cli(["task=noop", "engine.order='sekrit-token'", f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert result(run_dir)["status"] == "invalid"
    assert _mode(run_dir) == 0o700


def test_run_dir_mode_never_gives_others_write_access(tmp_path: Path) -> None:
    for mode in ("0770", "0777", "0722"):
        proc = run_cli(["task=noop", f"launcher.run_dir_mode='{mode}'"], tmp_path / f"run{mode}")
        assert proc.returncode == 2 and "gives no one else write access" in proc.stderr, proc.stderr
    proc = run_cli(
        ["task=noop", "launcher.run_dir_mode='0750'", "launcher.dry_run=true"], tmp_path / "run"
    )
    assert proc.returncode == 0, proc.stderr


def _fake_sbatch(tmp_path: Path) -> dict[str, str]:
    """sbatch answers with a job id and SLURM's other commands say nothing: a submission that
    reaches no cluster."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
    for tool in ("sacct", "squeue", "scontrol", "scancel"):
        (shims / tool).write_text("#!/bin/sh\nexit 1\n")
    for tool in shims.iterdir():
        tool.chmod(0o755)
    return cli_env({"PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"})


def test_a_slurm_sweeps_pickles_and_code_are_owner_only_under_a_group_writable_umask(
    tmp_path: Path,
) -> None:
    sweep = tmp_path / "sweep"
    proc = _cli(
        [
            "-m",
            "launcher=slurm",
            "task=noop",
            "launcher.wait=false",
            "engine.dp_size=1,2",
            f"hydra.sweep.dir={sweep}",
        ],
        tmp_path,
        env=_fake_sbatch(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "submitit").is_dir() and (sweep / "0" / "slurm_job.json").is_file()
    assert _mode(sweep) == 0o700 and _mode(sweep / "submitit") == 0o700
    if (sweep / "code").exists():  # a checkout (not an installed wheel): the snapshot too
        assert _mode(sweep / "code") == 0o700
    assert _group_or_other_writable(sweep) == []


# ----------------------------------------------------------------------------------- item 11, issue
# 24


def test_a_dry_run_writes_nothing(tmp_path: Path) -> None:
    proc = _cli(["task=noop", "launcher.dry_run=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    sweep = _cli(["-m", "task=noop", "launcher.dry_run=true", "engine.dp_size=1,2"], tmp_path)
    assert sweep.returncode == 0, sweep.stderr
    assert "launcher      local" in proc.stdout and "launcher      local" in sweep.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_refused_launch_leaves_the_runs_hydra_record_as_it_was(tmp_path: Path) -> None:
    from wf_launch.readers.sweep.points import collect_points

    sweep = tmp_path / "sweep"
    first = _cli(["-m", "task=noop", "engine.dp_size=1", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert first.returncode == 0, first.stderr
    point = sweep / "0"
    before = {p.name: p.read_bytes() for p in (point / ".hydra").iterdir()}
    again = _cli(["task=noop", "engine.dp_size=2", f"hydra.run.dir={point}"], tmp_path)
    assert again.returncode == 2 and "already holds a run" in again.stderr
    assert {p.name: p.read_bytes() for p in (point / ".hydra").iterdir()} == before
    (point / "result.json").unlink()  # the sweep report falls back to Hydra's record
    assert collect_points(sweep)[0]["overrides"] == "task=noop engine.dp_size=1"


# ----------------------------------------------------------------------------------- item 10: a
# live run


def _slurm_run(tmp_path: Path, squeue_state: str) -> tuple[Path, dict[str, str]]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(SLURM_CONFIG)
    (run_dir / "slurm_job.json").write_text(json.dumps({"job_id": "77", "world_size": 1}))
    (run_dir / "result.json").write_text(json.dumps({"status": "submitted", "launcher": "slurm"}))
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "squeue").write_text(f"#!/bin/sh\necho '{squeue_state}'\n")
    for tool in ("sacct", "scontrol"):
        (shims / tool).write_text("#!/bin/sh\nexit 1\n")
    for tool in shims.iterdir():
        tool.chmod(0o755)
    return run_dir, cli_env({"PATH": f"{shims}{os.pathsep}{os.environ['PATH']}"})


@pytest.mark.parametrize("flag", ["launcher.overwrite=true", "launcher.resume=true"])
def test_overwrite_or_resume_of_a_running_slurm_job_is_refused(tmp_path: Path, flag: str) -> None:
    run_dir, env = _slurm_run(tmp_path, "RUNNING")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    proc = _cli(["task=noop", flag, f"hydra.run.dir={run_dir}"], tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "holds a run that is still going" in proc.stderr and "--cancel" in proc.stderr
    assert {
        p.name: p.read_bytes() for p in run_dir.iterdir() if p.name != ".wf_launch.lock"
    } == before
    assert not [p for p in tmp_path.iterdir() if ".replaced-" in p.name]


def test_overwrite_of_an_ended_slurm_job_goes_ahead(tmp_path: Path) -> None:
    run_dir, env = _slurm_run(tmp_path, "")
    proc = _cli(
        ["task=noop", "launcher.overwrite=true", f"hydra.run.dir={run_dir}"], tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert result(run_dir)["status"] == "ok"


# ----------------------------------------------------------------------------------- item 13: the
# lock


def test_liveness_is_the_lock_not_the_pid(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / ".wf_launch.lock"
    lock.write_text(
        f"{os.getppid()} {socket.gethostname()}\n"
    )  # a live process that holds no lock: a reused pid
    assert launch_alive(run_dir) is False
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1]); "
            "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
            str(lock),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        lock.write_text(
            "4194000 another-host\n"
        )  # a launch on another host of a shared file system
        assert launch_alive(run_dir) is True
        with pytest.raises(
            RunDirInUse, match="in use by a live launch \\(pid 4194000 on another-host\\)"
        ):
            claim(run_dir)
    finally:
        holder.kill()
        holder.wait()
    assert launch_alive(run_dir) is False


def test_a_run_whose_lock_names_a_reused_pid_reads_unknown(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(SLURM_CONFIG.replace("slurm", "local"))
    (run_dir / "logs").mkdir()
    (run_dir / ".wf_launch.lock").write_text(f"{os.getpid()} {socket.gethostname()}\n")
    env = cli_env()
    status = run_python_m(
        "wf_launch.status",
        [str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert status.returncode == 3 and "-> unknown (exit 3)" in status.stdout, (
        status.stdout + status.stderr
    )
    follow = run_python_m(
        "wf_launch.status",
        ["--follow", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert follow.returncode == 3, follow.stderr
    runs = run_python_m(
        "wf_launch.runs",
        [str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert json.loads(runs.stdout)[0]["status"] == "unknown"


def test_the_claim_records_pid_and_host_and_a_reader_never_blocks_a_claim(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with claim(run_dir):
        assert (run_dir / ".wf_launch.lock").read_text().split() == [
            str(os.getpid()),
            socket.gethostname(),
        ]
        assert _mode(run_dir) == 0o700
        assert launch_alive(run_dir) is False  # this process's own claim is not another live launch
    fd = os.open(run_dir / ".wf_launch.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a reader testing the lock, for a moment
    threading.Timer(0.1, os.close, [fd]).start()
    with claim(run_dir, overwrite=True):
        pass
