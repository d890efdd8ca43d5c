"""``python -m wf_launch`` / ``wf-launch``: Hydra's real CLI in front of :func:`wf_launch.app.run`."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .config.run import register_configs
from .rundir.claim import remove_made_folders
from .tasks.registry import load_task_modules

__all__ = ["main"]

_UID = uuid.uuid4().hex[:6]
_STARTED = time.time()


def _hydra_record(cfg: DictConfig) -> dict[str, str]:
    """Hydra's record of this command (its composed config, its own config, the overrides) as YAML texts.

    Hydra would write them into ``.hydra/`` before the app runs (``hydra.output_subdir``);
    wf_launch's config turns that off and the app writes them once the run directory is
    claimed, so a refused launch or a dry run never touches a run directory's ``.hydra/``.
    """
    hydra_cfg = HydraConfig.instance().cfg
    return {"config": OmegaConf.to_yaml(cfg), "hydra": OmegaConf.to_yaml(hydra_cfg),
            "overrides": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task)}


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
    run_dir = Path(hc.runtime.output_dir)
    if hc.mode == RunMode.MULTIRUN and OmegaConf.select(cfg, "launcher.resume", default=False) is True:
        from .tools.sweep.resume import kept_outcome

        kept = kept_outcome(run_dir)  # a resumed sweep: a point that ended ok is kept
        if kept is not None:
            return kept
    outcome = run(cfg, run_dir, list(hc.overrides.task), _hydra_record(cfg))
    if OmegaConf.select(cfg, "launcher.dry_run", default=False) is True:
        remove_made_folders(run_dir, _STARTED)  # Hydra made it; a dry run leaves nothing
    if hc.mode == RunMode.MULTIRUN:
        return outcome
    if outcome.exit_code:
        sys.exit(outcome.exit_code)
    return outcome


def _shows_hydra_config(argv: list[str]) -> bool:
    """Whether this command prints the help text (or the Hydra config holding it).

    Hydra resolves the help template on every run; listing the config groups walks
    every group (about 0.15 s), so a plain launch resolves it to an empty string.
    """
    flags = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve"}
    return any(a.split("=", 1)[0] in flags for a in argv)


def config_groups_help() -> str:
    """The ``--help`` listing of config groups, like Hydra's ``$APP_CONFIG_GROUPS`` but without the
    ``*_schema`` entries (the structured configs the YAML builds on: nothing a user picks).

    Resolved as ``${wf_config_groups:}`` in wf_launch/conf/hydra/help/wf_launch.yaml, through Hydra's public
    config loader of the running app.
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()

    def groups(parent: str = "") -> list[str]:
        found: list[str] = []
        for group in loader.list_groups(parent):
            name = f"{parent}/{group}" if parent else group
            if name == "hydra" or name.startswith("hydra/"):
                continue
            if loader.get_group_options(name, ObjectType.CONFIG):
                found.append(name)
            if loader.get_group_options(name, ObjectType.GROUP):
                found += groups(name)
        return found

    lines = []
    for group in sorted(set(groups())):
        options = [o for o in sorted(loader.get_group_options(group)) if not o.endswith("_schema")]
        if options:
            lines.append(f"{group}: {', '.join(options)}")
    return "\n".join(lines)


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
        OmegaConf.register_new_resolver("wf_uid", lambda: _UID, replace=True)
        OmegaConf.register_new_resolver("wf_config_groups", config_groups_help if _shows_hydra_config(sys.argv[1:])
                                        else str, replace=True)
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
