"""Running code written for torchrun inside a rank: a script as ``__main__``, a module, or a
function.

What ``python train.py ARGS`` would do, in the rank's own process: ``sys.argv`` is
``[path, *args]`` and ``sys.path[0]`` the script's folder (for ``-m``: the working
directory); the script runs as ``__main__`` (:mod:`runpy`); handlers it registers with
:mod:`atexit` run when it ends (a rank leaves without the interpreter's exit, so they
would not run otherwise). How it ends:

- it returns, or calls ``sys.exit(0)`` / ``sys.exit()``: the rank succeeds;
- ``sys.exit(n)`` with ``n != 0`` (or a message, which Python prints and exits 1 with):
  :class:`ScriptExit`, which carries ``exit_code`` (the rank then exits with that code)
  and where in the script it was called;
- it raises: the exception, as it is (the rank's root cause, with its traceback).

:func:`teardown` then ends what the code left: the stop flag's agreement in flight, the
checkpointer, the model-parallel groups and the default process group.
"""

from __future__ import annotations

import atexit
import runpy
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from worldfoundry.core.validation import is_int

__all__ = ["ScriptExit", "call_function", "run_module", "run_path", "teardown"]


class ScriptExit(Exception):
    """The code called ``sys.exit(n)`` with ``n != 0``: the rank fails and exits with
    ``exit_code``."""

    def __init__(
        self, exit_code: int, at: str, function: str = "?", message: str | None = None
    ) -> None:
        what = f"sys.exit({message!r})" if message is not None else f"sys.exit({exit_code})"
        where = f"{at} ({function})"
        super().__init__(f"{what} at {where}: the script exited with code {exit_code}")
        self.exit_code = exit_code
        self.where = where
        self.at, self.function = at, function
        """``at``: 'train.py:33', where ``sys.exit`` was called; ``function``: in which function."""


def _innermost(tb: TracebackType | None) -> tuple[str, str]:
    """('train.py:33', 'main'): where the innermost frame of ``tb`` is."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "?", "?"
    f = frames[-1]
    return f"{Path(f.filename).name}:{f.lineno}", f.name


def _exit_of(exc: SystemExit) -> tuple[int, str | None]:
    """(exit code, message) of a ``sys.exit``: None -> 0, an int -> itself, anything else -> 1
    (printed)."""
    code = exc.code
    if code is None:
        return 0, None
    if is_int(code):
        return (
            code & 0xFF,
            None,
        )  # what the process would exit with: sys.exit(-1) is 255, sys.exit(256) is 0
    return 1, str(code)


@contextmanager
def _atexit_of_the_code() -> Iterator[None]:
    """Collect the :mod:`atexit` handlers registered while the code runs; run them (newest first)
    when it ends."""
    registered: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []
    real_register, real_unregister = atexit.register, atexit.unregister

    def register(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        registered.append((func, args, kwargs))
        return func

    def unregister(func: Callable[..., Any]) -> None:
        registered[:] = [r for r in registered if r[0] != func]
        real_unregister(func)

    atexit.register, atexit.unregister = register, unregister  # type: ignore[assignment]
    try:
        yield
    finally:
        atexit.register = real_register  # type: ignore[assignment]
        atexit.unregister = real_unregister  # type: ignore[assignment]
        for func, args, kwargs in reversed(registered):
            try:
                func(*args, **kwargs)
            except Exception:
                # as the interpreter does at exit: printed, never the rank's failure
                traceback.print_exc()


@contextmanager
def _as_main(argv: list[str], path0: str) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python`` sets them; exits and errors translated (module
    docstring)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = list(argv)
    sys.path.insert(0, path0)
    try:
        with _atexit_of_the_code():
            yield
    except SystemExit as exc:
        code, message = _exit_of(exc)
        if message is not None:
            print(message, file=sys.stderr)
        if code != 0:  # with the traceback of the sys.exit call
            raise ScriptExit(code, *_innermost(exc.__traceback__), message).with_traceback(
                exc.__traceback__
            ) from None
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def run_path(path: str, args: list[str]) -> None:
    """Run the script at ``path`` as ``__main__`` with ``sys.argv = [path, *args]``."""
    with _as_main([path, *args], str(Path(path).resolve().parent)):
        runpy.run_path(path, run_name="__main__")


def run_module(module: str, args: list[str], workdir: str) -> None:
    """``python -m module args``: the module as ``__main__``, ``sys.argv[0]`` its file, ``workdir``
    on the path."""
    with _as_main([module, *args], workdir):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


def call_function(fn: Callable[..., Any], kwargs: dict[str, Any], target: str, workdir: str) -> Any:
    """``fn(**kwargs)`` (``sys.argv`` is ``[target]``), with ``sys.exit`` and errors as for a
    script; its value."""
    out: list[Any] = []
    with _as_main([target], workdir):
        out.append(fn(**kwargs))
    return out[0] if out else None


def teardown(ctx: Any) -> None:
    """End what the code left: the stop flag's collective in flight, a pending checkpoint, the
    groups.

    Both before the groups go (they need them), then ``destroy_model_parallel`` (groups
    ``dist_init`` built) and ``destroy_process_group`` (a default group the code started).
    """
    torch_dist = sys.modules.get("torch.distributed")
    alive = torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized()
    if alive:
        if ctx.stop is not None:
            ctx.stop.drain()
        if ctx._checkpointer is not None:
            ctx._checkpointer.close()
    elif ctx.stop is not None:
        ctx.stop.forget()  # the code destroyed its group: nothing left to wait for
    if "worldfoundry.core.distributed.groups" in sys.modules:
        # torch: a fresh interpreter's script must find torch not imported before it runs
        from worldfoundry.core.distributed import groups

        groups.destroy_model_parallel()
    if torch_dist is not None and torch_dist.is_available() and torch_dist.is_initialized():
        # torch, as above (torch.distributed is imported by then)
        from worldfoundry.core.distributed.runtime import settle_group_threads

        settle_group_threads()
        torch_dist.destroy_process_group()
