"""``task=script``: run an unmodified torchrun script on every rank (docs/scripts.md).

``python -m wf_launch task=script task.path=train.py 'task.args=[--lr,0.1,--cp,${engine.cp_size}]'``

Every rank runs the script as ``__main__`` with ``sys.argv = [path, *args]`` in the
rank process itself (a forked rank keeps the fast start; ``task.fresh_interpreter=true``
runs it in a new interpreter instead), in the working directory the command was
started from, with torchrun's environment (:mod:`.torchrun_env`). ``task.module=pkg.train``
is the ``python -m`` form. The script starts its own process group
(``dist.init_process_group()`` or ``worldfoundry.core.distributed.dist_init()``);
wf_launch starts none for it and tears down what it left. Each rank's result is its
exit code plus what it reported through ``wf_launch.report_result``.

On a launcher that runs a copy of the code (SLURM's ``launcher.snapshot=true``), a
script inside the copied project runs from the copy, and so do the modules it imports
from there; the working directory stays the one the command was started from, so
relative data paths keep working.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from importlib.machinery import PathFinder
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.fields import check_fields, config_error, flag, integer
from ..config.task import TaskConfig
from ..launchers.snapshot import project_root
from ..rank import script_api, user_code
from ..rank.task_registry import register_task
from ..rundir import files
from ..rundir.io import read_json
from .torchrun_env import TORCHRUN_VARS, export, torchrun_environ

if TYPE_CHECKING:
    from ..config.engine import EngineConfig
    from ..launchers.launch_plan import LaunchPlan
    from ..rank.task_context import TaskContext

__all__ = ["OwnGroupConfig", "ScriptConfig", "argv_of", "describe_ranks", "in_code_copy", "script"]

_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
DESCRIBE_EDGE = 8
"""The dry run lists every rank's command up to twice this many ranks, else the first and last this
many.
"""


@dataclass
class OwnGroupConfig(TaskConfig):
    """What every task running code that starts its own process group has (``task=script``,
    ``task=call``).
    """

    workdir: str = "${hydra:runtime.cwd}"
    fresh_interpreter: bool = flag(False)
    keep: int = integer(3, low=1, note="(complete checkpoints kept by wf_launch.checkpoint)")

    def validate(self, engine: EngineConfig | None = None) -> None:
        if not isinstance(self.workdir, str) or not Path(self.workdir).is_dir():
            raise config_error(
                "task.workdir",
                self.workdir,
                "an existing directory (default: where the command was started)",
            )
        check_fields(self, "task", OwnGroupConfig)


@dataclass
class ScriptConfig(OwnGroupConfig):
    """``task.path`` (a file, relative to ``task.workdir``) or ``task.module`` (``python -m``), and
    ``task.args``.
    """

    name: str = "script"
    path: str | None = None
    module: str | None = None
    args: Any = field(default_factory=list)

    def validate(self, engine: EngineConfig | None = None) -> None:
        super().validate(engine)
        if (self.path is None) == (self.module is None):
            which = "both are set" if self.path is not None else "neither is set"
            raise config_error(
                "task.path",
                self.path,
                f"set exactly one of task.path (a script) and task.module "
                f"(python -m pkg.train); {which}",
            )
        argv_of(self.args)
        if self.path is not None:
            _check_path(self.path, Path(self.workdir))
        else:
            _check_module(self.module, Path(self.workdir))

    def describe(self, plan: LaunchPlan) -> str:
        where = self.path if self.path is not None else f"-m {self.module}"
        head = f"script        {where} as __main__ " + (
            "in a fresh interpreter per rank (task.fresh_interpreter)"
            if self.fresh_interpreter
            else "in each rank's own process"
        )
        command = (
            [_shown_path(self.path, self.workdir, plan)]
            if self.path is not None
            else ["-m", str(self.module)]
        )
        return "\n".join(
            [head, *describe_ranks(plan, self.workdir, [*command, *argv_of(self.args)])]
        )


def argv_of(args: Any) -> list[str]:
    """``task.args`` as the strings the code sees; numbers and booleans (as Hydra parses them) as
    their text.

    ConfigError naming ``task.args`` for anything else (not a list, a nested list, a mapping, null).
    """
    if isinstance(args, (str, bytes)) or not isinstance(args, (list, tuple)):
        raise config_error(
            "task.args",
            args,
            "a list of strings, e.g. 'task.args=[--lr,0.1,--cp,${engine.cp_size}]'",
        )
    out = []
    for i, arg in enumerate(args):
        if isinstance(arg, bool):
            out.append("true" if arg else "false")
        elif isinstance(arg, (str, int, float)):
            out.append(str(arg))
        else:
            raise config_error(
                f"task.args[{i}]",
                arg,
                "a string (or a number, passed as its text); quote "
                "arguments with commas or brackets: 'task.args=[\"a,b\"]'",
            )
    return out


def _check_path(path: Any, workdir: Path) -> None:
    if not isinstance(path, str) or not path.strip():
        raise config_error("task.path", path, "the path of a Python script")
    target = workdir / path
    if not (target.is_file() or (target / "__main__.py").is_file()):
        raise config_error("task.path", path, f"an existing script (not found: {target})")
    if not os.access(target, os.R_OK):
        raise config_error("task.path", path, f"a readable script ({target} cannot be read)")


def find_module(module: str, workdir: Path) -> bool:
    """Whether ``python -m module`` started in ``workdir`` would find it, without importing
    anything.

    Searches ``workdir`` and ``sys.path`` package by package (:class:`PathFinder`); a
    package counts when it has ``__main__.py``. Modules only a meta-path hook knows of (some
    editable installs) are asked of :func:`importlib.util.find_spec`, which imports the parents.
    """
    parts, locations = module.split("."), [str(workdir), *sys.path]
    spec = None
    for i, part in enumerate(parts):
        spec = PathFinder.find_spec(".".join(parts[: i + 1]) if i else part, locations)
        if spec is None:
            break
        locations = list(spec.submodule_search_locations or [])
    if spec is not None:
        return spec.submodule_search_locations is None or any(
            (Path(loc) / "__main__.py").is_file() for loc in spec.submodule_search_locations
        )
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _check_module(module: Any, workdir: Path) -> None:
    if not isinstance(module, str) or not _MODULE.fullmatch(module):
        raise config_error(
            "task.module", module, "a dotted module name, e.g. pkg.train (python -m pkg.train)"
        )
    if not find_module(module, workdir):
        raise config_error(
            "task.module",
            module,
            f"a module python -m can run from {workdir} (no module "
            f"{module!r} on the path, or a package without __main__.py)",
        )


def _shown_path(path: str, workdir: str, plan: LaunchPlan) -> str:
    """The script as the ranks will run it: in the code copy when the launcher runs one."""
    target = (Path(workdir) / path).resolve()
    if getattr(plan.launcher_config, "snapshot", False):
        root = project_root()
        if root is not None and target.is_relative_to(root):
            return str(plan.run_dir.absolute() / files.CODE / target.relative_to(root))
    return path


def describe_ranks(plan: LaunchPlan, workdir: str, command: list[str]) -> list[str]:
    """The dry run's lines: the working directory, the environment every rank shares, each rank's
    command.
    """

    world = plan.world_size
    per_node = world // max(1, int(getattr(plan.launcher_config, "nodes", 1) or 1))
    envs = [
        torchrun_environ(
            plan.config,
            plan.run_dir,
            {
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(r % per_node),
                "LOCAL_WORLD_SIZE": str(per_node),
                "MASTER_ADDR": "<first node>" if per_node < world else "127.0.0.1",
                "MASTER_PORT": "<chosen at launch>",
                "TORCHELASTIC_RUN_ID": "<chosen at launch>",
            },
        )
        for r in range(world)
    ]
    common = {k: v for k, v in envs[0].items() if all(e[k] == v for e in envs)}
    varying = [k for k in [*TORCHRUN_VARS, *envs[0]] if k not in common]
    lines = [
        f"working dir   {workdir}",
        "environment   " + " ".join(f"{k}={shlex.quote(v)}" for k, v in common.items()),
    ]
    shown = (
        range(world)
        if world <= 2 * DESCRIBE_EDGE
        else [*range(DESCRIBE_EDGE), *range(world - DESCRIBE_EDGE, world)]
    )
    python = shlex.join([sys.executable, *command])
    for r in shown:
        if world > 2 * DESCRIBE_EDGE and r == world - DESCRIBE_EDGE:
            lines.append(f"... {world - 2 * DESCRIBE_EDGE} more ranks")
        lines.append(
            f"rank {r:<8} "
            + " ".join(f"{k}={envs[r][k]}" for k in dict.fromkeys(varying))
            + f" {python}"
        )
    return lines


def code_copy() -> tuple[Path, Path] | None:
    """(project, its copy) when this rank runs from a launcher's code copy (SLURM's snapshot), else
    None.
    """
    copy = Path(__file__).resolve().parents[2]  # what holds the imported wf_launch package
    try:
        manifest = read_json(copy / files.SNAPSHOT_MANIFEST)
    except ValueError:
        return None
    if not isinstance(manifest, dict) or not manifest.get("source"):
        return None
    return Path(manifest["source"]), copy


def in_code_copy(path: Path, copy: tuple[Path, Path] | None) -> Path:
    """``path`` inside the code copy when it is part of the copied project (and copied), else
    ``path``.
    """
    if copy is None:
        return path
    source, root = copy
    resolved = path.resolve()
    if resolved.is_relative_to(source) and (root / resolved.relative_to(source)).exists():
        return root / resolved.relative_to(source)
    return path


@register_task("script", config=ScriptConfig, own_group=True)
def script(ctx: TaskContext) -> dict[str, Any]:
    """Run the script (or module) on this rank: torchrun's environment, the launch directory,
    ``__main__``.
    """

    cfg: ScriptConfig = ctx.cfg
    export(ctx.config, ctx.run_dir)
    workdir, copy = Path(cfg.workdir), code_copy()
    os.chdir(workdir if workdir.is_dir() else in_code_copy(workdir, copy))
    args = argv_of(cfg.args)
    if cfg.path is not None:
        path = in_code_copy(workdir / cfg.path, copy)
        user_code.run_path(
            cfg.path if path == workdir / cfg.path else str(path), args
        )  # argv[0] as given
    else:
        user_code.run_module(str(cfg.module), args, str(in_code_copy(workdir, copy)))
    user_code.teardown(ctx)
    return {"exit_code": 0, **script_api.reported()}
