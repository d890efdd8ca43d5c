"""Run the real ``python -m wf_launch`` CLI in a process of its own and inspect what it left.

The command runs in a child of a fork server (``tests/cli_server.py``) that imported torch and
Hydra once: a real process with its own pid, session, streams, environment and exit status,
without a fresh interpreter's 1.5 s of imports. ``WF_TEST_FRESH_CLI=1`` runs every command in a
fresh interpreter instead; the tests of a fresh interpreter's behaviour (a missing module, the
locale, start-up) call ``subprocess`` themselves.
"""

from __future__ import annotations

import array
import atexit
import importlib.util
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil

USER_TASKS = Path(__file__).parent / "user_tasks"
SERVER = Path(__file__).parent / "cli_server.py"
SERVER_START_S = 120.0
TITLE_ROOM = 16384
"""Bytes of command line a child of the fork server can show (``ps``, psutil)."""


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


class _ForkServer:
    """This process's fork server: started on first use, ended with this process."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="wf-cli-")
        self.path = os.path.join(self.folder, "sock")
        self.owner = os.getpid()
        self.log = open(os.path.join(self.folder, "server.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), self.path, "-" * TITLE_ROOM],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            env=cli_env(),
        )
        atexit.register(self.stop)

    def connect(self) -> socket.socket:
        """A connection to the server, waiting while it imports (the first call only)."""
        deadline = time.monotonic() + SERVER_START_S
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                return sock
            except OSError:
                sock.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the tests' fork server did not start: {Path(self.log.name).read_text()}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if os.getpid() == self.owner and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()


_SERVER: _ForkServer | None = None


def _server() -> _ForkServer:
    global _SERVER
    if _SERVER is None or _SERVER.owner != os.getpid() or _SERVER.proc.poll() is not None:
        _SERVER = _ForkServer()
    return _SERVER


class ForkedPopen(subprocess.Popen):
    """``python -m MODULE ARGS`` as a child of the fork server, with ``Popen``'s whole API.

    Streams, ``cwd``, ``env`` and ``start_new_session`` mean what they mean to ``Popen``; the
    exit status comes from the server, which is the child's parent.
    """

    def __init__(self, module: str, argv: list[str], **kw: Any) -> None:
        self._module, self._argv = module, list(argv)
        self._new_session = bool(kw.get("start_new_session"))
        self._conn: socket.socket | None = None
        self._buf = b""
        super().__init__([sys.executable, "-m", module, *argv], **kw)

    def _execute_child(
        self,
        args: Any,
        executable: Any,
        preexec_fn: Any,
        close_fds: Any,
        pass_fds: Any,
        cwd: Any,
        env: Any,
        startupinfo: Any,
        creationflags: Any,
        shell: Any,
        p2cread: int,
        p2cwrite: int,
        c2pread: int,
        c2pwrite: int,
        errread: int,
        errwrite: int,
        *_rest: Any,
    ) -> None:
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1]
        fds.append(errwrite if errwrite != -1 else 2)
        request = {
            "module": self._module,
            "argv": self._argv,
            "env": dict(os.environ if env is None else env),
            "cwd": os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd()),
            "new_session": self._new_session,
        }
        body = json.dumps(request).encode()
        conn = _server().connect()
        conn.sendmsg(
            [f"{len(body):08d}".encode()],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())],
        )
        conn.sendall(body)
        self._conn = conn
        self.pid = self._message(None)["pid"]
        self._child_created = True
        devnull = getattr(self, "_devnull", None)
        for theirs, ours in ((p2cread, p2cwrite), (c2pwrite, c2pread), (errwrite, errread)):
            if theirs != -1 and ours != -1 and theirs != devnull:
                os.close(theirs)
        if devnull is not None:
            os.close(devnull)

    def _message(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next line about this child, or None if none came within ``timeout``."""
        assert self._conn is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the tests' fork server ended before pid {self.pid} did")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            message = self._message(timeout)
            if message is not None:
                self.returncode = int(message["status"])
                self._conn.close()
        return self.returncode

    def _internal_poll(self, _deadstate: Any = None, **_kw: Any) -> int | None:
        if _deadstate is None:
            return self._status(0)
        try:  # Popen.__del__, maybe after the server ended with the test worker
            return self._status(0)
        except (RuntimeError, OSError):
            return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if self._status(timeout) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def python_m(module: str, argv: list[str], fresh: bool = False, **kw: Any) -> subprocess.Popen:
    """``Popen([python, -m, MODULE, *ARGV], **kw)``, forked from the server unless ``fresh``
    (a test of the interpreter's own start-up) or ``WF_TEST_FRESH_CLI=1``."""
    if fresh or os.environ.get("WF_TEST_FRESH_CLI") == "1":
        return subprocess.Popen([sys.executable, "-m", module, *argv], **kw)
    return ForkedPopen(module, argv, **kw)


def run_python_m(
    module: str, argv: list[str], timeout: float | None = None, input: str | None = None, **kw: Any
) -> subprocess.CompletedProcess:
    """``subprocess.run`` of :func:`python_m` (``capture_output``, ``check`` and ``text`` too)."""
    if kw.pop("capture_output", False):
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    check = kw.pop("check", False)
    if input is not None:
        kw["stdin"] = subprocess.PIPE
    with python_m(module, argv, **kw) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _python_m_words(argv: list[str]) -> tuple[str, list[str]] | None:
    if len(argv) > 2 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2], list(argv[3:])
    return None


def popen_argv(argv: list[str], **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kw)``; ``[python, -m, MODULE, ...]`` through :func:`python_m`."""
    words = _python_m_words(argv)
    return python_m(*words, **kw) if words else subprocess.Popen(argv, **kw)


def run_argv(argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, **kw)``; ``[python, -m, MODULE, ...]`` through :func:`python_m`."""
    words = _python_m_words(argv)
    return run_python_m(*words, **kw) if words else subprocess.run(argv, **kw)


def run_cli(
    args: list[str], run_dir: Path, timeout: float = 120, **kw: Any
) -> subprocess.CompletedProcess:
    """``python -m wf_launch ARGS hydra.run.dir=RUN_DIR`` to completion."""
    return run_python_m(
        "wf_launch",
        [*args, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(),
        cwd=run_dir.parent,
        **kw,
    )


def start_cli(args: list[str], run_dir: Path, fresh: bool = False) -> subprocess.Popen:
    """Start the CLI in its own session (so a test can signal it like a terminal would); in a
    fresh interpreter with ``fresh``."""
    return python_m(
        "wf_launch",
        [*args, f"hydra.run.dir={run_dir}"],
        fresh=fresh,
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
                cmd = " ".join(filter(None, p.info["cmdline"] or []))
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


def status(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m wf_launch.status ARGV`` as a user runs it: its output captured as text."""
    return run_python_m(
        "wf_launch.status",
        list(argv),
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=timeout,
    )
