"""Every name of submitit's this project relies on, private ones included, in one place.

submitit renders the sbatch script with a private function and starts each task with a
private module; the dry run shows that exact script, so we call the same function.
Nothing else in the repository touches a ``submitit`` name except through this module
(``export_rank_env`` uses the public ``JobEnvironment``, imported here too).
:func:`check_names` lists what an upgrade removed or changed; tests/test_upstream_names.py
fails loudly on it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import pkgutil
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "SUBMIT_MODULE",
    "check_names",
    "convert_mem",
    "job_environment",
    "job_watcher",
    "make_sbatch_string",
    "refresh",
    "slurm_executor",
    "submit_command",
    "submitit_version",
]

SUBMIT_MODULE = "submitit.core._submit"
"""The module every SLURM task runs (``python -u -m submitit.core._submit FOLDER``)."""

# (module, attribute, what we need from it): the private and public names we use.
PRIVATE_NAMES = (
    (
        "submitit.slurm.slurm",
        "_make_sbatch_string",
        "renders the sbatch script (dry run = what is submitted)",
    ),
    ("submitit.slurm.slurm", "_convert_mem", "launcher.mem_gb -> sbatch --mem"),
    (
        "submitit.slurm.slurm",
        "SlurmExecutor._submitit_command_str",
        "the task command our dry run prints",
    ),
)
PUBLIC_NAMES = (
    ("submitit", "SlurmExecutor", "submits jobs and job arrays"),
    ("submitit", "SlurmExecutor.update_parameters", "sbatch parameters"),
    ("submitit", "SlurmExecutor.batch", "one job array per sweep shape"),
    ("submitit", "SlurmExecutor.submit", "submits a job"),
    ("submitit", "JobEnvironment", "rank variables inside a task"),
    ("submitit.slurm.slurm", "SlurmInfoWatcher", "sacct's state of every job waited on"),
    ("submitit.slurm.slurm", "SlurmInfoWatcher.register_job", "watches a job"),
    ("submitit.slurm.slurm", "SlurmInfoWatcher.update", "one sacct call for every job"),
    ("submitit.slurm.slurm", "SlurmInfoWatcher.get_state", "a job's state from that call"),
)
# Parameters of _make_sbatch_string that sbatch_parameters() and sbatch_script() pass.
SBATCH_PARAMETERS = (
    "command",
    "folder",
    "map_count",
    "job_name",
    "nodes",
    "ntasks_per_node",
    "cpus_per_task",
    "time",
    "signal_delay_s",
    "srun_args",
    "additional_parameters",
    "gpus_per_node",
    "mem",
    "partition",
    "account",
    "qos",
    "constraint",
    "exclude",
    "setup",
)
JOB_ENVIRONMENT_ATTRS = (
    "global_rank",
    "num_tasks",
    "local_rank",
    "num_nodes",
    "hostnames",
    "job_id",
)


def submitit_version() -> str:
    try:
        return str(importlib.import_module("submitit").__version__)
    except Exception as exc:  # pragma: no cover - only when submitit is broken
        return f"unknown ({exc})"


def _resolve(module: str, dotted: str) -> Any:
    return pkgutil.resolve_name(f"{module}:{dotted}")


def _missing_names() -> list[str]:
    problems: list[str] = []
    for module, name, why in (*PRIVATE_NAMES, *PUBLIC_NAMES):
        try:
            _resolve(module, name)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{module}.{name} ({why}): {type(exc).__name__}: {exc}")
    try:
        found = importlib.util.find_spec(SUBMIT_MODULE) is not None
    except ImportError:
        found = False
    return (
        problems
        if found
        else [*problems, f"module {SUBMIT_MODULE} (what every SLURM task runs) is gone"]
    )


def _missing_parameters() -> list[str]:
    params = inspect.signature(_resolve("submitit.slurm.slurm", "_make_sbatch_string")).parameters
    return [
        f"submitit.slurm.slurm._make_sbatch_string has no parameter {p!r}"
        for p in SBATCH_PARAMETERS
        if p not in params
    ]


def _changed_command() -> list[str]:
    folder = Path("/nonexistent/wf_launch_check")
    executor_class = _resolve("submitit", "SlurmExecutor")
    # built without __init__, which refuses a machine with no srun; the property reads these two
    executor = executor_class.__new__(executor_class)
    executor.folder, executor.python = folder, shlex.quote(sys.executable)
    actual = executor._submitit_command_str
    if actual == submit_command(folder):
        return []
    return [
        f"SlurmExecutor._submitit_command_str is now {actual!r}, "
        f"our dry run prints {submit_command(folder)!r}"
    ]


def _missing_attributes() -> list[str]:
    members = {n for n, _ in inspect.getmembers(_resolve("submitit", "JobEnvironment"))}
    return [
        f"submitit.JobEnvironment has no attribute {a!r}"
        for a in JOB_ENVIRONMENT_ATTRS
        if a not in members
    ]


def check_names() -> list[str]:
    """What this project needs from submitit and no longer finds (empty: all there).

    A name that is gone is listed once, by :func:`_missing_names`; the finer checks that
    need it then say nothing more.
    """
    problems: list[str] = []
    for check in (_missing_names, _missing_parameters, _changed_command, _missing_attributes):
        try:
            problems += check()
        except (ImportError, AttributeError):
            pass
        except Exception as exc:
            problems.append(f"{check.__name__.strip('_')}: {type(exc).__name__}: {exc}")
    return problems


def make_sbatch_string(**kwargs: Any) -> str:
    """submitit's sbatch script for these parameters (exactly what ``SlurmExecutor`` submits)."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(**kwargs)


def convert_mem(mem_gb: float) -> str:
    """GB as submitit writes ``--mem`` (``16GB``, ``1536MB``)."""
    from submitit.slurm.slurm import _convert_mem

    return _convert_mem(float(mem_gb))


def submit_command(folder: Path) -> str:
    """The command submitit puts in the sbatch script (``SlurmExecutor._submitit_command_str``)."""
    return " ".join(
        [shlex.quote(sys.executable), f"-u -m {SUBMIT_MODULE}", shlex.quote(str(folder))]
    )


def slurm_executor(folder: Path, max_num_timeout: int, **parameters: Any) -> Any:
    """A ``submitit.SlurmExecutor`` on ``folder`` with these sbatch parameters."""
    from submitit import SlurmExecutor

    ex = SlurmExecutor(folder=folder, max_num_timeout=max_num_timeout)
    ex.update_parameters(**parameters)
    return ex


def job_watcher() -> Any:
    """A new ``SlurmInfoWatcher``: submitit's reader of ``sacct`` for the jobs registered on it.

    One per wait (or per status question): :func:`refresh` asks sacct about every job on it
    that has not ended, in one call, and the ended ones keep their last state.
    """
    from submitit.slurm.slurm import SlurmInfoWatcher

    return SlurmInfoWatcher()


class _SacctFailed(logging.Filter):
    """Catches submitit's warning that a sacct call failed (and keeps it off the console)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        self.failed = self.failed or record.levelno >= logging.WARNING
        return record.levelno < logging.WARNING


def refresh(watcher: Any, job_ids: Iterable[str]) -> bool:
    """Register ``job_ids`` on ``watcher`` and ask sacct about its jobs now (one call); whether
    sacct answered.

    submitit logs a warning when sacct fails (no accounting, slurmdbd down) and goes on; the
    warning is kept off the console: the caller asks SLURM's other commands instead.
    """
    for job_id in job_ids:
        watcher.register_job(job_id)
    log, caught = logging.getLogger("submitit"), _SacctFailed()
    log.addFilter(caught)
    try:
        watcher.update()
    finally:
        log.removeFilter(caught)
    return not caught.failed


def job_environment() -> Any:
    """submitit's view of the SLURM task this process is (``submitit.JobEnvironment``)."""
    from submitit import JobEnvironment

    return JobEnvironment()
