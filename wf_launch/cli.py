"""``python -m wf_launch`` / ``wf-launch``: Hydra's real CLI in front of
:func:`wf_launch.app.run`."""

from __future__ import annotations

import os
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files as resource_files
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .app import run
from .config.engine import EngineConfig
from .config.fields import ConfigError
from .config.overrides import hydra_config_error, refuse_schemas, task_modules
from .config.redact import redact_log_records, redact_text
from .config.run import RunConfig
from .launchers.registry import registered_launchers
from .launchers.sweep_resume import kept_outcome
from .observe.interrupt import catch_sigint, deferred, exit_interrupted, interrupted, undefer
from .rank.task_registry import load_task_modules, registered_configs
from .rundir.claim import remove_made_folders
from .rundir.outcome import RunOutcome
from .rundir.record import EXIT_CONFIG

__all__ = ["config_groups_help", "main", "register_configs"]

_UID = uuid.uuid4().hex[:6]
"""Six hex digits of this command's run directory (``${wf_uid:}``); renewed by :func:`main`."""
_STARTED = time.time()
_RUN_DIRS: list[Path] = []
"""The run directories Hydra made for this command, in order."""


def _hydra_record(cfg: DictConfig) -> dict[str, str]:
    """Hydra's record of this command (its composed config, its own config, the overrides) as YAML
    texts.

    Hydra would write them into ``.hydra/`` before the app runs (``hydra.output_subdir``);
    wf_launch's config turns that off and the app writes them once the run directory is
    claimed, so a refused launch or a dry run never touches a run directory's ``.hydra/``.
    """
    hydra_cfg = HydraConfig.instance().cfg
    return {
        "config": OmegaConf.to_yaml(cfg),
        "hydra": OmegaConf.to_yaml(hydra_cfg),
        "overrides": OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task),
    }


def _app(cfg: DictConfig) -> object:
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    _RUN_DIRS.append(run_dir)
    undefer()  # a Ctrl-C held since composition raises here, where the folder is known
    if hc.mode == RunMode.MULTIRUN and OmegaConf.select(cfg, "launcher.resume", default=False) in (
        True,
        "auto",
    ):
        kept = kept_outcome(run_dir)  # a resumed sweep: a point that ended ok is kept
        if kept is not None:
            return kept
    _restore_full_error()
    try:
        outcome = _launch(cfg, hc, run_dir)
    except Exception:
        if interrupted():  # an import a Ctrl-C cut short fails later: not a bug to show
            raise KeyboardInterrupt from None
        raise
    if OmegaConf.select(cfg, "launcher.dry_run", default=False) is True or outcome.record is None:
        remove_made_folders(run_dir, _STARTED)  # Hydra made it; a dry run or a refusal leaves none
    if hc.mode == RunMode.MULTIRUN:
        return outcome
    if outcome.exit_code:
        sys.exit(outcome.exit_code)
    return outcome


def _has_yaml(group: str, name: str) -> bool:
    try:
        return (resource_files("wf_launch.conf") / group / f"{name}.yaml").is_file()
    except (ModuleNotFoundError, FileNotFoundError):
        return False


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (the YAML in ``wf_launch/conf/`` builds on it).

    Every registered launcher's config class is stored as ``launcher/NAME_schema``;
    a launcher without a YAML file of its own (a third-party one) is also
    selectable as ``launcher=NAME`` with its dataclass defaults.
    """
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(group="engine", name="engine_schema", node=EngineConfig)
    for name, cls in registered_launchers().items():
        cs.store(group="launcher", name=f"{name}_schema", node=cls.config_class)
        if not _has_yaml("launcher", name):
            cs.store(group="launcher", name=name, node=cls.config_class(name=name))
    for name, node in registered_configs().items():
        cs.store(group="task", name=name, node=node)


def _launch(cfg: DictConfig, hc: Any, run_dir: Path) -> RunOutcome:
    """:func:`wf_launch.app.run` with the overrides as typed (``${...}`` unresolved)."""

    try:
        overrides = OmegaConf.to_container(
            hc.overrides.task, resolve=False
        )  # as typed: ${...} unresolved
        return run(
            cfg,
            run_dir,
            [str(o) for o in overrides],
            _hydra_record(cfg),
            sweep_point=hc.mode == RunMode.MULTIRUN,
        )
    finally:
        os.environ[_FULL_ERROR] = "1"  # the next sweep point's composition errors reach _main too


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

    Resolved as ``${wf_config_groups:}`` in wf_launch/conf/hydra/help/wf_launch.yaml, through
    Hydra's public config loader of the running app.
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

    Every config mistake exits 2 with one line naming the override and what is allowed,
    whether our validation or Hydra's composition caught it (:mod:`wf_launch.config.overrides`).
    Ctrl-C before the run directory is claimed ends with exit 130 and one line, whatever it
    interrupted (:mod:`wf_launch.observe.interrupt`); after, with the run's record. Once Hydra is
    done, the process leaves through ``os._exit`` after flushing: every file is written and every
    rank has ended by then, and skipping the interpreter's teardown of torch's C++ state saves
    about a second per launch.
    """
    _new_command()
    catch_sigint()
    argv = sys.argv[1:]
    code = 0
    try:
        code = _main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        if not interrupted():
            raise
        for run_dir in [*_RUN_DIRS, *_hydra_run_dir()]:  # no run claimed: Hydra's folders go
            remove_made_folders(run_dir, _STARTED)
        exit_interrupted()
    from loguru import logger

    logger.complete()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _new_command() -> None:
    """This command's own run-directory suffix and start time. Set at import, they would be
    shared by every command of a process forked from one that imported this module (a test
    harness, a user's launcher): two such commands in one second took the same run directory."""
    global _UID, _STARTED
    _UID, _STARTED = uuid.uuid4().hex[:6], time.time()


def _hydra_run_dir() -> list[Path]:
    """The run directory Hydra makes for a single run, once it has composed (a Ctrl-C may come
    between its making the folder and the app's start)."""
    try:
        hc = HydraConfig.get()
        return [] if hc.mode == RunMode.MULTIRUN else [Path(str(hc.run.dir))]
    except Exception:  # not composed yet, or not resolvable: Hydra made nothing
        return []


def _main(argv: list[str]) -> int:
    """Compose and run; returns the exit code (config errors: 2, with one line on stderr)."""
    redact_log_records()  # Hydra logs every sweep point's overrides, secrets included
    try:
        try:
            load_task_modules(task_modules(argv))
        except ImportError as exc:
            raise ConfigError(str(exc)) from exc
        register_configs()
        refuse_schemas(argv)
        OmegaConf.register_new_resolver("wf_uid", lambda: _UID, replace=True)
        OmegaConf.register_new_resolver(
            "wf_config_groups",
            config_groups_help if _shows_hydra_config(argv) else str,
            replace=True,
        )
        with _hydra_raises(), deferred():  # held until _app has noted Hydra's run dir
            hydra.main(
                version_base="1.3", config_path="pkg://wf_launch.conf", config_name="config"
            )(_app)()
    except Exception as exc:
        error = None if interrupted() else hydra_config_error(exc, argv)
        if error is None:
            raise
        if _USER_FULL_ERROR[0] == "1":
            traceback.print_exception(exc)
        print(f"wf_launch: config error: {redact_text(str(error))}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


_FULL_ERROR = "HYDRA_FULL_ERROR"
_USER_FULL_ERROR: list[str | None] = [None]


@contextmanager
def _hydra_raises() -> Iterator[None]:
    """Let Hydra's composition errors reach us as exceptions (``HYDRA_FULL_ERROR=1``) instead of its
    own print-and-exit-1, so that they become config errors (exit 2); the user's setting is back in
    force while the app runs (the ranks inherit it) and afterwards."""
    _USER_FULL_ERROR[0] = os.environ.get(_FULL_ERROR)
    os.environ[_FULL_ERROR] = "1"
    try:
        yield
    finally:
        _restore_full_error()


def _restore_full_error() -> None:
    if _USER_FULL_ERROR[0] is None:
        os.environ.pop(_FULL_ERROR, None)
    else:
        os.environ[_FULL_ERROR] = _USER_FULL_ERROR[0]
