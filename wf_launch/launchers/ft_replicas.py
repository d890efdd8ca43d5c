"""What every launcher's ``ft=torchft`` run shares: each replica group's run directory, and the
run's ``result.json`` once every replica group has ended.

A replica group is an ordinary run of the engine layout in ``RUN_DIR/replicas/{k}``, with its
own rendezvous and groups; the launcher (:mod:`.local.replicas`, :mod:`.ray.replicas`) runs
them side by side with one Lighthouse, and records the whole run here.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.ft import FtConfig
from ..rundir import files
from ..rundir.io import atomic_write_json
from ..rundir.outcome import RunOutcome
from ..rundir.pids import process_start
from ..rundir.record import RunRecord, Status
from ..rundir.resume import resume_hint
from .ft_lighthouse import LOOPBACK, Lighthouse
from .ft_record import compose_ft

if TYPE_CHECKING:
    from .launch_plan import LaunchPlan

__all__ = [
    "describe_ft",
    "lighthouse_failed",
    "prepare_replica_dir",
    "record_replicas",
    "start_lighthouse",
]


def prepare_replica_dir(plan: LaunchPlan, k: int) -> Path:
    """Replica group ``k``'s run directory: made, its mark of an earlier launch removed, the
    run's id (kept from an earlier launch) and config copied in."""
    replica_dir = files.ft_replica_dir(plan.run_dir, k)
    replica_dir.mkdir(parents=True, exist_ok=True)
    files.ft_joined(replica_dir).unlink(missing_ok=True)
    for name, keep in ((files.RUN_ID, True), (files.CONFIG, False)):
        src = plan.run_dir / name
        if src.exists() and not (keep and (replica_dir / name).exists()):
            shutil.copyfile(src, replica_dir / name)
    return replica_dir


def describe_ft(plan: LaunchPlan, each: str, lighthouse_host: str) -> list[str]:
    """The dry run's lines under ``ft=torchft``: the replica groups (``each``: what each group
    is on this launcher), their restarts and the Lighthouse."""
    if not plan.config.get("ft") or plan.config["ft"].get("name", "none") == "none":
        return []
    ft = plan.config["ft"]
    n = int(ft["replicas"])
    where = ft["lighthouse"] or (
        f"started by the launcher on {lighthouse_host} (restarted if it dies)"
    )
    return [
        f"ft            torchft: {n} replica groups x {plan.world_size} rank(s) = "
        f"{n * plan.world_size} ranks, min_replicas {ft['min_replicas']}; each group {each} "
        f"in {files.ft_replica_dir(plan.run_dir, 0).parent}/{{0..{n - 1}}}",
        f"              max_replica_restarts {ft['max_replica_restarts']} (per group; the "
        "others keep stepping); launcher.max_restarts is not used",
        f"lighthouse    {where}",
    ]


def start_lighthouse(
    plan: LaunchPlan, ft: FtConfig, host: str = LOOPBACK
) -> tuple[Lighthouse | None, str]:
    """The Lighthouse the launcher starts on ``host`` (None with ``ft.lighthouse`` given), and
    the address every replica group's Managers use; raises :class:`LighthouseFailed`."""
    if ft.lighthouse is not None:
        return None, f"http://{ft.lighthouse}"
    record = files.ft_lighthouse_pid(plan.run_dir)

    def on_start(pid: int, address: str) -> None:
        host = socket.gethostname()
        info = {"pid": pid, "host": host, "start": process_start(pid), "address": address}
        atomic_write_json(record, info)

    log = files.ft_lighthouse_log(plan.run_dir)
    lighthouse = Lighthouse(ft, log, host=host, on_start=on_start).start()
    return lighthouse, lighthouse.address


def lighthouse_failed(plan: LaunchPlan, message: str) -> RunOutcome:
    """The run's record when the Lighthouse the launcher starts does not start."""
    failure = {"cause": "lighthouse", "message": message}
    record = RunRecord.finalize(plan.run_dir, Status.FAILED, **plan.run_info(), failure=failure)
    return RunOutcome.of(record, plan.run_dir, message)


def record_replicas(
    plan: LaunchPlan,
    ft: FtConfig,
    codes: dict[int, int | None],
    lighthouse_restarts: int,
    signal_name: str | None,
    wall: float,
    **extra: Any,
) -> RunOutcome:
    """The run's ``result.json``: every replica group's ranks and the ``ft`` section (``codes``:
    each replica group's exit code, None where it left none)."""
    section, facts = compose_ft(plan.run_dir, ft, plan.world_size, codes)
    section["lighthouse_restarts"] = lighthouse_restarts
    failed = sorted(k for k, c in codes.items() if c != 0)
    status = Status.OK
    summary = ""
    if signal_name is not None:
        status = Status.INTERRUPTED
        summary = f"interrupted by {signal_name}: every replica group was stopped"
        hint = resume_hint(plan.run_dir, plan.overrides, files.ft_replica_dir(plan.run_dir, 0))
        summary += f"\n  {hint}" if hint else ""
        facts["failure"] = {"cause": "interrupt", "signal": signal_name, "message": summary}
    elif failed:
        status = Status.FAILED
        summary = facts["failure"]["message"]
    record = RunRecord.finalize(
        plan.run_dir,
        status,
        signal_name=signal_name,
        **plan.run_info(),
        **facts,
        **extra,
        ft=section,
        timings={"wall_s": round(wall, 4)},
    )
    return RunOutcome.of(record, plan.run_dir, summary)
