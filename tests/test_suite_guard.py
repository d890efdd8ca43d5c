"""The suite's own machinery, on small suites in a temporary folder that use the real
conftest and fixtures: a test that uses a cluster must carry its marker, the tests of each
cluster share one xdist worker, and a test cluster never outlives the pytest that started it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import cluster_guard
import psutil
import pytest

TESTS = Path(__file__).parent
REPO = TESTS.parent
SUPPORT = ("conftest.py", "slurm_fixture.py", "ray_fixture.py", "cluster_guard.py")
INI = "[pytest]\nmarkers =\n    slow: s\n    slurm: s\n    ray: r\n"


def make_suite(root: Path, files: dict[str, str]) -> Path:
    """A suite under ``root`` whose conftest and fixtures are the real ones (linked, so that
    they find the repository's scripts), with the test files given."""
    tests = root / "tests"
    tests.mkdir(parents=True)
    for name in SUPPORT:
        (tests / name).symlink_to(TESTS / name)
    (root / "pytest.ini").write_text(INI)
    for name, text in files.items():
        (tests / name).write_text(textwrap.dedent(text))
    return root


def suite_env(tmp: Path, **extra: str) -> dict[str, str]:
    """An environment without the outer run's cluster or xdist variables, TMPDIR ``tmp``."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "SLURM_")) and k != "CI"
    }
    tmp.mkdir(parents=True, exist_ok=True)
    return {**env, "TMPDIR": str(tmp), **extra}


def run_suite(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=env,
        text=True,
        capture_output=True,
        timeout=240,
    )


@pytest.mark.slow
def test_a_test_that_uses_a_cluster_without_its_marker_is_refused(tmp_path: Path) -> None:
    root = make_suite(
        tmp_path,
        {
            "test_bare.py": """
                import pytest

                @pytest.fixture
                def on_ray(ray_cluster):
                    return ray_cluster

                def test_slurm_unmarked(slurm_cluster):
                    pass

                def test_ray_through_a_fixture(on_ray):
                    pass

                @pytest.mark.slurm
                @pytest.mark.ray
                def test_both():
                    pass

                @pytest.mark.slurm
                def test_marked():
                    pass
            """
        },
    )
    out = run_suite(root, suite_env(tmp_path / "tmp"), "-n", "0", "-q", "-rE")
    assert out.returncode == pytest.ExitCode.TESTS_FAILED, out.stdout + out.stderr
    assert "1 passed, 3 errors" in out.stdout, out.stdout
    for line in (
        "test_slurm_unmarked uses slurm_cluster but is not marked slurm",
        "test_ray_through_a_fixture uses ray_cluster but is not marked ray",
        "test_both is marked slurm and ray",
    ):
        assert line in out.stdout, out.stdout


RECORD = """
    import os

    import pytest

    def record(kind):
        with open(os.environ["WF_LOG"], "a") as log:
            log.write(f"{kind} {os.environ['PYTEST_XDIST_WORKER']}\\n")

"""
MODULE_MARKED = """
    pytestmark = pytest.mark.{kind}

    @pytest.mark.parametrize("i", range(3))
    def test_{kind}_module(i):
        record("{kind}")
"""
FUNCTIONS_MARKED = """
    @pytest.mark.slurm
    @pytest.mark.parametrize("i", range(3))
    def test_slurm(i):
        record("slurm")

    @pytest.mark.ray
    @pytest.mark.parametrize("i", range(3))
    def test_ray(i):
        record("ray")

    @pytest.mark.parametrize("i", range(6))
    def test_plain(i):
        record("plain")
"""


@pytest.mark.slow
def test_the_tests_of_each_cluster_share_one_worker(tmp_path: Path) -> None:
    """Marked on the module or on functions, across files: each kind on one worker."""
    root = make_suite(
        tmp_path,
        {
            "test_a.py": RECORD + MODULE_MARKED.format(kind="slurm"),
            "test_b.py": RECORD + FUNCTIONS_MARKED,
            "test_c.py": RECORD + MODULE_MARKED.format(kind="ray"),
        },
    )
    log = tmp_path / "log"
    env = suite_env(tmp_path / "tmp", WF_LOG=str(log))
    out = run_suite(root, env, "-n", "3", "--dist", "loadgroup", "-q")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.split() for line in log.read_text().splitlines()]
    assert len(lines) == 18, lines
    for kind in ("slurm", "ray"):
        assert len({worker for k, worker in lines if k == kind}) == 1, lines


HOLDING_TEST = """
    import os
    import time
    from pathlib import Path

    import pytest

    @pytest.mark.slurm
    def test_hold(slurm_cluster):
        Path(os.environ["WF_READY"]).write_text(str(slurm_cluster.dir))
        time.sleep(600)
"""


class Holder:
    """A pytest (in a process group of its own) whose test holds a SLURM cluster it started."""

    def __init__(self, root: Path, tmp: Path, name: str) -> None:
        self.ready = tmp.parent / f"{name}.ready"
        tmp.mkdir(exist_ok=True)
        tmp.chmod(0o755)
        self.log = tmp.parent / f"{name}.log"
        env = suite_env(tmp, WF_READY=str(self.ready))
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-s"],
                cwd=root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.state = self.wait_ready()
        self.daemons = [int(p.read_text()) for p in sorted((self.state / "run").glob("*.pid"))]
        assert len(self.daemons) == 6 and self.running(), self.daemons

    def wait_ready(self, timeout_s: float = 240) -> Path:
        deadline = time.monotonic() + timeout_s
        while not self.ready.exists():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the holding test never got its cluster"
            time.sleep(0.2)
        return Path(self.ready.read_text())

    def running(self) -> list[int]:
        return [p for p in self.daemons if psutil.pid_exists(p) and alive(p)]

    def guardian(self) -> psutil.Process:
        (found,) = [
            p
            for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and p.info["cmdline"][-2:] == ["guard", str(self.state)]
        ]
        return found

    def kill(self, sig: int) -> int:
        os.killpg(self.proc.pid, sig)
        return self.proc.wait(timeout=120)

    def wait_stopped(self, timeout_s: float = 120) -> None:
        """The cluster's daemons all end, its folder goes, then its claim (the event we wait
        on)."""
        deadline = time.monotonic() + timeout_s
        claim = cluster_guard.claim_file(self.state)
        while self.running() or self.state.exists() or claim.exists():
            assert time.monotonic() < deadline, f"still running: {self.running()}"
            time.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.slurm
def test_a_killed_run_leaves_no_slurm_cluster(tmp_path: Path) -> None:
    """Three nets, each alone: SIGTERM of pytest (the fixture's teardown, its guardian killed
    first); SIGKILL of pytest and its guardian (the next start reaps it); SIGKILL of pytest
    (its guardian stops it)."""
    if os.geteuid() != 0:
        pytest.skip("starting a SLURM cluster needs root")
    root = make_suite(tmp_path / "suite", {"test_hold.py": HOLDING_TEST})
    tmp = Path(tempfile.mkdtemp(prefix="wf-suite-guard-")) / "tmp"
    tmp.parent.chmod(0o755)  # munged wants o+x on every folder above its socket (not tmp_path)
    try:
        three_nets(root, tmp)
    finally:
        cluster_guard.reap(tmp, everything=True)
        shutil.rmtree(tmp.parent, ignore_errors=True)


def three_nets(root: Path, tmp: Path) -> None:

    first = Holder(root, tmp, "first")
    first.guardian().kill()
    assert first.kill(signal.SIGTERM) == pytest.ExitCode.INTERRUPTED
    assert not first.running() and not first.state.exists()

    second = Holder(root, tmp, "second")
    second.guardian().kill()
    second.kill(signal.SIGKILL)
    assert second.running() == second.daemons, "nothing but the next start may stop it"

    third = Holder(root, tmp, "third")
    assert not second.running() and not second.state.exists()
    third.kill(signal.SIGKILL)
    third.wait_stopped()
    assert cluster_guard.reap(tmp, everything=True) == []


def test_a_reap_that_waited_on_another_stopper_reports_nothing_stopped(tmp_path: Path) -> None:
    """A reaper that waits on the claim's lock while the guardian stops the cluster finds the
    claim gone and reports nothing (cc19: it listed the guardian's cluster as its own)."""
    state = tmp_path / "wf-slurm-abc"
    state.mkdir()
    cluster_guard.claim_file(state).write_text("[]")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, shutil, sys, time; from pathlib import Path; "
            "state = Path(sys.argv[1]); claim = Path(sys.argv[2]); "
            "fd = os.open(claim, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print(flush=True); "
            "time.sleep(0.5); shutil.rmtree(state); claim.unlink()",
            str(state),
            str(cluster_guard.claim_file(state)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "\n"  # it holds the lock
    assert cluster_guard.reap(tmp_path, everything=True) == []
    assert holder.wait(timeout=30) == 0
    assert not state.exists() and not cluster_guard.claim_file(state).exists()


def test_ci_runs_the_readme_test_command() -> None:
    """CI runs the README's set-up-and-test command word for word."""
    readme = (REPO / "README.md").read_text()
    (command,) = [
        line
        for line in readme.splitlines()
        if line.startswith("python3 -m venv") and "pytest" in line
    ]
    ci = (REPO / ".ci" / "run").read_text().replace("\\\n", "")
    assert f'"{command}"' in ci
