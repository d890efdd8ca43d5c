"""From a composed Hydra config to a launched run: validate, plan, launch, report."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger
from omegaconf import DictConfig, OmegaConf

from . import rundir
from .config import ConfigError
from .launchers import get_launcher
from .outcome import RunOutcome
from .plan import LaunchPlan
from .ranklog import setup_launcher_logging
from .record import RunRecord, Status
from .schema import validate_run_config

__all__ = ["resolve", "run"]


def resolve(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, every interpolation (``${now:}`` included) frozen once."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


def _record_invalid(run_dir: Path, overrides: list[str], message: str) -> None:
    """Leave ``result.json`` (status 'invalid', the error) so sweep reports can list the point."""
    RunRecord(Status.INVALID, run_dir=str(run_dir), overrides=list(overrides), final=True,
              failure={"cause": "invalid_config", "message": message}, finished_at=time.time()).write()


def run(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> RunOutcome:
    """Validate ``cfg``, write the run record's inputs, and launch (or print the plan)."""
    try:
        config = resolve(cfg)
        layout = validate_run_config(config)
    except (ConfigError, ValueError) as exc:
        print(f"wf_launch: config error: {exc}", file=sys.stderr)
        _record_invalid(run_dir, overrides, str(exc))
        return RunOutcome(Status.INVALID, run_dir, str(exc))
    plan = LaunchPlan(config=config, layout=layout, run_dir=run_dir, overrides=list(overrides))
    launcher = get_launcher(plan.launcher)
    if config["launcher"].get("dry_run"):
        print(f"{plan.layout.describe()}\n\n{plan.layout_table()}\n\n{launcher.describe(plan)}")
        return RunOutcome(Status.DRY_RUN, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_launcher_logging(run_dir / rundir.LAUNCHER_LOG)
    rundir.atomic_write_text(run_dir / rundir.CONFIG, OmegaConf.to_yaml(OmegaConf.create(config)))
    rundir.atomic_write_text(run_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    outcome = launcher.launch(plan)
    if outcome.summary:
        print(outcome.summary, file=sys.stderr if outcome.exit_code else sys.stdout, flush=True)
    logger.complete()
    return outcome
