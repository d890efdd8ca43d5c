"""The tests' fork server runs a command as a fresh ``python -m`` would (``tests/cli_server.py``).

Most CLI tests hold the CLI's behaviour through it, so what it changes would weaken them all:
these hold its streams, working directory, environment, ``sys.path``, session, command line and
exit status to those of a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from cli_helpers import cli_env, python_m, run_python_m

PROBE = """
import json, os, sys
print(json.dumps({"cwd": os.getcwd(), "env": os.environ.get("WF_PROBE"), "path0": sys.path[0],
                  "argv": sys.argv, "name": __name__, "stdin": sys.stdin.read(),
                  "pgid": os.getpgid(0), "pid": os.getpid()}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("WF_PROBE_EXIT", "0")))
"""


def _probe(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "wf_probe_mod.py").write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    return cli_env({"PYTHONPATH": str(tmp_path), "WF_PROBE": "yes", "WF_PROBE_EXIT": "3"})


def test_a_forked_command_gets_its_streams_cwd_env_path_and_exit_status(tmp_path: Path) -> None:
    env = _probe(tmp_path)
    done = run_python_m(
        "wf_probe_mod", ["a", "b"], input="typed", capture_output=True, text=True,
        env=env, cwd=tmp_path / "work", timeout=60,
    )  # fmt: skip
    fresh = subprocess.run(
        [sys.executable, "-m", "wf_probe_mod", "a", "b"], input="typed", capture_output=True,
        text=True, env=env, cwd=tmp_path / "work", timeout=60,
    )  # fmt: skip
    forked, real = json.loads(done.stdout), json.loads(fresh.stdout)
    assert (done.returncode, done.stderr) == (fresh.returncode, fresh.stderr) == (3, "to stderr\n")
    for key in ("cwd", "env", "path0", "argv", "name", "stdin"):
        assert forked[key] == real[key], key
    assert forked["pgid"] == os.getpgid(0)  # no new session unless asked, as Popen


def test_a_forked_command_is_a_real_process_a_test_can_signal(tmp_path: Path) -> None:
    env = _probe(tmp_path)
    (tmp_path / "wf_sleep_mod.py").write_text("import time\ntime.sleep(120)\n")
    sleeper = python_m(
        "wf_sleep_mod", ["--marker", str(tmp_path)], env=env, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    cmdline = " ".join(filter(None, psutil.Process(sleeper.pid).cmdline()))
    assert cmdline.endswith(f"-m wf_sleep_mod --marker {tmp_path}"), cmdline
    assert sleeper.poll() is None
    assert os.getpgid(sleeper.pid) == sleeper.pid
    sleeper.kill()
    assert sleeper.wait(timeout=30) == -signal.SIGKILL
    quick = python_m("wf_probe_mod", [], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while quick.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert quick.returncode == 3


def test_two_forked_commands_in_one_second_get_their_own_run_directories(tmp_path: Path) -> None:
    """The default run directory ends in the command's own ``${wf_uid:}``: set when the command
    starts, not when the module was imported (the server imported it once for every child)."""
    procs = [
        python_m(
            "wf_launch",
            ["task=noop"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=cli_env(),
            cwd=tmp_path,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    runs = sorted(p.parent.name for p in (tmp_path / "outputs").glob("*/*/result.json"))
    assert len(runs) == 2 and len({r.rpartition("-")[2] for r in runs}) == 2, runs
