"""Run the real ``python -m wf_launch`` CLI in a subprocess and inspect what it left."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

USER_TASKS = Path(__file__).parent / "user_tasks"


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` as a module (once per process: later calls get the same module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a user would have, plus the test task module on PYTHONPATH."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(USER_TASKS), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def run_cli(
    args: list[str], run_dir: Path, timeout: float = 120, **kw: Any
) -> subprocess.CompletedProcess:
    """``python -m wf_launch ARGS hydra.run.dir=RUN_DIR`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "wf_launch", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=run_dir.parent,
        **kw,
    )


def start_cli(args: list[str], run_dir: Path) -> subprocess.Popen:
    """Start the CLI in its own session (so a test can signal it like a terminal would)."""
    return subprocess.Popen(
        [sys.executable, "-m", "wf_launch", *args, f"hydra.run.dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
        cwd=run_dir.parent,
        start_new_session=True,
    )


def result(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "result.json").read_text())


def leftover_processes(marker: str, grace_s: float = 3.0) -> list[str]:
    """Processes whose command line mentions ``marker`` (the run dir), after a short grace."""
    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                if (
                    marker in cmd
                    and p.info["status"] != psutil.STATUS_ZOMBIE
                    and p.pid != os.getpid()
                ):
                    found.append(f"{p.pid}: {cmd}")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def listening(pid: int) -> list[str]:
    """``IP:PORT`` of every socket that ``pid`` or any process below it listens on."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out += [f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN]
    return sorted(set(out))


def wait_for_log(path: Path, needle: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} never appeared in {path}")
