"""The stores and sockets of a run: nothing listens beyond loopback unless the launcher needs it,
and the isolation docs/security.md recommends against other users of the host works (issue 19, item
2)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from cli_helpers import cli_env, result, wait_for_log
from multirank import run_ranks

TASKS = "task.modules=[wf_test_tasks]"


def _listening(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN]
    return sorted(set(out))


def _beyond_loopback(addresses: list[str]) -> list[str]:
    return [a for a in addresses if not (a.startswith("127.") or a.startswith("::1:"))]


_SINGLE = """
import os, sys, psutil
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
    os.environ.pop(k, None)
os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # left over from an outer torchrun: never joins a store
from types import SimpleNamespace
from worldfoundry.core.distributed.init import dist_init
dist_init(SimpleNamespace(engine_config=SimpleNamespace(distributed_backend="gloo", distributed_timeout_minutes=1,
                                                        dp_size=1)))
import json
print(json.dumps(sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections("inet")
                        if c.status == psutil.CONN_LISTEN)))
"""


def test_a_single_process_dist_init_starts_no_store_and_listens_on_loopback_only() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _SINGLE], capture_output=True, text=True, timeout=120, env=cli_env()
    )
    assert proc.returncode == 0, proc.stderr
    listening = json.loads(proc.stdout.strip().splitlines()[-1])
    assert _beyond_loopback(listening) == [] and len(listening) <= 1, (
        listening
    )  # gloo's own socket at most


def _rank0_listens(rank: int, world: int) -> list[str]:
    from worldfoundry.core.distributed import groups
    from worldfoundry.core.distributed.init import dist_init

    dist_init(
        SimpleNamespace(
            engine_config=SimpleNamespace(
                distributed_backend="gloo", distributed_timeout_minutes=1, dp_size=world
            )
        )
    )
    listening = _listening([os.getpid()])
    groups.destroy_model_parallel()
    return listening


@pytest.mark.slow
def test_rank0s_store_listens_on_a_loopback_master_addr_only() -> None:
    listening = run_ranks(_rank0_listens, 2, init=False, env={"GLOO_SOCKET_IFNAME": "lo"})
    assert listening[0] and _beyond_loopback(listening[0]) == [], listening


@pytest.mark.slow
def test_torch_disable_share_rdzv_tcp_store_is_dropped_for_a_loopback_launch(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "task=misbehave",
            TASKS,
            "task.how=sleep_all",
            "task.sleep_s=60",
            "engine.dp_size=2",
            f"hydra.run.dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=cli_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
        cwd=tmp_path,
    )
    try:
        for r in range(2):
            wait_for_log(run_dir / "logs" / f"rank{r}.log", "sleeping")
        pids = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        listening = _listening(pids)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert listening and _beyond_loopback(listening) == [], listening
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ignored: with launcher.loopback_only=true" in err


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("unshare") is None or shutil.which("ip") is None, reason="needs unshare and ip"
)
def test_a_launch_runs_in_a_private_network_namespace(tmp_path: Path) -> None:
    """docs/security.md's isolation from other users of the host: the run in its own network
    namespace."""
    probe = subprocess.run(["unshare", "-rn", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            f"user and network namespaces are not available here: {probe.stderr.decode().strip()}"
        )
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            "unshare",
            "-rn",
            "sh",
            "-c",
            f'ip link set lo up && exec "$0" -m wf_launch task=noop '
            f"engine.dp_size=2 hydra.run.dir={run_dir}",
            sys.executable,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=cli_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert result(run_dir)["status"] == "ok"
