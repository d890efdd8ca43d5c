"""Every file name of a run directory, in one place (docs/run-dir.md describes each file).

Nothing else in the project spells a run-directory file name: launchers, ranks and
tools ask this module for paths, and read the run's resolved ``config.yaml`` through
:func:`read_config`. :data:`FORMAT_VERSION` is written into ``result.json``; a record
without one comes from a run made before the format was versioned (version 0), and
still reads.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .io import never_follow, read_yaml

__all__ = [
    "CHECKPOINTS",
    "CODE",
    "CONFIG",
    "ELASTIC_LOGS",
    "ENVIRONMENT",
    "FORMAT_VERSION",
    "HYDRA",
    "LAUNCHER_LOG",
    "LOCK",
    "LOGS",
    "MARKERS",
    "METRICS",
    "MLFLOW_STORE",
    "OVERRIDES",
    "OWN_FOLDERS",
    "RAY_RUN",
    "RESERVE",
    "RESULT",
    "RUN_ID",
    "SLURM_JOB",
    "SNAPSHOT_MANIFEST",
    "SUBMITIT",
    "SWEEP_CHART",
    "SWEEP_CSV",
    "SWEEP_MD",
    "SWEEP_PLAN",
    "SWEEP_SCALING",
    "SWEEP_STEPS",
    "TENSORBOARD",
    "TRACKING",
    "TUNE_ASIDE",
    "TUNE_BEST",
    "TUNE_CHART",
    "TUNE_CONF",
    "TUNE_CSV",
    "TUNE_MD",
    "TUNE_ROUNDS",
    "TUNE_STATE",
    "WANDB",
    "attempt_file",
    "attempt_number",
    "config_path",
    "ft_address",
    "ft_events",
    "ft_joined",
    "ft_lighthouse_log",
    "ft_lighthouse_pid",
    "ft_replica_dir",
    "hydra_config",
    "hydra_job",
    "hydra_overrides",
    "is_own_folder",
    "launcher_name",
    "metrics_chart",
    "metrics_file",
    "mlflow_store",
    "rank_error",
    "rank_errors",
    "rank_exit",
    "rank_files",
    "rank_log",
    "rank_marker",
    "rank_pid",
    "rank_preempt",
    "rank_progress",
    "rank_stacks",
    "rank_tail_log",
    "read_config",
    "result_before_attempt",
    "run_id_file",
    "stacks_glob",
    "tensorboard_dir",
    "tracker_lock",
    "tracker_run_file",
    "tracker_state",
    "tune_round_dir",
    "tune_round_log",
    "wandb_dir",
]

FORMAT_VERSION = 1
"""Version of the run directory's format, recorded in ``result.json`` as ``format_version``."""

RESULT = "result.json"
CONFIG = "config.yaml"
OVERRIDES = "overrides.yaml"
ENVIRONMENT = "environment.json"
LAUNCHER_LOG = "launcher.log"
LOCK = ".wf_launch.lock"
RESERVE = ".wf_launch.reserve"
LOGS = "logs"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
CODE = "code"
SNAPSHOT_MANIFEST = "SNAPSHOT.json"
SLURM_JOB = "slurm_job.json"
RAY_RUN = "ray_run.json"
SUBMITIT = "submitit"
HYDRA = ".hydra"
ELASTIC_LOGS = ".elastic"
RUN_ID = "run_id"
"""The run's stable id (one line), written once when the run directory is first set up
(:mod:`.identity`)."""
TRACKING = "tracking"
"""Each experiment tracker's state across attempts (``tracking/NAME.json``: the last step it holds,
its run id)."""
TENSORBOARD = "tensorboard"
WANDB = "wandb"
MLFLOW_STORE = "mlruns"
"""The default MLflow file store, beside the run directory (``RUN_DIR/../mlruns``): a sweep's points
share one."""

SWEEP_PLAN = "multirun.yaml"
SWEEP_CSV, SWEEP_MD, SWEEP_CHART = "sweep_summary.csv", "sweep_summary.md", "sweep_chart.png"
SWEEP_SCALING, SWEEP_STEPS = "sweep_scaling.png", "sweep_steps.png"
"""A sweep directory's own files: Hydra's plan, and the report (:mod:`wf_launch.readers.sweep`)."""

TUNE_STATE, TUNE_MD, TUNE_CSV, TUNE_CHART, TUNE_BEST = (
    "tune.json",
    "tune_report.md",
    "tune_report.csv",
    "tune_chart.png",
    "best.yaml",
)
TUNE_CONF, TUNE_ROUNDS, TUNE_ASIDE = "conf", "rounds", "aside"
"""A tune directory's own files (:mod:`wf_launch.drivers.tune`): its state, the report, the winner,
the trial
configs, one sweep directory per round, and trials set aside on a resume."""

OWN_FOLDERS = frozenset(
    {LOGS, HYDRA, ELASTIC_LOGS, CHECKPOINTS, TRACKING, TENSORBOARD, WANDB, SUBMITIT}
    | {TUNE_CONF, TUNE_ROUNDS, TUNE_ASIDE}
)
"""The folders a run, sweep, tune or drill makes inside itself; with the step folders of
``checkpoints/``, a link in place of one is never followed (:func:`.io.never_follow`)."""
_STEP_FOLDER = re.compile(r"\.?step_\d+(\.[a-z]+-[0-9a-f]+)?")


def is_own_folder(name: str) -> bool:
    """Whether ``name`` is one of :data:`OWN_FOLDERS` or a checkpoint's step folder (hidden ones
    too)."""
    return name in OWN_FOLDERS or _STEP_FOLDER.fullmatch(name) is not None


never_follow(is_own_folder)

MARKERS = (RESULT, CONFIG, LAUNCHER_LOG, LOGS, SLURM_JOB)
"""What a launch leaves in its run directory: any of them means the directory holds a run."""

_RANK_FILES = {
    "log": "rank{}.log",
    "error": "rank{}.error.json",
    "progress": "rank{}.progress.json",
    "stacks": "rank{}.stacks",
    "pid": "rank{}.pid",
    "preempt": "rank{}.preempt.json",
    "exit": "rank{}.exit.json",
}


def _logs(run_dir: Path | str) -> Path:
    return Path(run_dir) / LOGS


def rank_log(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` logs (every record, tracebacks, faulthandler dumps)."""
    return _logs(run_dir) / _RANK_FILES["log"].format(rank)


def rank_tail_log(log: Path) -> Path:
    """Where a capped rank log continues (``rankN.tail.log``, rotated to ``.1``)."""
    return log.with_name(log.stem + ".tail.log")


def rank_error(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` records the exception it failed with."""
    return _logs(run_dir) / _RANK_FILES["error"].format(rank)


def rank_errors(run_dir: Path | str) -> list[Path]:
    """Every rank's failure record in the run directory (of any attempt)."""
    return sorted(_logs(run_dir).glob(_RANK_FILES["error"].format("*")))


def rank_files(run_dir: Path | str, kind: str) -> dict[int, Path]:
    """Rank -> path of each rank's file of ``kind`` that exists (``log``, ``error``, ``progress``,
    ``stacks``, ``pid``, ``preempt``), in rank order: readers loop over the files a run has, never
    over a world size."""
    prefix, suffix = _RANK_FILES[kind].split("{}")
    found: dict[int, Path] = {}
    try:
        paths = list(_logs(run_dir).glob(_RANK_FILES[kind].format("*")))
    except OSError:
        return {}
    for path in paths:
        digits = path.name[len(prefix) : len(path.name) - len(suffix)]
        if (
            digits.isascii()
            and digits.isdigit()
            and len(digits) <= 9
            and str(int(digits)) == digits
        ):
            found[int(digits)] = path
    return dict(sorted(found.items()))


def rank_progress(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` publishes its latest progress (``ctx.progress``)."""
    return _logs(run_dir) / _RANK_FILES["progress"].format(rank)


def rank_stacks(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` appends its stack dumps."""
    return _logs(run_dir) / _RANK_FILES["stacks"].format(rank)


def stacks_glob(run_dir: Path | str) -> str:
    """How the stack dumps of every rank are named, for messages:
    ``RUN_DIR/logs/rank{r}.stacks``."""
    return str(_logs(run_dir) / _RANK_FILES["stacks"].format("{r}"))


def rank_pid(run_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` records its pid, host and main thread."""
    return _logs(run_dir) / _RANK_FILES["pid"].format(rank)


def rank_preempt(run_dir: Path | str, rank: int) -> Path:
    """Where a rank records that it handled the preemption signal (and its hook's outcome)."""
    return _logs(run_dir) / _RANK_FILES["preempt"].format(rank)


def rank_exit(run_dir: Path | str, rank: int) -> Path:
    """Where a rank of a task that starts its own group (a script) records how it ended and what it
    reported."""
    return _logs(run_dir) / _RANK_FILES["exit"].format(rank)


def rank_marker(run_dir: Path | str, rank: int, phase: str) -> Path:
    """Where a rank records (with its attempt) that it ``arrived`` at ``dist_init`` or ``joined``
    the groups."""
    if phase not in ("arrived", "joined"):
        raise ValueError(f"rank_marker: phase={phase!r}; expected 'arrived' or 'joined'")
    return _logs(run_dir) / f"rank{rank}.{phase}"


def attempt_file(run_dir: Path | str, attempt: int) -> Path:
    """Where attempt ``attempt`` (0, 1, ...) of the run is recorded."""
    return _logs(run_dir) / f"attempt{attempt}.json"


def attempt_number(path: Path) -> int | None:
    """The attempt a file from :func:`attempt_file` records (None: not such a file, or a number over
    9 digits)."""
    digits = path.stem.removeprefix("attempt")
    ok = (
        path.suffix == ".json"
        and path.stem.startswith("attempt")
        and digits.isascii()
        and digits.isdigit()
    )
    return int(digits) if ok and len(digits) <= 9 else None


def result_before_attempt(run_dir: Path | str, attempt: int) -> Path:
    """Where ``launcher.resume`` keeps the record of the run before attempt ``attempt``."""
    return _logs(run_dir) / f"result.before-attempt{attempt}.json"


def metrics_file(run_dir: Path | str) -> Path:
    """``metrics.jsonl``: one line per ``ctx.progress`` call with metrics, every rank."""
    return Path(run_dir) / METRICS


def run_id_file(run_dir: Path | str) -> Path:
    """Where the run's stable id lives (the same for every attempt, restart, requeue and resume)."""
    return Path(run_dir) / RUN_ID


def tracker_state(run_dir: Path | str, tracker: str, rank: int = 0) -> Path:
    """Tracker ``tracker``'s state on ``rank`` (``tracking/NAME.json``; ``NAME.rankR.json`` for
    other ranks)."""
    return (
        Path(run_dir)
        / TRACKING
        / (f"{tracker}.json" if rank == 0 else f"{tracker}.rank{rank}.json")
    )


def tracker_run_file(run_dir: Path | str, tracker: str) -> Path:
    """The id of the run a tracker keeps for this run across attempts (``tracking/NAME.run``)."""
    return Path(run_dir) / TRACKING / f"{tracker}.run"


def tracker_lock(run_dir: Path | str, tracker: str) -> Path:
    """The lock under which a tracker's run is created once for every rank and attempt
    (``tracking/NAME.lock``)."""
    return Path(run_dir) / TRACKING / f"{tracker}.lock"


def tensorboard_dir(run_dir: Path | str, rank: int | None = None) -> Path:
    """TensorBoard's event files: ``tensorboard/`` (rank 0), or ``tensorboard/rank{r}/`` with every
    rank tracked."""
    base = Path(run_dir) / TENSORBOARD
    return base if rank is None else base / f"rank{rank}"


def wandb_dir(run_dir: Path | str) -> Path:
    """Where W&B keeps its local run files (``wandb/``, offline runs included)."""
    return Path(run_dir) / WANDB


def mlflow_store(run_dir: Path | str) -> Path:
    """The default MLflow file store of a run: ``mlruns/`` beside the run directory."""
    return Path(run_dir).absolute().parent / MLFLOW_STORE


def metrics_chart(run_dir: Path | str) -> Path:
    """Where ``python -m wf_launch.plot`` draws the metrics by default."""
    return Path(run_dir) / "metrics.png"


def config_path(run_dir: Path | str) -> Path:
    """The run's resolved config, as the launcher froze it."""
    return Path(run_dir) / CONFIG


def hydra_config(run_dir: Path | str) -> Path:
    """Hydra's own copy of the composed config (``.hydra/config.yaml``), written before the run is
    claimed."""
    return Path(run_dir) / HYDRA / "config.yaml"


def hydra_job(run_dir: Path | str) -> Path:
    """Hydra's own config of the job (``.hydra/hydra.yaml``: its number in a sweep, its
    overrides)."""
    return Path(run_dir) / HYDRA / "hydra.yaml"


def hydra_overrides(run_dir: Path | str) -> Path:
    """Hydra's record of the command line's overrides (``.hydra/overrides.yaml``)."""
    return Path(run_dir) / HYDRA / "overrides.yaml"


def read_config(run_dir: Path | str, strict: bool = False) -> dict[str, Any]:
    """The run's resolved ``config.yaml`` as a dict.

    Lenient by default: ``{}`` when it is missing, unreadable or not a mapping. With
    ``strict`` those raise ``ValueError`` naming the file (``OSError`` when missing).
    Only a regular file of at most 64 MiB is read (a FIFO or a huge file is unreadable).
    """

    path = config_path(run_dir)
    try:
        config = read_yaml(path)
        if config is None and not path.exists():
            raise FileNotFoundError(2, "No such file or directory", str(path))
    except OSError:
        if strict:
            raise
        return {}
    except ValueError as exc:
        if strict:
            why = getattr(exc, "why", None) or f"not readable YAML ({exc})"
            raise ValueError(f"{path}: {why}") from None
        return {}
    if not isinstance(config, dict):
        if strict:
            raise ValueError(f"{path}: expected a mapping, found {type(config).__name__}")
        return {}
    return config


def launcher_name(run_dir: Path | str) -> str | None:
    """The name of the launcher that ran ``run_dir``, from its ``config.yaml`` (None when it names
    none)."""
    launcher = read_config(run_dir).get("launcher")
    name = launcher.get("name") if isinstance(launcher, dict) else None
    return name if isinstance(name, str) else None


def tune_round_dir(tune_dir: Path | str, round_index: int) -> Path:
    """The sweep directory of a tune's round ``round_index`` (``rounds/r0``, ...)."""
    return Path(tune_dir) / TUNE_ROUNDS / f"r{round_index}"


def tune_round_log(tune_dir: Path | str, round_index: int) -> Path:
    """The console output of a tune's round (its ``python -m wf_launch -m`` sweep)."""
    return Path(tune_dir) / TUNE_ROUNDS / f"r{round_index}.log"


FT_REPLICAS = "replicas"
"""``ft=torchft``: each replica group's own run directory is ``RUN_DIR/replicas/{k}``."""


def ft_replica_dir(run_dir: Path | str, replica: int) -> Path:
    """Replica group ``replica``'s run directory (its logs, checkpoints and record) under ``ft``."""
    return Path(run_dir) / FT_REPLICAS / str(replica)


def ft_events(replica_dir: Path | str) -> Path:
    """A replica group's torchft events (starts, heals), one JSON object a line, by its rank 0."""
    return Path(replica_dir) / "ft_events.jsonl"


def ft_joined(replica_dir: Path | str) -> Path:
    """A replica group's mark for the others starting with it: ``joined`` once its Manager is up
    (by its rank 0), ``ended`` once its launch is over (nobody waits for it then)."""
    return Path(replica_dir) / "ft_joined"


def ft_phase(replica_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` of a replica group is in its step loop: ``quorum`` (waiting for one) or
    ``step`` (in a step), since when, at which step; rewritten twice a step. The launcher reads
    every rank's to tell a hung group from one waiting for it."""
    return Path(replica_dir) / f"ft_phase.rank{rank}.json"


def ft_address(replica_dir: Path | str, rank: int) -> Path:
    """Where rank ``rank`` of a replica group served its state for healing peers (torchft's
    checkpoint transport address), one line per attempt."""
    return _logs(replica_dir) / f"rank{rank}.ft_address"


def ft_lighthouse_log(run_dir: Path | str) -> Path:
    """The log of the Lighthouse the launcher started (``ft.lighthouse=null``)."""
    return Path(run_dir) / "lighthouse.log"


def ft_lighthouse_pid(run_dir: Path | str) -> Path:
    """The process of the Lighthouse the launcher runs now (a pid record, as a rank's), rewritten
    at each restart: the drill's ``lighthouse@STEP`` kills it."""
    return Path(run_dir) / "lighthouse.pid"
