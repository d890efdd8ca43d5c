"""A rank's side of ``ft=torchft``: torchft's Manager for the rank's replica group.

Under ``ft=torchft`` every replica group is its own distributed world (its own store and
groups); its ranks also join torchft: group rank ``r`` of every replica group shares a
reconfigurable gloo group (``torchft.ProcessGroupGloo``) that the Manager re-forms with the
replica groups of each step's quorum (torchft's Lighthouse decides it). A replica group that
comes back after a failure heals from a live peer through torchft's checkpoint transport
(HTTP), between steps (``use_async_quorum=False``: the state is applied inside
``start_quorum``, never during a forward).

What the run directory records of it (the launcher composes ``result.json``'s ``ft`` section from
these): each rank's transport address, one line per attempt (``logs/rank{r}.ft_address``), the
replica's heal events (``ft_events.jsonl``, by its rank 0), and where each rank is in the step
loop (``ft_phase.rank{r}.json``: the launcher's hang watch reads them). torch and torchft are
imported only when a session starts (a script in a fresh interpreter must find torch not
imported).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from ..rundir import files
from ..rundir.io import atomic_write_text, read_text

__all__ = [
    "ENDED",
    "FT_HOST_ENV",
    "FT_REPLICA_ENV",
    "JOINED",
    "LIGHTHOUSE_ENV",
    "QUORUM",
    "QUORUM_RETRIES",
    "RUST_LOG",
    "STEP",
    "FtSession",
    "append_event",
    "bind_host",
    "ft_enabled",
    "no_quorum",
    "phase_of",
    "read_mark",
    "replica_id",
    "wait_for_groups",
    "write_mark",
    "write_phase",
]

FT_REPLICA_ENV = "WF_FT_REPLICA"
"""The replica group a rank belongs to (set by the launcher for every rank of a replica group)."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's own variable: the Lighthouse's address (``http://HOST:PORT``)."""
LOOPBACK = "127.0.0.1"
FT_HOST_ENV = "WF_FT_HOST"
"""Where a rank's torchft servers listen and what they advertise: loopback unless the launcher
sets it (on Ray, the rank's node address: replica groups on other nodes reach it there)."""
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")
RUST_LOG = "RUST_LOG"
"""torchft's Rust side logs every quorum at INFO; the launcher sets ``RUST_LOG=warn`` unless set."""
QUORUM_RETRIES = 5
"""How often torchft retries a quorum request that failed (a Lighthouse restarting), within the
quorum's one timeout."""
JOINED, ENDED = "joined", "ended"
"""What a replica group's :func:`files.ft_joined` mark says."""
QUORUM, STEP = "quorum", "step"
"""Where a rank of a replica group is (its :func:`files.ft_phase`): waiting for a quorum, or in a
step."""
JOIN_POLL_S = 0.05
_GROUP_OF_REPLICA = re.compile(r"replica(\d+)(?::|$)")
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torch's elastic agent, which runs each replica group: 0 in the first attempt of a launch
(fresh or resumed), n after the group's n-th restart."""


def restarted() -> bool:
    """Whether this replica group restarted within this launch (after a failure of its own)."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0) > 0


def bind_host() -> str:
    """Where this rank's torchft servers listen (``$WF_FT_HOST``, else loopback)."""
    return os.environ.get(FT_HOST_ENV) or LOOPBACK


def ft_enabled(config: dict[str, Any]) -> bool:
    """Whether the run config asks for ``ft=torchft``."""
    return str((config.get("ft") or {}).get("name", "none")) != "none"


def replica_id() -> int:
    """This rank's replica group (``$WF_FT_REPLICA``; 0 when unset)."""
    return int(os.environ.get(FT_REPLICA_ENV, "0") or 0)


def no_quorum(ft: dict[str, Any], exc: BaseException, *, first: bool) -> TimeoutError:
    """The error of a replica group that found no quorum: which setting it waited for, and why."""
    field = "ft.join_timeout_s" if first else "ft.quorum_timeout_s"
    seconds = ft[field.removeprefix("ft.")]
    why = (
        "the other groups did not start in time"
        if first
        else "the other groups failed, or the Lighthouse is gone"
    )
    return TimeoutError(
        f"no quorum of ft.min_replicas={ft['min_replicas']} replica group(s) formed within "
        f"{field}={seconds} ({why}): {type(exc).__name__}: {exc}"
    )


def write_phase(
    replica_dir: Path | str, rank: int, phase: str, step: int, first: bool = False
) -> None:
    """Where group rank ``rank`` is (:data:`QUORUM` or :data:`STEP`), for the launcher's hang
    watch; ``first``: its attempt's first quorum (joining, or healing after a restart)."""
    text = json.dumps(
        {"phase": phase, "since": round(time.time(), 6), "step": step, "first": first}
    )
    atomic_write_text(files.ft_phase(replica_dir, rank), text + "\n")


def phase_of(replica_dir: Path | str, rank: int) -> dict[str, Any] | None:
    """What :func:`write_phase` last wrote for group rank ``rank`` (None before that, or if it
    cannot be read)."""
    try:
        data = json.loads(read_text(files.ft_phase(replica_dir, rank)))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def append_event(replica_dir: Path | str, **event: Any) -> None:
    """One line of the replica's ``ft_events.jsonl`` (a short append: whole lines, never half)."""
    line = json.dumps({"time": round(time.time(), 6), **event}) + "\n"
    with open(files.ft_events(replica_dir), "a") as f:
        f.write(line)


def _recording_transport(timeout: timedelta, replica_dir: Path, group_rank: int) -> Any:
    """torchft's HTTP checkpoint transport, recording where this rank heals from."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class RecordingTransport(HTTPTransport):  # type: ignore[misc,valid-type]
        """Records each heal's start (source address, step) in the replica's events (group rank
        0) and keeps what it received for :func:`_joining_manager`, which records the heal done
        once the state is loaded (a group that dies loading it did not heal)."""

        received: dict[str, Any] | None = None

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
            t0 = time.time()
            if group_rank == 0:
                append_event(replica_dir, event="healing", step=int(step), source=str(metadata))
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            self.received = {
                "step": int(step),
                "source": str(metadata),
                "since": t0,
                "transfer_s": round(time.time() - t0, 4),
            }
            return state

        def take_received(self) -> dict[str, Any] | None:
            """What the last heal received, once (None if no heal since the last call)."""
            received, self.received = self.received, None
            return received

        def address(self) -> str:  # where it listens, not the host's name
            return f"http://{bind_host()}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return RecordingTransport(timeout=timeout, num_chunks=0)


@contextlib.contextmanager
def _bound_servers() -> Iterator[None]:
    """Bind torchft's servers to :func:`bind_host` (loopback unless the launcher says) while they
    are made.

    torchft binds its Manager server and its checkpoint server on every interface (``[::]``)
    and takes no address to bind (its gloo group's store: :func:`_bound_gloo`). The replica
    groups of a local run are all on this host, so serving the quorum and the weights to the
    network would only expose them: the two constructors get loopback instead. On Ray the groups
    may run on other nodes: the launcher sets the rank's node address, one interface, not all.
    """
    import torchft.manager as manager
    from torchft.checkpointing import http_transport

    host = bind_host()
    real_manager, real_http = manager.ManagerServer, http_transport._IPv6HTTPServer

    def bound_manager(*args: Any, bind: str, **kwargs: Any) -> Any:
        return real_manager(*args, bind=f"{host}:{bind.rsplit(':', 1)[-1]}", **kwargs)

    class BoundHTTPServer(real_http):  # type: ignore[misc,valid-type]
        address_family = socket.AF_INET

        def __init__(self, address: Any, handler: Any) -> None:
            super().__init__((host, address[1]), handler)

    manager.ManagerServer, http_transport._IPv6HTTPServer = bound_manager, BoundHTTPServer
    try:
        yield
    finally:
        manager.ManagerServer, http_transport._IPv6HTTPServer = real_manager, real_http


def _bound_gloo(torchft: Any, timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo group, its rendezvous store on :func:`bind_host`: torchft's
    own store binds every interface and advertises the host's name."""
    from worldfoundry.core.distributed.runtime import bound_store  # torch: once a session starts

    host = bind_host()

    class BoundGloo(torchft.ProcessGroupGloo):  # type: ignore[misc,name-defined]
        def get_reconfigure_handle(self) -> str:
            if self._rendezvous_store is None:
                self._rendezvous_store = bound_store(host, 0, timeout)
            return json.dumps(
                {
                    "id": self._handle_id(),
                    "store": f"{host}:{self._rendezvous_store.port}",
                    "global_rank": self._global_rank,
                }
            )

    return BoundGloo(timeout=timeout)


def _clear_stale_manager_keys(group: Any, group_rank: int) -> None:
    """A restarted replica group reuses its agent's store, where the dead attempt's Manager left
    its address: rank 0 removes it before any rank looks (a barrier of the group in between)."""
    import torch.distributed as dist
    from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

    if group_rank == 0:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            wait_for_workers=False,
        )
        for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
            store.delete_key(key)
    if group is not None:
        group.barrier()


def _joining_manager(
    torchft: Any, ft: dict[str, Any], replica_dir: Path, rank: int, transport: Any, log: Any
) -> type:
    """torchft's Manager, its first quorum waiting ``ft.join_timeout_s`` for the other groups.

    torchft bounds every quorum by one timeout. The first one also waits for the other replica
    groups to start (import torch, join), which takes longer than a step on a loaded host, so a
    short ``ft.quorum_timeout_s`` would fail a healthy run at its start. A quorum that does not
    form raises :func:`no_quorum`'s error, naming the setting it waited for. A quorum that healed
    this rank returns with the peer's state loaded (``use_async_quorum=False``): its rank 0
    records the heal done (``healed``). A restarted group's rank 0 records its first quorum
    (``rejoined``): back in the run, healed or not.
    """

    class JoiningManager(torchft.Manager):  # type: ignore[misc,name-defined]
        joined = False
        join_deadline = time.monotonic() + float(ft["join_timeout_s"])

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._client = _RecordingClient(self._client)

        def quorum_groups(self) -> set[int]:
            """The replica groups in the last quorum this rank took part in."""
            return self._client.groups

        def start_quorum(
            self,
            allow_heal: bool = True,
            shrink_only: bool = False,
            timeout: timedelta | None = None,
        ) -> None:
            first = not self.joined
            if first and timeout is None:
                left = self.join_deadline - time.monotonic()
                timeout = timedelta(seconds=max(left, float(ft["quorum_timeout_s"])))
            write_phase(replica_dir, rank, QUORUM, int(self.current_step()), first=first)
            try:
                super().start_quorum(
                    allow_heal=allow_heal, shrink_only=shrink_only, timeout=timeout
                )
            except TimeoutError as exc:
                raise no_quorum(ft, exc, first=first) from exc
            write_phase(replica_dir, rank, STEP, int(self.current_step()))
            if (received := transport.take_received()) is not None:
                self._healed(received)
            self.joined = True
            if first and rank == 0 and restarted():
                append_event(
                    replica_dir,
                    event="rejoined",
                    step=int(self.current_step()),
                    replica_groups=int(self.num_participants()),
                )

        def _healed(self, received: dict[str, Any]) -> None:
            seconds = round(time.time() - received["since"], 4)
            log.warning(
                f"ft: healed from {received['source']} at step {received['step']} in "
                f"{seconds:.2f}s (received in {received['transfer_s']:.2f}s, then loaded)"
            )
            if rank == 0:
                append_event(
                    replica_dir,
                    event="healed",
                    step=received["step"],
                    source=received["source"],
                    seconds=seconds,
                    transfer_s=received["transfer_s"],
                )

    return JoiningManager


class _RecordingClient:
    """torchft's ManagerClient, keeping which replica groups its last quorum held (torchft's
    Manager reads a quorum's members inside ``start_quorum`` and keeps only their count)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.groups: set[int] = set()

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        found = (_GROUP_OF_REPLICA.match(rid) for rid in quorum.replica_ids)
        self.groups = {int(m.group(1)) for m in found if m}
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def wait_for_groups(replica_dir: Path, ft: dict[str, Any], deadline: float, log: Any) -> None:
    """Hold a starting replica group until every group has joined or ended (or ``deadline``).

    Groups launched together (a fresh launch or a resume) start training together: a group that
    stepped alone while the others still imported torch could train apart from them (a quorum of
    one at each step). A group that restarts after a failure skips this: it heals from the others.
    Raises :func:`no_quorum`'s error when fewer than ``ft.min_replicas`` groups joined in time.
    """
    run_dir = replica_dir.parent.parent
    groups = [files.ft_replica_dir(run_dir, k) for k in range(ft["replicas"])]
    while True:
        said = [read_mark(group) for group in groups]
        if all(said) or time.monotonic() >= deadline:
            break
        time.sleep(JOIN_POLL_S)
    joined = said.count(JOINED)
    if joined >= int(ft["min_replicas"]):
        missing = [k for k, word in enumerate(said) if word != JOINED]
        if missing:
            log.warning(f"ft: replica group(s) {missing} did not join in time; going on without")
        return
    raise no_quorum(
        ft, TimeoutError(f"{joined} of {ft['replicas']} replica group(s) joined"), first=True
    )


def read_mark(replica_dir: Path | str) -> str:
    """What a replica group's :func:`files.ft_joined` mark says (:data:`JOINED`, :data:`ENDED`;
    empty before either)."""
    try:
        return read_text(files.ft_joined(replica_dir)).strip()
    except FileNotFoundError:
        return ""


def write_mark(replica_dir: Path | str, word: str) -> None:
    """Set a replica group's :func:`files.ft_joined` mark to ``word`` (:data:`JOINED` or
    :data:`ENDED`)."""
    atomic_write_text(files.ft_joined(replica_dir), word)


class FtSession:
    """torchft's Manager for this rank (``ctx.ft``), built from the run's ``ft`` section."""

    def __init__(
        self,
        config: dict[str, Any],
        run_dir: Path,
        rank: int,
        world_size: int,
        group: Any,
        log: Any,
    ) -> None:
        import torchft

        for name in TORCHFT_LOGGERS:  # their INFO lines (every step), warnings of NCCL on gloo
            logging.getLogger(name).setLevel(logging.ERROR)
        ft = config["ft"]
        self.ft, self.rank, self.log = ft, rank, log
        self.replica = replica_id()
        self.run_dir = Path(run_dir)
        timeout = timedelta(seconds=float(ft["timeout_s"]))
        _clear_stale_manager_keys(group, rank)
        with _bound_servers():
            self.transport = _recording_transport(timeout, self.run_dir, rank)
            with open(files.ft_address(self.run_dir, rank), "a") as f:  # one line per attempt
                f.write(self.transport.metadata() + "\n")
            self.manager = self._manager(torchft, ft, timeout, rank, world_size, log)
        log.info(
            f"ft: replica group {self.replica} of {ft['replicas']} joined torchft "
            f"(Lighthouse {os.environ.get(LIGHTHOUSE_ENV)})"
        )
        if rank == 0:
            write_mark(self.run_dir, JOINED)
            if not restarted():
                wait_for_groups(self.run_dir, ft, self.manager.join_deadline, log)

    def _manager(
        self,
        torchft: Any,
        ft: dict[str, Any],
        timeout: timedelta,
        rank: int,
        world_size: int,
        log: Any,
    ) -> Any:
        return _joining_manager(torchft, ft, self.run_dir, rank, self.transport, log)(
            pg=_bound_gloo(torchft, timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=int(ft["min_replicas"]),
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=float(ft["quorum_timeout_s"])),
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            replica_id=f"replica{self.replica}",
            hostname=bind_host(),
            checkpoint_transport=self.transport,
            init_sync=False,
            quorum_retries=QUORUM_RETRIES,
        )

    def finish(self, group: Any) -> None:
        """This replica group ran its last step: hold it, serving its state, for groups coming
        back, then return.

        A group that restarts after a failure heals from a live peer; one back after every peer
        ended has none, trains alone from its own checkpoint and ends with other weights. So a
        group done with its steps marks itself ``ended`` and holds: while another group restarts
        it waits (its phase says :data:`QUORUM`: it is not hung), and when that group asks for
        its first quorum it joins it, so that group heals from it, to the last step. It returns
        once every other group has ended, or after ``ft.join_timeout_s``. Every rank of the group
        calls it; group rank 0 decides each round and ``group`` (the group's world) follows.
        """
        import torch
        import torch.distributed as dist

        if self.rank == 0:
            write_mark(self.run_dir, ENDED)
        step = int(self.manager.current_step())
        write_phase(self.run_dir, self.rank, QUORUM, step)
        hold = _Hold(self.run_dir, int(self.ft["replicas"]), float(self.ft["join_timeout_s"]))
        while True:
            said = torch.tensor([hold.next_word() if self.rank == 0 else 0])
            dist.broadcast(said, src=0, group=group.cpu_group)
            word = int(said.item())
            if word == _DONE:
                break
            if word == _WAIT:
                time.sleep(JOIN_POLL_S)
                continue
            if self.rank == 0:
                self.log.info(
                    f"ft: holding at step {step}: replica group(s) {hold.asking} back, "
                    "joining their quorum"
                )
            try:
                self.manager.start_quorum()
            except Exception as exc:  # the steps are done: a heal that fails must not fail them
                self.log.warning(f"ft: holding at step {step}, no quorum with a group back: {exc}")
                break
            if self.rank == 0 and (missed := hold.met(self.manager.quorum_groups())):
                self.log.info(
                    f"ft: holding at step {step}: the quorum formed without replica group(s) "
                    f"{missed} (their request not at the Lighthouse yet); asking again"
                )
                time.sleep(JOIN_POLL_S)
            write_phase(self.run_dir, self.rank, QUORUM, step)
        if hold.left_behind:
            self.log.warning(
                f"ft: replica group(s) {hold.left_behind} not back within "
                f"ft.join_timeout_s={self.ft['join_timeout_s']}; ending without them"
            )

    def shutdown(self) -> None:
        """Stop the Manager's servers and threads (the task is done)."""
        self.manager.shutdown(wait=False)


_DONE, _WAIT, _HEAL = 1, 2, 3
"""What a holding group does next (:meth:`FtSession.finish`): end, wait, or join a quorum."""


class _Hold:
    """Group rank 0's view, while its group holds at the last step, of the other replica groups:
    ended (their mark), restarting, or asking for their first quorum (their rank 0's phase)."""

    def __init__(self, replica_dir: Path, replicas: int, timeout_s: float) -> None:
        run_dir, me = replica_dir.parent.parent, int(replica_dir.name)
        self.others = {k: files.ft_replica_dir(run_dir, k) for k in range(replicas) if k != me}
        self.deadline = time.monotonic() + timeout_s
        self.joined_since: dict[int, float] = {}
        self.asking: list[int] = []
        self.left_behind: list[int] = []

    def next_word(self) -> int:
        """:data:`_HEAL` when a group asks for a first quorum not joined yet (:attr:`asking`),
        :data:`_DONE` when every other group has ended (or the deadline passed), else
        :data:`_WAIT`."""
        waiting = [k for k, d in self.others.items() if read_mark(d) != ENDED]
        self.asking = []
        for k in waiting:
            since = _first_quorum_since(self.others[k])
            if since is not None and since > self.joined_since.get(k, 0.0):
                self.joined_since[k] = since
                self.asking.append(k)
        if self.asking:
            return _HEAL
        if waiting and time.monotonic() < self.deadline:
            return _WAIT
        self.left_behind = waiting
        return _DONE

    def met(self, groups: set[int]) -> list[int]:
        """The groups of :attr:`asking` that the quorum just formed lacked: asked for again.

        A group writes its phase, then asks the Lighthouse. A holding group that asks in between
        meets the Lighthouse's fast quorum (every member of the previous quorum is there) and
        forms one without it; the group back then waits alone, a quorum of too few to form, until
        its timeout. Asking again, once its request is in, forms the quorum with it."""
        missed = [k for k in self.asking if k not in groups]
        for k in missed:
            del self.joined_since[k]
        return missed


def _first_quorum_since(replica_dir: Path) -> float | None:
    """Since when the group's rank 0 waits for its attempt's first quorum (None if it does not)."""
    data = phase_of(replica_dir, 0)
    if data is None or data.get("phase") != QUORUM or not data.get("first"):
        return None
    return float(data.get("since", 0.0))
