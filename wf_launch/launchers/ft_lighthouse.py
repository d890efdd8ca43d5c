"""torchft's Lighthouse, run and supervised by the launcher (``ft=torchft ft.lighthouse=null``).

The Lighthouse forms a quorum of the replica groups at every step. It runs in a process of its own
(this file, run as a script), on loopback (on Ray: this machine's address in the cluster, where
the ranks on other nodes reach it), and the launcher restarts it on the same port when it
dies: the replica groups' Managers keep heartbeating to that address and retry a quorum request that
failed (:data:`wf_launch.rank.ft.QUORUM_RETRIES` times), so the run goes on. A step in flight is not
lost: the all-reduce between replica groups does not pass through the Lighthouse; only the next
quorum waits for the new one.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

__all__ = ["Lighthouse", "LighthouseFailed", "main"]

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 30.0


class LighthouseFailed(RuntimeError):
    """The Lighthouse process did not start (its log says why)."""


class Lighthouse:
    """A Lighthouse process on ``host`` (loopback by default): started, checked, restarted on its
    port, stopped. ``on_start(pid, address)`` runs after every start (the launcher records the pid
    for the drill); this file imports none of the project's modules, since it runs as a script."""

    def __init__(
        self,
        ft: Any,
        log_path: Path,
        host: str = LOOPBACK,
        on_start: Callable[[int, str], None] | None = None,
    ) -> None:
        self.ft, self.log_path, self.host, self.on_start = ft, log_path, host, on_start
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.restarts: list[float] = []

    @property
    def address(self) -> str:
        """What the replica groups' Managers connect to (``$TORCHFT_LIGHTHOUSE``)."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> Lighthouse:
        """Start the process and wait until it listens (its first line is its port)."""
        hb_ms = int(float(self.ft.heartbeat_timeout_s) * 1000)
        cmd = [
            sys.executable,
            __file__,  # a script of the standard library and torchft's native module: fast
            f"--bind={self.host}:{self.port}",
            f"--min-replicas={self.ft.min_replicas}",
            f"--heartbeat-timeout-ms={hb_ms}",
            f"--join-timeout-ms={hb_ms}",
        ]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
            )
        line = _first_line(self.proc, START_TIMEOUT_S)
        if not line.strip().isdigit():
            self.stop()
            raise LighthouseFailed(
                f"torchft's Lighthouse did not start (see {self.log_path}): {line.strip()!r}"
            )
        self.port = int(line)
        if self.on_start is not None:
            self.on_start(self.proc.pid, self.address)
        logger.info(f"ft: Lighthouse at {self.address} (min_replicas={self.ft.min_replicas})")
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def restart(self) -> None:
        """The Lighthouse died: start it again on its port."""
        code = self.proc.returncode if self.proc is not None else None
        logger.warning(f"ft: the Lighthouse died (exit {code}); restarting it on port {self.port}")
        self.restarts.append(time.time())
        self.start()

    def stop(self) -> None:
        """End the process (closing its stdin ends it; SIGKILL if it lingers)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The process's first line of output, or '' when it ends or says nothing in time."""
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return out[0] if out else ""


def _native() -> Any:
    """torchft's native module alone: ``torchft.coordination`` would import torch first (seconds
    of a restart the replica groups wait through; this takes a tenth of one)."""
    package = importlib.util.find_spec("torchft")
    if package is None or package.origin is None:
        raise ModuleNotFoundError("torchft is not installed: pip install 'worldfoundry-launch[ft]'")
    where = Path(package.origin).parent
    path = next(where.glob("_torchft*.so"), None)
    if path is None:  # another build: the usual way
        import torchft.coordination as coordination

        return coordination
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(path))
    spec = importlib.util.spec_from_file_location("torchft._torchft", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    """Serve a Lighthouse until stdin closes (the launcher ended) or SIGTERM; print its port."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bind", required=True)
    parser.add_argument("--min-replicas", type=int, required=True)
    parser.add_argument("--heartbeat-timeout-ms", type=int, required=True)
    parser.add_argument("--join-timeout-ms", type=int, required=True)
    args = parser.parse_args(argv)
    server = _native().LighthouseServer(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print(server.address().rpartition(":")[2], flush=True)
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main()
