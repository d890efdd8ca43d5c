"""``task=call``: call a plain function on every rank (docs/scripts.md).

``python -m wf_launch task=call task.target=my_pkg.train:main 'task.kwargs={lr:0.1}'``

The function runs in each rank's process with torchrun's environment, like a script
(:mod:`.script`): it starts its own process group, and wf_launch tears down what it
left. It gets ``ctx`` (the rank's :class:`~wf_launch.rank.task_context.TaskContext`, without
groups) when its signature has a ``ctx`` parameter. Its return value is the rank's
result: a dict as it is, None as nothing, any other JSON-able value as ``{"value": v}``.
The module is imported in the launcher to check the target and the keyword arguments
before anything starts (a forked rank then finds it imported).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.fields import config_error
from ..rank import script_api, user_code
from ..rank.task_registry import register_task
from .script import OwnGroupConfig, describe_ranks
from .torchrun_env import export

if TYPE_CHECKING:
    from ..config.engine import EngineConfig
    from ..launchers.launch_plan import LaunchPlan
    from ..rank.task_context import TaskContext

__all__ = ["CallConfig", "call", "resolve_target"]

_TARGET = re.compile(
    r"(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<attr>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)"
)


@dataclass
class CallConfig(OwnGroupConfig):
    """``task.target`` (``module:function``) and ``task.kwargs`` (its keyword arguments)."""

    name: str = "call"
    target: str | None = None
    kwargs: Any = None

    def validate(self, engine: EngineConfig | None = None) -> None:
        super().validate(engine)
        fn = resolve_target(self.target, Path(self.workdir))
        kwargs = _kwargs(self.kwargs)
        if "ctx" in kwargs and _asks_for_ctx(fn):
            raise config_error(
                "task.kwargs",
                kwargs,
                "keyword arguments other than ctx (wf_launch passes the rank's context as ctx)",
            )
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            return  # a builtin without a signature: the call itself will tell
        try:
            signature.bind(**kwargs, **({"ctx": None} if _asks_for_ctx(fn) else {}))
        except TypeError as exc:
            raise config_error(
                "task.kwargs",
                kwargs,
                f"the keyword arguments of {self.target}{inspect.signature(fn)}: {exc}",
            ) from None

    def describe(self, plan: LaunchPlan) -> str:
        module, _, attr = str(self.target).partition(":")
        args = ", ".join(f"{k}={v!r}" for k, v in _kwargs(self.kwargs).items())
        code = f"import {module} as m; m.{attr}({args})"
        return "\n".join(
            [
                f"call          {self.target}({args}) in each rank's own process",
                *describe_ranks(plan, self.workdir, ["-c", code]),
            ]
        )


def _asks_for_ctx(fn: Callable[..., Any]) -> bool:
    """Whether ``fn``'s signature has a ``ctx`` parameter (it then gets the rank's context)."""
    try:
        return "ctx" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _kwargs(kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(
        isinstance(k, str) and k.isidentifier() for k in kwargs
    ):
        raise config_error(
            "task.kwargs",
            kwargs,
            "a mapping of keyword argument names to values, e.g. 'task.kwargs={lr:0.1,steps:10}'",
        )
    return dict(kwargs)


@contextmanager
def _importable_from(workdir: Path) -> Iterator[None]:
    sys.path.insert(0, str(workdir))
    try:
        yield
    finally:
        try:
            sys.path.remove(str(workdir))
        except ValueError:
            pass


def resolve_target(target: Any, workdir: Path) -> Callable[..., Any]:
    """The function ``module:function`` names (imported with ``workdir`` first on the path).

    ConfigError naming ``task.target``: not of that form, a module that cannot be imported,
    a name that does not exist or is not callable.
    """
    m = _TARGET.fullmatch(target) if isinstance(target, str) else None
    if m is None:
        raise config_error("task.target", target, "module:function, e.g. my_pkg.train:main")
    with _importable_from(workdir):
        try:
            obj: Any = importlib.import_module(m["module"])
        except ImportError as exc:
            raise config_error(
                "task.target", target, f"an importable module (import {m['module']} failed: {exc})"
            ) from None
    for part in m["attr"].split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise config_error(
                "task.target",
                target,
                f"a function of {m['module']} ({part!r} does not exist there)",
            ) from None
    if not callable(obj):
        raise config_error(
            "task.target", target, f"a callable ({m['attr']} is a {type(obj).__name__})"
        )
    return obj


def _as_result(value: Any, target: str) -> dict[str, Any]:
    if value is None:
        return {}
    out = value if isinstance(value, dict) else {"value": value}
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"{target} returned {type(value).__name__}, which is not JSON-able: {exc}"
        ) from exc
    return out


@register_task("call", config=CallConfig, own_group=True)
def call(ctx: TaskContext) -> dict[str, Any]:
    """Call the function on this rank: torchrun's environment, the launch directory, ``ctx`` if it
    asks."""

    cfg: CallConfig = ctx.cfg
    export(ctx.config, ctx.run_dir)
    if Path(cfg.workdir).is_dir():
        os.chdir(cfg.workdir)
    fn = resolve_target(cfg.target, Path(cfg.workdir))
    kwargs = _kwargs(cfg.kwargs)
    if _asks_for_ctx(fn):
        kwargs["ctx"] = ctx
    value = user_code.call_function(fn, kwargs, str(cfg.target), cfg.workdir)
    user_code.teardown(ctx)
    return {**script_api.reported(), **_as_result(value, str(cfg.target))}
