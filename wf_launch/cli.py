"""``python -m wf_launch`` / ``wf-launch``: Hydra's real CLI in front of :func:`wf_launch.app.run`."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .schema import register_configs
from .tasks.registry import load_task_modules

__all__ = ["main"]

_UID = uuid.uuid4().hex[:6]


def _task_modules_from_argv(argv: list[str]) -> list[str]:
    """``task.modules=[a,b]`` / ``+task.modules=a`` from the command line, so user tasks
    register (and get a ``task=NAME`` config) before Hydra composes."""
    mods: list[str] = []
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "task.modules":
            value = value.strip().strip("[]")
            mods += [m.strip().strip("'\"") for m in value.split(",") if m.strip()]
    return mods


def _app(cfg: DictConfig) -> object:
    from .app import run

    hc = HydraConfig.get()
    outcome = run(cfg, Path(hc.runtime.output_dir), list(hc.overrides.task))
    if hc.mode == RunMode.MULTIRUN:
        return outcome
    if outcome.exit_code:
        sys.exit(outcome.exit_code)
    return outcome


def main() -> None:
    """Console entry point.

    Once Hydra is done, the process leaves through ``os._exit`` after flushing:
    every file is written and every rank has ended by then, and skipping the
    interpreter's teardown of torch's C++ state saves about a second per launch.
    """
    code = 0
    try:
        load_task_modules(_task_modules_from_argv(sys.argv[1:]))
        register_configs()
        from hydra_plugins.wf_launch_slurm.wf_slurm_launcher import register as register_slurm_launcher

        register_slurm_launcher()
        OmegaConf.register_new_resolver("wf_uid", lambda: _UID, replace=True)
        hydra.main(version_base="1.3", config_path="pkg://wf_launch.conf", config_name="config")(_app)()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    from loguru import logger

    logger.complete()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
