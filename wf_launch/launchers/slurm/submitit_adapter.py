"""Every name of submitit's this project relies on, private ones included, in one place.

The dry run prints the sbatch script submitit's private renderer makes: exactly what is
submitted. :func:`check_names` lists what an upgrade removed (tests/test_upstream_names.py)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import pkgutil
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SUBMIT_MODULE = "submitit.core._submit"
"""The module every SLURM task runs (``python -u -m submitit.core._submit FOLDER``)."""
PRIVATE_NAMES = {  # what we need each for
    "submitit.slurm.slurm:_make_sbatch_string": "renders the sbatch script (dry run = submitted)",
    "submitit.slurm.slurm:_convert_mem": "launcher.mem_gb -> sbatch --mem",
    "submitit.slurm.slurm:SlurmExecutor._submitit_command_str": "the task command we print",
    "submitit.slurm.slurm:SlurmInfoWatcher._make_command": "its sacct command, run with a timeout",
}
PUBLIC_NAMES = (
    "submitit:SlurmExecutor submitit:SlurmExecutor.update_parameters submitit:SlurmExecutor.batch "
    "submitit:SlurmExecutor.submit submitit:JobEnvironment submitit.slurm.slurm:SlurmInfoWatcher "
    "submitit.slurm.slurm:SlurmInfoWatcher.register_job "
    "submitit.slurm.slurm:SlurmInfoWatcher.update submitit.slurm.slurm:SlurmInfoWatcher.get_state"
)
SBATCH_PARAMETERS = (
    "command folder map_count job_name nodes ntasks_per_node cpus_per_task time signal_delay_s "
    "srun_args additional_parameters gpus_per_node mem partition account qos constraint exclude "
    "setup"
)
"""The parameters of ``_make_sbatch_string`` that :func:`~.submit.sbatch_script` passes."""
JOB_ENVIRONMENT_ATTRS = "global_rank num_tasks local_rank num_nodes hostnames job_id"


def submitit_version() -> str:
    try:
        return str(importlib.import_module("submitit").__version__)
    except Exception as exc:  # pragma: no cover - only when submitit is broken
        return f"unknown ({exc})"


def _resolve(module: str, dotted: str) -> Any:
    return pkgutil.resolve_name(f"{module}:{dotted}")


def _missing_names() -> list[str]:
    problems: list[str] = []
    for name in [*PRIVATE_NAMES, *PUBLIC_NAMES.split()]:
        try:
            pkgutil.resolve_name(name)
        except (ImportError, AttributeError) as exc:
            why = PRIVATE_NAMES.get(name, "public")
            problems.append(f"{name.replace(':', '.')} ({why}): {type(exc).__name__}: {exc}")
    with contextlib.suppress(ImportError):
        if importlib.util.find_spec(SUBMIT_MODULE) is not None:
            return problems
    return [*problems, f"module {SUBMIT_MODULE} (what every SLURM task runs) is gone"]


def _missing_parameters() -> list[str]:
    params = inspect.signature(_resolve("submitit.slurm.slurm", "_make_sbatch_string")).parameters
    return [
        f"submitit.slurm.slurm._make_sbatch_string has no parameter {p!r}"
        for p in SBATCH_PARAMETERS.split()
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
    wanted = JOB_ENVIRONMENT_ATTRS.split()
    missing = [f"submitit.JobEnvironment has no {a!r}" for a in wanted if a not in members]
    if not isinstance(getattr(job_watcher(), "_info_dict", None), dict):  # what refresh() fills
        missing.append("submitit's SlurmInfoWatcher has no _info_dict (what get_state reads)")
    return missing


def check_names() -> list[str]:
    """What this project needs from submitit and no longer finds (empty: all there)."""
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
    """A new ``SlurmInfoWatcher``: submitit's reader of ``sacct`` for the jobs registered on it."""
    from submitit.slurm.slurm import SlurmInfoWatcher

    return SlurmInfoWatcher()


SACCT_TIMEOUT_S = 30.0  # submitit's update() waits on sacct without a bound: a stalled slurmdbd


def refresh(watcher: Any, job_ids: Iterable[str]) -> bool:
    """Register ``job_ids`` on ``watcher``, ask sacct about its jobs (one call, time-bounded);
    whether it answered (if not, the caller asks SLURM's other commands)."""
    for job_id in job_ids:
        watcher.register_job(job_id)
    command = watcher._make_command()
    if command is None:
        return True
    try:
        out = subprocess.run(command, capture_output=True, timeout=SACCT_TIMEOUT_S, check=True)
    except (OSError, subprocess.SubprocessError):
        return False
    watcher._info_dict.update(watcher.read_info(out.stdout))
    return True


def job_environment() -> Any:
    """submitit's view of the SLURM task this process is (``submitit.JobEnvironment``)."""
    from submitit import JobEnvironment

    return JobEnvironment()
