"""From a composed Hydra config to a launched run: validate, plan, launch, report."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from loguru import logger
from omegaconf import DictConfig, OmegaConf

from . import rundir
from .config import ConfigError, validate_run_config
from .launchers import get_launcher
from .outcome import EXIT_CONFIG, RunOutcome
from .plan import LaunchPlan
from .ranklog import setup_launcher_logging


def resolve(cfg: DictConfig) -> dict[str, Any]:
    """The config as plain data, every interpolation (``${now:}`` included) frozen once."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


def _record_invalid(run_dir: Path, overrides: list[str], message: str) -> None:
    """Leave ``result.json`` (status 'invalid', the error) so sweep reports can list the point."""
    rundir.atomic_write_json(run_dir / rundir.RESULT, {
        "status": "invalid", "exit_code": EXIT_CONFIG, "overrides": list(overrides), "run_dir": str(run_dir),
        "failure": {"cause": "invalid_config", "message": message}, "finished_at": time.time()})


def run(cfg: DictConfig, run_dir: Path, overrides: list[str]) -> RunOutcome:
    """Validate ``cfg``, write the run record's inputs, and launch (or print the plan)."""
    try:
        config = resolve(cfg)
        layout = validate_run_config(config)
    except (ConfigError, ValueError) as exc:
        print(f"wf_launch: config error: {exc}", file=sys.stderr)
        _record_invalid(run_dir, overrides, str(exc))
        return RunOutcome("invalid", EXIT_CONFIG, run_dir, str(exc))
    plan = LaunchPlan(config=config, layout=layout, run_dir=run_dir, overrides=list(overrides))
    launcher = get_launcher(plan.launcher)
    if config["launcher"].get("dry_run"):
        print(f"{plan.layout.describe()}\n\n{plan.layout_table()}\n\n{launcher.describe(plan)}")
        return RunOutcome("dry_run", 0, run_dir, "")
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_launcher_logging(run_dir / rundir.LAUNCHER_LOG)
    rundir.atomic_write_text(run_dir / rundir.CONFIG, OmegaConf.to_yaml(OmegaConf.create(config)))
    rundir.atomic_write_text(run_dir / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    outcome = launcher.launch(plan)
    if outcome.summary:
        print(outcome.summary, file=sys.stderr if outcome.exit_code else sys.stdout, flush=True)
    logger.complete()
    return outcome
