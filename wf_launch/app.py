"""From a composed Hydra config to a launched run: validate, plan, launch, report."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from worldfoundry.core.distributed.topology import Layout

from .config.engine import EngineConfig
from .config.fields import ConfigError, config_error
from .config.ft import FtConfig
from .config.redact import redact_overrides, redact_text
from .config.tracking import TrackingConfig
from .launchers import get_launcher
from .launchers.base import run_dir_mode
from .launchers.launch_plan import LaunchPlan
from .observe.console import setup_launcher_logging
from .observe.interrupt import interrupted, raise_if_interrupted
from .observe.live import final_line
from .rank.ft import ft_enabled
from .rank.task_registry import get_task, task_config_class, task_supports_ft
from .rundir import claim as rundir_claim
from .rundir import files
from .rundir.identity import ensure_run_id
from .rundir.io import atomic_write_text
from .rundir.outcome import RunOutcome
from .rundir.record import RecordError, RunRecord, Status
from .rundir.resume import resume_hint
from .rundir.space import disk_full, release_space, reserve_space
from .rundir.text import printable

__all__ = ["resolve", "run", "validate_run_config"]

_HYDRA_FILES = {
    "config": files.hydra_config,
    "hydra": files.hydra_job,
    "overrides": files.hydra_overrides,
}
"""Where each part of Hydra's record of the command goes (``.hydra/``)."""


def resolve(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, every interpolation (``${now:}`` included) frozen once."""
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    return plain  # type: ignore[return-value]


def validate_run_config(cfg: dict[str, Any]) -> Layout:
    """Check a resolved run config (engine, launcher, task); returns the layout. Raises
    :class:`ConfigError`.

    Each section is checked through its typed dataclass: the engine's, the chosen
    launcher's (common fields, then the launcher's own ``validate``), the task's and the trackers'.
    """
    engine = EngineConfig.from_dict(cfg["engine"])
    layout = engine.layout()
    launcher_section = cfg.get("launcher") or {}
    launcher = get_launcher(str(launcher_section.get("name")))
    launcher_cfg = launcher.config_class.build(launcher_section)
    launcher_cfg.validate(layout.world_size)
    if ft_enabled(cfg) and hasattr(launcher, "validate_ft"):
        launcher.validate_ft(launcher_cfg, layout, engine)  # its ranks are not one world
    else:
        launcher.validate(launcher_cfg, layout, engine)
    task = cfg.get("task") or {}
    if not isinstance(task.get("name"), str) or not task["name"]:
        raise config_error(
            "task.name", task.get("name"), "the name of a registered task (task=NAME)"
        )
    try:
        get_task(task["name"])
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    task_config_class(task["name"]).from_task_config(task, engine)
    TrackingConfig.from_dict(cfg.get("tracking"))
    _validate_ft(cfg, launcher)
    return layout


def _validate_ft(cfg: dict[str, Any], launcher: Any) -> None:
    """``ft``: its fields, a task that steps through torchft and a launcher that runs replica
    groups.
    """
    ft = FtConfig.from_dict(cfg.get("ft"))
    if not ft.enabled:
        return
    task = cfg["task"]["name"]
    if not task_supports_ft(task):
        raise config_error(
            "ft",
            ft.name,
            f"task {task!r} does not step through torchft's Manager: use a task registered "
            "with register_task(..., ft=True) (task=train), or ft=none",
        )
    if not launcher.supports_ft:
        raise config_error(
            "ft",
            ft.name,
            f"launcher={launcher.name} does not run replica groups: use launcher=local, ray "
            "or slurm, or ft=none",
        )
    if not cfg["launcher"].get("wait", True):
        raise config_error(
            "launcher.wait",
            False,
            "true under ft=torchft: the launching command supervises the Lighthouse and the "
            "replica groups",
        )


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    """:func:`resolve`, with an interpolation or a missing value that cannot be resolved as a config
    error."""
    try:
        return resolve(cfg)
    except OmegaConfBaseException as exc:
        where = getattr(exc, "full_key", None)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{where}: {text}" if where else text) from None


def _record_invalid(run_dir: Path, overrides: list[str], message: str, cfg: DictConfig) -> None:
    """Leave ``result.json`` (status 'invalid', the error) so sweep reports can list the point."""
    task = OmegaConf.select(cfg, "task.name", default=None, throw_on_resolution_failure=False)
    launcher = OmegaConf.select(
        cfg, "launcher.name", default=None, throw_on_resolution_failure=False
    )
    RunRecord(
        Status.INVALID,
        run_dir=str(run_dir),
        overrides=list(overrides),
        final=True,
        task=task if isinstance(task, str) else None,
        launcher=launcher if isinstance(launcher, str) else None,
        failure={"cause": "invalid_config", "message": message},
        finished_at=time.time(),
    ).write()


def run(
    cfg: DictConfig,
    run_dir: Path,
    overrides: list[str],
    hydra_record: dict[str, str] | None = None,
    sweep_point: bool = False,
) -> RunOutcome:
    """Claim the run directory, validate ``cfg``, write the run record's inputs, and launch (or
    print the plan).

    A run directory holds one run: launching into one that holds a run (or that a
    live launch owns) is refused with exit code 2 before anything is written,
    unless ``launcher.overwrite=true`` (the old run is moved aside) or
    ``launcher.resume=true`` (the interrupted run continues there); either is refused
    while the run there may still be going (its launcher's ``is_live``). A dry run
    claims nothing and writes nothing there. ``hydra_record`` (file name -> YAML) is
    Hydra's record of the command, written into ``.hydra/`` once the directory is claimed.
    ``launcher.resume=auto`` continues the run there if there is one, else starts one; so does
    ``true`` for a ``sweep_point`` (a resumed sweep runs the points it never started).
    """
    rundir_claim.private_umask()
    dry_run = OmegaConf.select(cfg, "launcher.dry_run", default=False) is True
    claim = None
    if not dry_run:
        try:
            claim = rundir_claim.claim(
                run_dir,
                OmegaConf.select(cfg, "launcher.overwrite", default=False) is True,
                _resume_setting(cfg, sweep_point),
                is_live=_existing_run_live,
            )
        except rundir_claim.RunDirInUse as exc:
            print(printable(f"wf_launch: {exc}"), file=sys.stderr)
            return RunOutcome(Status.INVALID, run_dir, str(exc))
        try:
            for name, text in (hydra_record or {}).items():
                atomic_write_text(_HYDRA_FILES[name](run_dir), text)
        except OSError as exc:
            claim.release()
            return _cannot_write(run_dir, overrides, exc)
        reserve_space(run_dir)
    try:
        return _validate_and_launch(cfg, run_dir, overrides, dry_run)
    except BaseException as exc:
        if claim is None or not (isinstance(exc, KeyboardInterrupt) or interrupted()):
            raise
        return _interrupted_at_start(run_dir, overrides, cfg)
    finally:
        if claim is not None:
            release_space(run_dir)
            claim.release()


def _resume_setting(cfg: DictConfig, sweep_point: bool) -> bool | str:
    """``launcher.resume`` as the claim takes it: True, False or "auto"."""
    value = OmegaConf.select(cfg, "launcher.resume", default=False)
    if value == "auto" or (value is True and sweep_point):
        return "auto"
    return value is True


def _existing_run_live(run_dir: Path) -> bool:
    """Whether the run already in ``run_dir`` may still be going, asked of the launcher that ran
    it."""
    name = files.launcher_name(run_dir)
    if not isinstance(name, str):
        return rundir_claim.launch_alive(run_dir)
    try:
        launcher = get_launcher(name)
    except ConfigError:  # a launcher not installed here: only its lock can tell
        return rundir_claim.launch_alive(run_dir)
    return bool(launcher.is_live(run_dir))


def _interrupted_at_start(run_dir: Path, overrides: list[str], cfg: DictConfig) -> RunOutcome:
    """Ctrl-C while the launch was setting up (before its launcher took over): a record, the final
    line, and how to resume, never a traceback. A record the launcher already finalized stays as it
    is."""

    try:
        record = RunRecord.read(run_dir)
    except RecordError:
        record = None
    if record is None or not record.final:
        message = "interrupted by SIGINT (Ctrl-C) while the run was starting: no rank had started"
        task = OmegaConf.select(cfg, "task.name", default=None, throw_on_resolution_failure=False)
        record = RunRecord.finalize(
            run_dir,
            Status.INTERRUPTED,
            signal_name="SIGINT",
            overrides=list(overrides),
            task=task if isinstance(task, str) else None,
            failure={"cause": "interrupt", "signal": "SIGINT", "message": message},
        )
        hint = resume_hint(run_dir, overrides)
        record_summary = f"{message}\n  {hint}" if hint else message
    else:
        record_summary = ""
    outcome = RunOutcome.of(record, run_dir, record_summary)
    logger.info(final_line(outcome))
    if outcome.summary:
        print(outcome.summary, file=sys.stderr, flush=True)
    return outcome


def _validate_and_launch(
    cfg: DictConfig, run_dir: Path, overrides: list[str], dry_run: bool
) -> RunOutcome:
    try:
        config = _resolved(cfg)
        layout = validate_run_config(config)
    except (ConfigError, ValueError) as exc:
        message = redact_text(str(exc))  # a refused value may be a secret
        print(printable(f"wf_launch: config error: {message}", multiline=True), file=sys.stderr)
        if not dry_run:
            _record_invalid(run_dir, redact_overrides(overrides), message, cfg)
        return RunOutcome(Status.INVALID, run_dir, message)
    plan = LaunchPlan(config=config, layout=layout, run_dir=run_dir, overrides=list(overrides))
    launcher = get_launcher(plan.launcher)
    if dry_run:
        task_text = task_config_class(plan.task).build(config["task"]).describe(plan)
        print(
            f"{plan.layout.describe()}\n\n{plan.layout_table()}\n\n{launcher.describe(plan)}"
            + (f"\n\n{task_text}" if task_text else "")
        )
        return RunOutcome(Status.DRY_RUN, run_dir)
    try:
        _write_inputs(config, run_dir, overrides)
    except OSError as exc:
        return _cannot_write(run_dir, overrides, exc)
    raise_if_interrupted()  # a Ctrl-C that an import of the task's modules swallowed
    outcome = launcher.launch(plan)
    if outcome.status not in (Status.SUBMITTED, Status.INVALID):
        logger.info(
            final_line(outcome)
        )  # every launcher's run ends with it; the root cause follows
    if outcome.summary:
        print(
            printable(outcome.summary, multiline=True),
            file=sys.stderr if outcome.exit_code else sys.stdout,
            flush=True,
        )
    if outcome.record is not None and outcome.record.unwritten:
        print(printable(f"wf_launch: {outcome.record.unwritten}"), file=sys.stderr, flush=True)
    logger.complete()
    return outcome


def _write_inputs(config: dict[str, Any], run_dir: Path, overrides: list[str]) -> None:
    """The run directory's mode, ``launcher.log``, ``config.yaml``, ``overrides.yaml``,
    ``run_id``."""
    os.chmod(run_dir, run_dir_mode(config["launcher"].get("run_dir_mode", "0700")))
    setup_launcher_logging(run_dir / files.LAUNCHER_LOG)
    atomic_write_text(files.config_path(run_dir), OmegaConf.to_yaml(OmegaConf.create(config)))
    atomic_write_text(
        run_dir / files.OVERRIDES, OmegaConf.to_yaml(OmegaConf.create(list(overrides)))
    )
    logger.debug(
        f"run id {ensure_run_id(run_dir)}"
    )  # written once: every attempt, requeue and resume reads it


def _cannot_write(run_dir: Path, overrides: list[str], exc: OSError) -> RunOutcome:
    """The run directory cannot be written (a full disk, a quota, a read-only mount) before any
    rank started: one line, a ``failed`` record if one can still be written, exit 1."""
    full = disk_full(run_dir, exc)
    message = f"cannot write the run directory {run_dir} ({exc})"
    print(printable(f"wf_launch: {message}"), file=sys.stderr, flush=True)
    record = RunRecord.finalize(
        run_dir,
        Status.FAILED,
        overrides=list(overrides),
        failure={
            "cause": "disk_full" if full else "unwritable",
            "type": type(exc).__name__,
            "message": message,
        },
    )
    if record.unwritten:
        rundir_claim.restore_record(run_dir)  # a resume's: the run's own story stays readable
    return RunOutcome(Status.FAILED, run_dir, "", record)
