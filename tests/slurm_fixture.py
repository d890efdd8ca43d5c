"""Session-scoped ``slurm_cluster`` fixture: a real SLURM cluster for tests.

Registered for every test module by ``tests/conftest.py`` (``pytest_plugins``).

Where the cluster comes from, in order:

1. ``SLURM_CONF`` is set and ``scontrol ping`` answers: that cluster is used as is
   (CI starts one with ``scripts/slurm_cluster.sh start --nodes 2`` in ``.ci/run``).
2. We are root and the packages are installed (``scripts/slurm_cluster.sh install``):
   a two-node cluster is started in a temporary folder on free ports and stopped at
   the end of the session, or by ``tests/cluster_guard.py`` when the run is killed.
3. Otherwise the tests are skipped, unless ``CI=true``: then they fail, because CI
   must never skip the SLURM tests silently.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import cluster_guard
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"

# Binaries `scripts/slurm_cluster.sh start` needs (from `scripts/slurm_cluster.sh install`).
REQUIRED_BINARIES = (
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "mariadbd",
    "mariadb-install-db",
    "sinfo",
    "sbatch",
    "srun",
    "sacct",
    "scontrol",
)

# Set by a launcher or an enclosing job; a submitted job must not inherit them
# (submitit's TorchDistributedEnvironment().export() raises if RANK etc. are set).
RANK_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)
JOB_VAR_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")

START_TIMEOUT_S = 180
DAEMON_PORTS = (10000, 12000)
"""Where the daemons listen: apart from the Ray test cluster's ports (tests/ray_fixture.py)
and below the ports the SLURM launcher gives jobs for their rendezvous (20000-32000, by job
id): a job whose port a test cluster's daemon holds cannot start its process group."""


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster. ``env`` is a complete environment for subprocesses."""

    conf: Path
    dir: Path
    nodes: int
    env: dict[str, str]
    started_here: bool

    def run(
        self, args: Sequence[str], *, timeout: float = 60, check: bool = True, **kwargs
    ) -> subprocess.CompletedProcess[str]:
        """Run a command (``srun``, ``sbatch``, ``sacct`` ...) against this cluster."""
        return subprocess.run(
            list(args),
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
            check=check,
            **kwargs,
        )

    def activate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process's environment at the cluster (for in-process users such
        as submitit, which calls sbatch / sacct / scancel with ``os.environ``)."""
        for key in list(os.environ):
            if key not in self.env:
                monkeypatch.delenv(key)
        for key, value in self.env.items():
            if os.environ.get(key) != value:
                monkeypatch.setenv(key, value)


def cluster_env(conf: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: ``os.environ``) without job / rank variables, with ``SLURM_CONF``
    set and a PATH that reaches this interpreter and the SLURM binaries."""
    base = dict(os.environ if base is None else base)
    env = {
        k: v for k, v in base.items() if k not in RANK_VARS and not k.startswith(JOB_VAR_PREFIXES)
    }
    env["SLURM_CONF"] = str(conf)
    path = [str(Path(sys.executable).parent), *env.get("PATH", "").split(os.pathsep)]
    for d in ("/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        if d not in path:
            path.append(d)
    env["PATH"] = os.pathsep.join(dict.fromkeys(p for p in path if p))
    return env


def _ping(env: dict[str, str]) -> bool:
    try:
        out = subprocess.run(
            ["scontrol", "ping"], env=env, text=True, capture_output=True, timeout=15
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "is UP" in out.stdout


def _node_count(env: dict[str, str]) -> int:
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N"],
        env=env,
        text=True,
        capture_output=True,
        timeout=15,
        check=True,
    )
    return len(set(out.stdout.split()))


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _free_port_block(size: int) -> int:
    """First port of ``size`` consecutive free ports in :data:`DAEMON_PORTS`."""
    low, high = DAEMON_PORTS
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(low, high - size)
        if all(_port_free(base + i) for i in range(size)):
            return base
    raise RuntimeError(f"no block of {size} free TCP ports found in {low}-{high}")


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true, so SLURM tests may not be skipped, but: {reason}", pytrace=False)
    pytest.skip(reason)


def _start(nodes: int, state: Path) -> SlurmCluster:
    base = _free_port_block(5)  # ctld, slurmd n1, slurmd n2, slurmdbd, mariadb
    cmd = [
        "bash",
        str(SCRIPT),
        "start",
        "--nodes",
        str(nodes),
        "--dir",
        str(state),
        "--ctld-port",
        str(base),
        "--slurmd-port",
        str(base + 1),
        "--dbd-port",
        str(base + 3),
        "--db-port",
        str(base + 4),
    ]
    try:
        out = subprocess.run(cmd, text=True, capture_output=True, timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        _stop(state)
        pytest.fail(f"{' '.join(cmd)} took over {START_TIMEOUT_S}s:\n{exc.stderr}", pytrace=False)
    if out.returncode != 0:
        _stop(state)
        pytest.fail(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stderr}", pytrace=False)
    conf = state / "slurm.conf"
    return SlurmCluster(conf=conf, dir=state, nodes=nodes, env=cluster_env(conf), started_here=True)


def _stop(state: Path) -> None:
    error = cluster_guard.stop(state)
    if error:
        raise RuntimeError(error)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A running SLURM cluster (see the module docstring for where it comes from)."""
    conf = os.environ.get("SLURM_CONF")
    if conf:
        env = cluster_env(Path(conf))
        if Path(conf).is_file() and _ping(env):
            yield SlurmCluster(
                conf=Path(conf),
                dir=Path(conf).parent,
                nodes=_node_count(env),
                env=env,
                started_here=False,
            )
            return
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(
                f"SLURM_CONF={conf} is set but `scontrol ping` does not answer "
                "(did `scripts/slurm_cluster.sh start` run in .ci/run?)",
                pytrace=False,
            )
        # A stale SLURM_CONF from an earlier shell: fall through and start our own.
    if os.geteuid() != 0:
        _skip_or_fail(
            "no SLURM cluster: SLURM_CONF is unset and starting one needs root "
            "(sudo bash scripts/slurm_cluster.sh start; source .slurm/env.sh)"
        )
    missing = [
        b
        for b in REQUIRED_BINARIES
        if shutil.which(b, path=cluster_env(Path("/dev/null"))["PATH"]) is None
    ]
    if missing:
        _skip_or_fail(
            f"SLURM packages not installed (missing {', '.join(missing)}); "
            "run: bash scripts/slurm_cluster.sh install"
        )
    cluster_guard.reap(Path(tempfile.gettempdir()))
    state = cluster_guard.state_dir("slurm")
    guardian = cluster_guard.claim(state)
    try:
        yield _start(nodes=2, state=state)
    finally:
        try:
            _stop(state)
        finally:
            guardian.kill()
            guardian.wait()
