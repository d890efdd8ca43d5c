"""Ray instances another local user cannot reach (issue 29, item 1).

A private instance (``launcher=ray``, no address) and the test cluster of
``scripts/ray_cluster.sh`` listen on 127.0.0.1 only, keep their token and temp dirs owner-only
(nothing in ``~/.ray``), and leave nothing behind. As root, a real second Unix user is made to
try to read the token and the run directory, and a client without the token (what that user
can hold) is refused by the GCS.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from ray_fixture import RayCluster, cluster_env

from wf_launch.launchers.ray.cluster import marked_pids, private_marker

pytestmark = [pytest.mark.ray, pytest.mark.slow]
LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1", "::1")
TEST_TASKS = "task.modules=[wf_test_tasks]"


def _listening(pids: set[int]) -> list[str]:
    """'ip:port (name)' of every listening TCP socket of ``pids``."""
    found = []
    for conn in psutil.net_connections("inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            found.append(f"{conn.laddr.ip}:{conn.laddr.port} ({psutil.Process(conn.pid).name()})")
    return found


def _exposed(listening: list[str]) -> list[str]:
    return [s for s in listening if s.split(" ")[0].rpartition(":")[0] not in LOOPBACK]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _as(user: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", *cmd], capture_output=True, text=True)


_GCS_PROBE = """
import sys
from ray._raylet import GcsClient  # the GCS's own client: no address rewriting, no retries
try:
    nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=20)
except Exception as exc:
    print(f"refused: {type(exc).__name__}")
else:
    print(f"joined: {len(nodes)} node(s)")
"""


def _gcs_probe(address: str, home: Path, token_file: Path | None = None) -> str:
    """What a client that is not the run's owner gets from the GCS at ``address``: an empty
    home (no ``~/.ray``), no token in its environment unless ``token_file`` is given (the
    owner's own view, the control)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    if token_file is not None:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_file))
    out = subprocess.run(
        [sys.executable, "-c", _GCS_PROBE, address],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return (out.stdout.strip().splitlines() or [out.stderr[-500:]])[-1]


def test_the_test_cluster_listens_on_loopback_only_with_its_own_token(
    ray_cluster: RayCluster,
) -> None:
    status = ray_cluster.script("status")
    procs = status.stdout.partition("--- nodes")[0].splitlines()
    pids = {int(line.split()[0]) for line in procs if line.split()[0].isdigit()}
    assert pids, status.stdout + status.stderr
    listening = _listening(pids)
    port = ray_cluster.address.rpartition(":")[2]
    assert any(s.split(" ")[0].endswith(f":{port}") for s in listening), listening  # the GCS
    assert _exposed(listening) == [], listening
    state = ray_cluster.dir
    assert _mode(state) == 0o700 and _mode(state / "auth_token") == 0o600
    temp = Path(
        next(
            line.partition("=")[2]
            for line in (state / "cluster.env").read_text().splitlines()
            if line.startswith("TEMP=")
        )
    )
    base = temp.parent  # Ray makes its own dirs 0777: the dir above them is the run's, 0700
    assert base.parent == Path("/tmp") and base.name != f"wfray-{port}"  # not predictable
    assert _mode(base) == 0o700 and base.stat().st_uid == os.getuid()
    stranger = Path(tempfile.mkdtemp(prefix="wf-ray-stranger-"))
    try:  # whoever cannot read the token (its modes above) cannot join: the GCS refuses it
        assert _gcs_probe(ray_cluster.address, stranger) == "refused: AuthenticationError"
        assert _gcs_probe(ray_cluster.address, stranger, state / "auth_token").startswith("joined")
    finally:
        subprocess.run(["rm", "-rf", str(stranger)], check=False)


def test_the_cluster_script_refuses_a_temp_or_state_dir_it_did_not_make(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "something").write_text("not the script's")
    script = Path(__file__).resolve().parents[1] / "scripts" / "ray_cluster.sh"
    for cmd in ("start", "stop"):
        out = subprocess.run(
            ["bash", str(script), cmd, "--dir", str(foreign)], capture_output=True, text=True
        )
        assert out.returncode == 1 and "was not made by ray_cluster.sh" in out.stderr, out.stderr
    assert (foreign / "something").read_text() == "not the script's"


def _wait(what: str, check: object, proc: subprocess.Popen[str], timeout: float = 240) -> None:
    """Until ``check()`` holds (the launch still running); fails with the launcher's output."""
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{what} never happened:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.2)


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A folder every user may enter (as /tmp is): only the run's own modes protect it."""
    base = Path(tempfile.mkdtemp(prefix="wf-ray-shared-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_a_private_instance_is_loopback_only_owner_only_and_leaves_nothing(
    shared_base: Path, request: pytest.FixtureRequest
) -> None:
    run, home = shared_base / "run", shared_base / "home"
    home.mkdir(mode=0o700)
    env = {k: v for k, v in cluster_env().items() if not k.startswith(("RAY_AUTH", "RAY_ENABLE"))}
    env["HOME"] = str(home)  # a token in ~/.ray would show here
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher=ray",
            "engine.dp_size=2",
            "task=misbehave",
            "task.how=sleep_all",
            "task.sleep_s=600",
            TEST_TASKS,
            f"hydra.run.dir={run}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=shared_base,
    )
    try:
        logs = [run / "logs" / f"rank{r}.log" for r in (0, 1)]
        _wait(
            "both ranks sleeping",
            lambda: all(p.exists() and "sleeping" in p.read_text() for p in logs),
            proc,
        )
        info = json.loads((run / "ray_run.json").read_text())
        pids = set(marked_pids(private_marker(str(run))))
        listening = _listening(pids)
        assert len(listening) >= 4 and _exposed(listening) == [], listening
        token = Path(info["token_file"])
        temp = token.parent
        assert _mode(token) == 0o600 and _mode(temp) == 0o700 and temp.parent == Path("/tmp")
        assert not (home / ".ray").exists()
        assert _mode(run) == 0o700
        # The attack of issue 29: join the instance as a node without the owner's token (another
        # user cannot read it: below). The GCS refuses a client without it at once; the owner's
        # token (the control) is let in.
        stranger = shared_base / "stranger"
        stranger.mkdir()
        assert _gcs_probe(info["address"], stranger) == "refused: AuthenticationError"
        assert _gcs_probe(info["address"], stranger, token) == "joined: 1 node(s)"
        assert not (stranger / ".ray").exists()
        if os.geteuid() == 0:
            user = request.getfixturevalue("other_user")
            assert pwd.getpwnam(user).pw_uid != 0
            for what in (token, temp):
                denied = _as(user, "cat" if what.is_file() else "ls", str(what))
                assert denied.returncode != 0 and "Permission denied" in denied.stderr
            denied = _as(user, "ls", str(run))
            assert denied.returncode != 0 and "Permission denied" in denied.stderr
            assert _as(user, "ls", str(shared_base)).returncode == 0  # the base is open to it
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert marked_pids(private_marker(str(run))) == []
    assert not temp.exists()
    assert not (home / ".ray").exists()
