"""Unmodified torchrun scripts (tests/scripts/) on real ranks: through task=script, python -m
wf_launch.run and plain torchrun (to show they are unmodified and behave the same), task=call, the
python -m form, a sweep over a script's layout arguments, a fresh interpreter, and the drill on a
script that uses wf_launch's helpers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import (
    cli_env,
    leftover_processes,
    result,
    run_cli,
    run_python_m,
    start_cli,
    status,
    wait_for_log,
)

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def torchrun(
    script: str, args: list[str], cwd: Path, nproc: int = 2, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Plain ``torchrun --standalone --nproc-per-node N SCRIPT ARGS`` (no wf_launch in between).

    torch's C++ teardown can abort a rank at interpreter exit after all its work is done
    ("terminate called without an active exception", SIGABRT: wf_launch/rank/hardexit.py), and
    plain torchrun then fails the run (CI met it once). This is the baseline the tests compare
    wf_launch against, not wf_launch: a run that ended that way is run again (twice at most).
    """
    for _ in range(3):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nproc}",
                str(SCRIPTS / script),
                *args,
            ],
            capture_output=True,
            text=True,
            env=cli_env(),
            cwd=cwd,
            timeout=timeout,
        )
        if proc.returncode == 0 or TEARDOWN_ABORT not in proc.stderr:
            return proc
    return proc


TEARDOWN_ABORT = "terminate called without an active exception"


def wf_run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m wf_launch.run ARGS``: the torchrun command line on wf_launch."""
    return run_python_m(
        "wf_launch.run",
        [*args],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=cwd,
        timeout=timeout,
    )


def test_a_ddp_script_trains_the_same_under_torchrun_task_script_and_wf_launch_run(
    tmp_path: Path,
) -> None:
    args = ["--steps", "3", "--lr", "0.2", "--hidden", "12"]
    plain = torchrun("ddp_argparse.py", [*args, "--out", "torchrun.json"], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    ours = run_cli(
        [
            "task=script",
            f"task.path={SCRIPTS / 'ddp_argparse.py'}",
            "task.args=[--steps,3,--lr,0.2,--hidden,12,--out,script.json]",
            "engine.dp_size=2",
        ],
        tmp_path / "run",
    )
    assert ours.returncode == 0, ours.stderr[-3000:]
    cmd = wf_run(
        [
            "--nproc-per-node",
            "2",
            "--run-dir",
            "run2",
            str(SCRIPTS / "ddp_argparse.py"),
            *args,
            "--out",
            "run.json",
        ],
        tmp_path,
    )
    assert cmd.returncode == 0, cmd.stderr[-3000:]
    got = {
        name: json.loads((tmp_path / f"{name}.json").read_text())
        for name in ("torchrun", "script", "run")
    }
    assert len({(g["final_loss"], g["weights_sha256"]) for g in got.values()}) == 1, got
    for g in got.values():
        assert g["argv"][1:] == [*args, "--out", g["argv"][-1]] and g["cwd"] == str(tmp_path)
        assert all(g["env"][k] for k in TORCHRUN_VARS), g["env"]
        assert (
            g["env"]["WORLD_SIZE"]
            == g["env"]["LOCAL_WORLD_SIZE"]
            == g["env"]["ROLE_WORLD_SIZE"]
            == "2"
        )
    for run_dir in (tmp_path / "run", tmp_path / "run2"):
        record = result(run_dir)
        assert (
            record["status"] == "ok" and record["task"] == "script" and record["layout"]["dp"] == 2
        )
        assert record["results"] == {"0": {"exit_code": 0}, "1": {"exit_code": 0}}
        assert "rank 1 step 2 loss" in (run_dir / "logs" / "rank1.log").read_text()
        assert (run_dir / "logs" / "rank0.exit.json").exists()
    assert "run ok in" in cmd.stderr and str(tmp_path / "run2" / "result.json") in cmd.stderr


def test_sys_exit_on_one_rank_fails_with_that_code_and_names_the_rank(tmp_path: Path) -> None:
    proc = wf_run(
        [
            "--nproc-per-node",
            "3",
            "--run-dir",
            "run",
            str(SCRIPTS / "exit_on_rank.py"),
            "--rank",
            "2",
            "--code",
            "3",
        ],
        tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "rank 2 exited with code 3 at exit_on_rank.py:21 in main (r2 tp0 cp0 pp0 dp2)"
        in proc.stderr
    ), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr  # the rank log keeps it
    record = result(tmp_path / "run")
    failure = record["failure"]
    assert record["status"] == "failed" and record["exits"]["2"] == 3
    assert (
        failure["rank"] == 2
        and failure["exit_code"] == 3
        and failure["coords"] == {"tp": 0, "cp": 0, "pp": 0, "dp": 2}
    )
    assert "gives up with exit code 3" in (tmp_path / "run" / "logs" / "rank2.log").read_text()
    plain = torchrun("exit_on_rank.py", ["--rank", "1", "--code", "3"], tmp_path)
    assert plain.returncode == 1 and "exitcode  : 3" in plain.stderr, plain.stderr[-3000:]
    assert leftover_processes(str(SCRIPTS / "exit_on_rank.py")) == []


def test_a_hang_in_a_fresh_interpreter_is_seen_by_status_stacks_and_named_by_the_autopsy(
    tmp_path: Path,
) -> None:
    """task.fresh_interpreter=true: the supervisor passes the stack-dump signal on; the stuck rank
    and its frame are the root cause once its peer's collective times out."""
    run_dir = tmp_path / "run"
    proc = start_cli(
        [
            "task=script",
            f"task.path={SCRIPTS / 'hang_on_rank.py'}",
            "task.fresh_interpreter=true",
            "task.args=[--rank,1,--timeout-s,10]",
            "engine.dp_size=2",
        ],
        run_dir,
    )
    try:
        wait_for_log(run_dir / "logs" / "rank1.pid", "pid", timeout=60)
        deadline = time.monotonic() + 60
        stacks = None
        while time.monotonic() < deadline:
            stacks = status("--stacks", str(run_dir))
            if "slow_data_loader" in stacks.stdout:
                break
            time.sleep(1)
        assert (
            stacks is not None and "rank 1" in stacks.stdout and "slow_data_loader" in stacks.stdout
        ), stacks.stdout
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    failure = result(run_dir)["failure"]
    assert failure["cause"] == "stuck" and failure["missing_ranks"] == [1], failure
    assert (
        failure["stuck"]["1"]["function"] == "slow_data_loader"
        and "hang_on_rank.py" in failure["stuck"]["1"]["frame"]
    )
    assert "collective timed out: rank 1 (r1 tp0 cp0 pp0 dp1) never arrived" in err
    assert leftover_processes(str(run_dir)) == []
    plain = torchrun(
        "hang_on_rank.py", ["--rank", "1", "--timeout-s", "2", "--sleep-s", "30"], tmp_path
    )
    assert plain.returncode == 1 and "Timed out waiting 2000ms" in plain.stderr, plain.stderr[
        -3000:
    ]


def test_a_killed_rank_restarts_and_rejoins_late_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """kill -9 of a rank under --max-restarts: its supervisor dies of the same signal (fresh
    interpreter), the group restarts with a fresh store, and a rank that re-joins late still finds
    its peers (torchrun 2.13 reads the first attempt's addresses there and fails)."""
    proc = wf_run(
        [
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--set",
            "task.fresh_interpreter=true",
            "--run-dir",
            "run",
            str(SCRIPTS / "restart_late.py"),
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = result(tmp_path / "run")
    assert [a["ended_by"] for a in record["attempts"]] == ["rank 1 killed by SIGKILL", "completed"]
    assert "attempt 1 rank 1 sum 2.0" in (tmp_path / "run" / "logs" / "rank1.log").read_text()


def test_a_script_that_never_starts_a_group_runs_on_every_rank(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        [
            "task=script",
            f"task.path={SCRIPTS / 'no_group.py'}",
            f"task.args=[--out-dir,{tmp_path}/ours]",
            "engine.dp_size=3",
        ],
        run_dir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result(run_dir)["results"] == {str(r): {"exit_code": 0} for r in range(3)}
    seen = [json.loads((tmp_path / "ours" / f"rank{r}.json").read_text()) for r in range(3)]
    assert [s["env"]["RANK"] for s in seen] == ["0", "1", "2"] and seen[0]["env"][
        "WF_RUN_DIR"
    ] == str(run_dir)
    plain = torchrun("no_group.py", ["--out-dir", str(tmp_path / "plain")], tmp_path, nproc=3)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [
        "rank0.json",
        "rank1.json",
        "rank2.json",
    ]


def test_a_sweep_passes_each_points_layout_to_the_scripts_arguments(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "-m",
            "task=script",
            f"task.path={SCRIPTS / 'no_group.py'}",
            "task.args=[--out-dir,out${engine.cp_size},--cp,${engine.cp_size}]",
            "engine.cp_size=1,2",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for point, cp in (("0", 1), ("1", 2)):
        record = result(sweep / point)
        assert record["status"] == "ok" and record["layout"]["world_size"] == cp
        argv = json.loads((tmp_path / f"out{cp}" / "rank0.json").read_text())["argv"]
        assert argv[1:] == ["--out-dir", f"out{cp}", "--cp", str(cp)]


def test_task_call_and_the_python_m_form(tmp_path: Path) -> None:
    pkg = tmp_path / "mytrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import sys\nimport torch, torch.distributed as dist\nfrom worldfoundry.core.distributed "
        "import dist_init, "
        "get_layout\nfrom wf_launch import report_result\n\n\ndef main(lr=0.1, ctx=None):\n    "
        "dist_init()\n"
        "    t = torch.ones(1)\n    dist.all_reduce(t)\n    report_result({'layout': "
        "get_layout().describe()})\n"
        "    return {'lr': lr, 'sum': t.item(), 'ctx_rank': ctx.rank if ctx else None}\n\n\n"
        "if __name__ == '__main__':\n    out = main(float(sys.argv[2]))\n    "
        "report_result({'argv': sys.argv[1:]})\n"
    )
    call = run_cli(
        ["task=call", "task.target=mytrain.train:main", "task.kwargs={lr:0.5}", "engine.cp_size=2"],
        tmp_path / "call",
    )
    assert call.returncode == 0, call.stderr[-3000:]
    res = result(tmp_path / "call")["results"]
    assert res["1"]["lr"] == 0.5 and res["1"]["sum"] == 2.0 and res["1"]["ctx_rank"] == 1
    assert res["0"]["layout"].startswith("tp=1 cp=2 pp=1 dp=1")
    module = wf_run(
        [
            "--nproc-per-node",
            "2",
            "--set",
            "engine.cp_size=2",
            "--run-dir",
            "mod",
            "-m",
            "mytrain.train",
            "--lr",
            "0.3",
        ],
        tmp_path,
    )
    assert module.returncode == 0, module.stderr[-3000:]
    res = result(tmp_path / "mod")["results"]["0"]
    assert (
        res["argv"] == ["--lr", "0.3"]
        and res["layout"].startswith("tp=1 cp=2 pp=1 dp=1")
        and res["exit_code"] == 0
    )


def test_the_drill_on_a_script_with_the_helpers_and_the_same_script_under_torchrun(
    tmp_path: Path,
) -> None:
    """kill -9 of a rank (max_restarts) and SIGTERM to the launcher (stop flag, checkpoint, resume)
    end bitwise identical to an uninterrupted run; under plain torchrun the helpers are no-ops and
    it trains the same."""
    args = ["--steps", "10", "--step-sleep", "0.15"]
    drill = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch.drill",
            "task=script",
            f"task.path={SCRIPTS / 'helpers_train.py'}",
            f"task.args=[{','.join(args)}]",
            "engine.dp_size=2",
            "--inject",
            "kill9@3,sigterm@6",
            "--dir",
            str(tmp_path / "drill"),
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        timeout=300,
    )
    assert drill.returncode == 0, drill.stdout + drill.stderr[-3000:]
    summary = json.loads((tmp_path / "drill" / "drill.json").read_text())
    assert summary["identical"] and len(summary["attempts"]) == 3, summary
    reference = tmp_path / "drill" / "reference"
    assert result(reference)["results"]["0"]["steps_done"] == 10
    lines = (reference / "metrics.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in lines} == set(range(1, 11))
    progress = json.loads((reference / "logs" / "rank1.progress.json").read_text())
    assert progress["step"] == progress["total"] == 10
    plain = torchrun("helpers_train.py", [*args, "--out", "plain.json"], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    got = json.loads((tmp_path / "plain.json").read_text())
    assert (
        got["weights_sha256"] == summary["reference"]["weights_sha256"] and got["steps_done"] == 10
    )
    assert not (tmp_path / "checkpoints").exists()


def test_a_script_with_the_helpers_resumes_at_another_layout(tmp_path: Path) -> None:
    """docs/scripts.md's example: 2 ranks fail at step 5 after the checkpoint of step 4; the resume
    on 1 rank loads the model and the replicated ``progress`` and finishes the 8 steps."""
    run_dir = tmp_path / "run"
    script = [f"task.path={SCRIPTS / 'helpers_train.py'}", "task=script"]
    failed = run_cli([*script, "task.args=[--steps,8,--fail-at,5]", "engine.dp_size=2"], run_dir)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "RuntimeError: step 5 fails, as asked" in failed.stderr
    resumed = run_cli(
        [*script, "task.args=[--steps,8]", "engine.dp_size=1", "launcher.resume=true"], run_dir
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = result(run_dir)
    last = record["attempts"][-1]
    assert last["resumed_from"] == 4 and last["layout_to"]["dp"] == 1, last
    assert last["layout_from"]["dp"] == 2 and record["results"]["0"]["steps_done"] == 8
