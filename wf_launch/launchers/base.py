"""What every launcher builds on: the common config fields and the optional hooks' defaults.

A launcher is a class with a ``name``, a config dataclass (the Hydra schema of
``launcher=NAME``, a :class:`LauncherConfig`), and ``validate`` / ``describe`` /
``launch`` (:class:`~.protocol.Launcher`).

The tools that read runs afterwards (``status``, ``runs``, ``drill``, the hang
autopsy) reach a run's scheduler only through the hooks of :class:`LauncherHooks`;
a launcher overrides those it has something to say about. Every registered launcher
has them all: :func:`~wf_launch.launchers.register_launcher` mixes the defaults into
a class that does not subclass :class:`LauncherHooks` itself. docs/launchers.md shows
a new launcher end to end.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from omegaconf import MISSING

from ..config.fields import (
    check_fields,
    choice,
    config_error,
    flag,
    is_int,
    number,
    unknown_field,
)
from ..config.layout import run_layout
from ..observe.stacks import local_pids, trigger
from ..rundir import files
from ..rundir.claim import launch_alive
from ..rundir.pids import live_rank_pid

if TYPE_CHECKING:
    from ..rundir.record import RunRecord

__all__ = [
    "CTRL_C_NOTICE",
    "LauncherConfig",
    "LauncherHooks",
    "run_dir_mode",
    "with_hooks",
]

CTRL_C_NOTICE = (
    "Ctrl-C: every rank stops at its next step boundary (a task that polls "
    "ctx.should_stop() saves first); press Ctrl-C again to stop at once"
)
"""What every launcher says at the first Ctrl-C (the resume command follows the run's end)."""

C = TypeVar("C", bound="LauncherConfig")
WEEK_S = 7 * 24 * 3600
_WEEK_NOTE = "(0.1 s to a week)"
RESUME_NOTE = (
    "(true: continue the run in the directory, refused when none is there; auto: continue it "
    "if one is there, else start one)"
)


def run_dir_mode(value: Any) -> int:
    """``launcher.run_dir_mode`` as a mode; ValueError saying what is allowed.

    The owner keeps ``rwx``, and no one else may write: the launcher and the job read
    (and submitit executes) files there, so a group or other ``w`` would let another user
    plant them. Read and search access for the group or others is a choice (``0750``).
    """
    if not isinstance(value, str) or not re.fullmatch(r"0?[0-7]{3}", value):
        raise ValueError("an octal mode string such as '0700' or '0750'")
    mode = int(value, 8)
    if mode & 0o700 != 0o700 or mode & 0o022:
        raise ValueError(
            "an octal mode string such as '0700' or '0750' that leaves the owner rwx and gives no "
            "one else write access (others could plant files the launcher and the job read)"
        )
    return mode


@dataclass
class LauncherConfig:
    """What every launcher's config has (subclass it for a launcher's own fields)."""

    name: str = MISSING
    dry_run: bool = flag(False)
    console_ranks: list[int] | None = None
    max_log_mb: float = number(1024.0, 0, unit="MB", note="per rank log (0 = no cap)")
    max_metrics_mb: float = number(1024.0, 0, unit="MB", note=f"{files.METRICS} (0 = no cap)")
    overwrite: bool = flag(False)
    resume: bool | str = choice(False, (True, False, "auto"), note=RESUME_NOTE)
    run_dir_mode: str = "0700"
    progress_interval_s: float = number(10.0, 0.1, WEEK_S, unit="seconds", note=_WEEK_NOTE)
    stall_warning_s: float = number(300.0, 0.1, WEEK_S, unit="seconds", note=_WEEK_NOTE)

    @classmethod
    def build(cls: type[C], launcher: dict[str, Any]) -> C:
        """The typed config from the run's resolved ``launcher`` section; an unknown field is an
        error.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in launcher if k not in known)
        if unknown:
            raise unknown_field(
                f"launcher.{unknown[0]}",
                launcher[unknown[0]],
                known,
                owner=f"launcher={launcher.get('name')}",
            )
        return cls(**{k: launcher[k] for k in known if k in launcher})

    def validate(self, world_size: int) -> None:
        """The fields every launcher has; a launcher's own ``validate`` checks the rest."""
        ranks = self.console_ranks
        if ranks is not None:
            bad = [r for r in ranks if not (is_int(r) and 0 <= r < world_size)]
            if bad:
                raise config_error(
                    "launcher.console_ranks",
                    list(ranks),
                    f"ranks must be integers in [0, {world_size - 1}] (null shows every rank)",
                )
        check_fields(self, "launcher", LauncherConfig)
        try:
            run_dir_mode(self.run_dir_mode)
        except ValueError as exc:
            raise config_error("launcher.run_dir_mode", self.run_dir_mode, str(exc)) from None
        if self.overwrite and self.resume:
            raise config_error(
                "launcher.resume",
                True,
                "not together with launcher.overwrite=true (resume "
                "continues the run in the directory; overwrite moves it aside): choose one",
            )


class LauncherHooks:
    """What the tools ask a run's launcher after the launch; each hook has a default that fits a
    local run.
    """

    name: ClassVar[str]
    drill_kinds: ClassVar[tuple[str, ...]] = ()
    """The interruptions ``python -m wf_launch.drill --backend NAME`` may inject into this
    launcher's runs: ``kill9`` (:meth:`kill_rank`), ``sigterm`` (to the launch process, which
    stops its ranks), ``usr2`` (:meth:`signal_ranks` with SIGUSR2), ``nodekill``
    (:meth:`kill_node`). None by default: the drill refuses the launcher."""
    supports_ft: ClassVar[bool] = False
    """Whether the launcher runs ``ft=torchft`` (replica groups restarted one at a time)."""

    def status_label(self, run_dir: Path) -> str:
        """How ``status`` names the run: 'SLURM job 42'; by default '<launcher> run'."""
        return f"{self.name} run"

    def status_details(self, run_dir: Path) -> list[str]:
        """Extra lines ``status`` prints about the run (each rank's outcome on SLURM); none by
        default.
        """
        return []

    def live_state(self, run_dir: Path) -> tuple[str, str] | None:
        """``('SLURM job 42', 'PENDING (Priority)')`` for the live view, on change; None when there
        is no queue.
        """
        return None

    def run_label(self, run_dir: Path, record: RunRecord | None) -> str:
        """The launcher column of ``python -m wf_launch.runs`` ('slurm 42'); by default the
        launcher's name.
        """
        return self.name

    def signal_ranks(self, run_dir: Path, signum: int) -> set[int]:
        """Send ``signum`` to every running rank of the run; the ranks it reached (expected to
        answer).

        By default: the ranks whose recorded process (``logs/rank{r}.pid``) lives on this host.
        """
        world = run_layout(files.read_config(run_dir, strict=True)).world_size
        return trigger(local_pids(run_dir, world), signum=signum)

    def is_live(self, run_dir: Path) -> bool:
        """Whether the run may still be going (its launch holds the run directory's lock on this
        host).
        """

        return launch_alive(run_dir)

    def signal_rank(self, run_dir: Path, rank: int, signum: int) -> bool:
        """Send ``signum`` to one rank (the drill's ``kill9:RANK``); whether it was reached.

        By default: the rank's recorded process (``logs/rank{r}.pid``), if it lives on this host.
        """
        pid = local_pids(run_dir, rank + 1).get(rank)
        return bool(pid) and rank in trigger({rank: pid}, signum=signum)

    def kill_rank(self, run_dir: Path, rank: int, progress: dict[int, dict[str, Any]]) -> str:
        """SIGKILL one rank (the drill's ``kill9:RANK``); what was killed ('pid 4242').

        ``progress`` is every rank's last published progress (its ``pid`` among it). ValueError
        when the rank cannot be reached. By default: the rank's recorded process on this host,
        only if it is the live process that published the progress.
        """
        if rank not in progress:
            raise ValueError(
                f"kill9:{rank}: rank {rank} published no progress (ranks: {sorted(progress)})"
            )
        pid = live_rank_pid(run_dir, rank)
        if pid is None or pid != progress[rank].get("pid"):
            raise ValueError(
                f"kill9:{rank}: rank {rank}'s recorded pid {progress[rank].get('pid')} is not its "
                "live process on this host (stale or foreign); refusing to signal it"
            )
        os.kill(pid, signal.SIGKILL)
        return f"pid {progress[rank]['pid']}"

    def node_of(self, run_dir: Path, rank: int) -> str | None:
        """The node that runs ``rank`` now, as the launcher names it; None where the launcher
        does not place ranks on nodes of its own (the ft drill's ``nodekill`` checks that the
        node it kills runs no other replica group)."""
        return None

    def kill_node(self, run_dir: Path, rank: int) -> str:
        """End the node that runs ``rank`` (the drill's ``nodekill``); what was killed. None by
        default.
        """
        raise NotImplementedError(
            f"launcher={self.name} has no nodes to kill (nodekill needs launcher=ray)"
        )


def with_hooks(cls: type) -> type:
    """``cls`` itself when it subclasses :class:`LauncherHooks`, else a subclass with the hooks'
    defaults mixed in.
    """
    if issubclass(cls, LauncherHooks):
        return cls
    return type(
        cls.__name__,
        (cls, LauncherHooks),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__},
    )
