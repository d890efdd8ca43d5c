"""A fork server for the tests' ``python -m MODULE`` commands (``tests/cli_helpers.py``).

Started once per test worker, it imports torch, Hydra and wf_launch, then forks one child per
command: the child takes the command's standard streams, working directory, environment,
session and ``sys.path``, writes the command line where ``ps`` reads it, and runs the module as
``python -m`` does (``runpy``, as ``__main__``), ending as that interpreter would. The test
holds a real process (its pid, signals, children, exit status); what it skips is the 1.5 s of
CPU that each fresh interpreter spends importing torch and Hydra, a third of the suite's work.

Usage: ``python cli_server.py SOCKET PADDING`` (PADDING: room for the children's command lines).
The server exits when its test worker does (a parent-death signal) or on SIGTERM.
"""

from __future__ import annotations

import array
import ctypes
import json
import os
import runpy
import select
import signal
import socket
import sys
from typing import Any

MAX_FDS = 3
HEADER = 8


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _preload() -> None:
    """What a launch imports anyway, so that the fork skips it; never a torch op here.

    ``import torch`` starts a thread of its own (as it does in every launch that forks ranks);
    anything else that started one would make the fork unsafe (a lock it held stays held).
    """
    import torch

    expected = _threads()
    import hydra  # noqa: F401
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401

    import wf_launch.cli
    import wf_launch.launchers.local.launcher
    import wf_launch.tasks.train  # noqa: F401

    # Not train's PRELOAD (dynamo, DCP, FSDP): a fresh CLI imports it for task=train only, and a
    # DDP script's rank forked below it hung 1 launch in 5 in ~ProcessGroupGloo (a thread join).
    if _threads() != expected:
        raise SystemExit(f"the fork server's imports started {_threads() - expected} thread(s)")


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request: an 8-byte length, then JSON, with the three streams' descriptors."""
    fds = array.array("i")
    msg, ancdata, _flags, _addr = conn.recvmsg(HEADER, socket.CMSG_LEN(MAX_FDS * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    size = int(msg.decode())
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("the request ended early")
        body += chunk
    return json.loads(body), list(fds)


def _reap(owners: dict[int, socket.socket]) -> None:
    """Report each ended child's exit status (negative: the signal) to the test that asked."""
    while owners:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = owners.pop(pid, None)
        if conn is None:
            continue
        try:
            conn.sendall(json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:
            pass  # the test stopped listening
        conn.close()


def serve(listener: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Fork a child per request; returns only in a child, with its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    owners: dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, fds = _recv_request(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            shown_r, shown_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for sock in (listener, conn, *owners.values()):
                    sock.close()
                for fd in (wake_r, wake_w, shown_r):
                    os.close(fd)
                request["shown"] = shown_w
                return request, fds
            for fd in (*fds, shown_w):
                os.close(fd)
            os.read(shown_r, 1)  # the child shows its command line before the test has its pid
            os.close(shown_r)
            owners[pid] = conn
            try:
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            except OSError:
                pass
        _reap(owners)


def _set_title(words: list[str]) -> None:
    """Write the command line into this process's argv area, where ``ps`` and psutil read it."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
    text = b"\0".join(w.encode() for w in words)[: end - start - 1]
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def become(request: dict[str, Any], fds: list[int], base_path: list[str]) -> None:
    """Turn this forked child into ``python -m MODULE ARGV`` as the request describes it."""
    module = request["module"]
    _set_title([sys.executable, "-m", module, *request["argv"]])
    if request["new_session"]:
        os.setsid()
    os.close(request["shown"])  # the test may have the pid now: the process is what it shows
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *base_path]
    sys.argv = [module, *request["argv"]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main() -> None:
    sock_path = sys.argv[1]
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [p for p in sys.path[1:] if p not in own]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: end with the test worker
    if os.getppid() == 1:
        return
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(64)
    request, fds = serve(listener)
    become(request, fds, base_path)


if __name__ == "__main__":
    main()
