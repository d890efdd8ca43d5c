"""``tracking=mlflow``: one MLflow run per wf_launch run, continued by every attempt.

The store is ``tracking.mlflow.uri``, or by default a file store beside the run directory
(``RUN_DIR/../mlruns``: a sweep's points land in one store; MLflow 3 keeps file stores behind
``MLFLOW_ALLOW_FILE_STORE``, which is set for it). The first attempt creates the MLflow run (the
config as parameters, tags ``wf_launch.run_id`` and ``wf_launch.run_dir``) and keeps its id in
``tracking/mlflow.run``; every later attempt, restart, requeue or resume reopens that run. The
last step it holds is read back from MLflow itself. The attempt's end sets the run's status:
``ok`` -> FINISHED, ``interrupted`` -> KILLED, ``failed`` -> FAILED (and tag ``wf_launch.status``).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, ClassVar

from ...rundir import files
from ...rundir.claim import make_private
from ...rundir.io import read_text
from .base import Tracker, flat_params

__all__ = ["MLflowTracker"]

_STATUS = {"ok": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}
_MAX_PARAMS, _MAX_METRICS = 100, 1000
"""MLflow's limits per ``log_batch`` call."""
_TAGGED = re.compile(r"rank\d+/")


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri


class MLflowTracker(Tracker):
    """Writes one rank's metrics into the run's MLflow run (keys ``rankR/NAME`` when every rank
    tracks)."""

    name: ClassVar[str] = "mlflow"

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.client: Any = None
        self.run_id: str | None = None

    def _key(self, key: str) -> str:
        return f"rank{self.settings.rank}/{key}" if self.settings.tagged else key

    def open(self) -> int | None:
        s = self.settings
        uri = s.section.get("uri") or files.mlflow_store(s.run_dir).as_uri()
        if not s.section.get("uri"):  # the default store, beside the run: owner-only like it
            make_private(files.mlflow_store(s.run_dir))
        if _is_file_store(uri):
            os.environ.setdefault(
                "MLFLOW_ALLOW_FILE_STORE", "true"
            )  # MLflow 3: file stores are opt-in
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = _shared_run(
            files.tracker_run_file(s.run_dir, self.name),
            files.tracker_lock(s.run_dir, self.name),
            self._create,
        )
        if s.rank == 0:
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "wf_launch.attempt", str(s.attempt))
        return self._held()

    def _create(self) -> str:
        from mlflow.entities import Param

        s = self.settings
        experiment = str(s.section.get("experiment") or "wf_launch")
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:
                experiment_id = self.client.create_experiment(experiment)
            except Exception:  # another run created it meanwhile (a sweep's points share the store)
                experiment_id = self.client.get_experiment_by_name(experiment).experiment_id
        else:
            experiment_id = found.experiment_id
        run = self.client.create_run(
            experiment_id,
            run_name=s.section.get("run_name") or Path(s.run_dir).name,
            tags={
                "wf_launch.run_id": s.run_id,
                "wf_launch.run_dir": str(s.run_dir),
                "wf_launch.task": str((s.config.get("task") or {}).get("name")),
            },
        )
        params = [Param(k[:250], str(v)[:6000]) for k, v in flat_params(s.config).items()]
        for i in range(0, len(params), _MAX_PARAMS):
            self.client.log_batch(run.info.run_id, params=params[i : i + _MAX_PARAMS])
        return run.info.run_id

    def _held(self) -> int | None:
        """The last step this rank's keys have in the MLflow run (read back: exact after any
        crash)."""
        run = self.client.get_run(self.run_id)
        keys = [
            k
            for k in run.data.metrics
            if bool(_TAGGED.match(k)) == self.settings.tagged
            and (not self.settings.tagged or k.startswith(f"rank{self.settings.rank}/"))
        ]
        steps = [m.step for k in keys for m in self.client.get_metric_history(self.run_id, k)]
        return max(steps) if steps else None

    def log(self, points: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(self._key(k), v, now, step) for step, values in points for k, v in values.items()
        ]
        for i in range(0, len(metrics), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS])

    def close(self, status: str) -> None:
        if self.client is None or self.run_id is None:
            return
        if self.settings.rank == 0:
            self.client.set_tag(self.run_id, "wf_launch.status", status)
            self.client.set_terminated(self.run_id, _STATUS.get(status, "FAILED"))

    def run_ref(self) -> str | None:
        return self.run_id


def _shared_run(path: Path, lock_path: Path, create: Any) -> str:
    """The run id kept in ``path``, or ``create()``'s, written there: under a lock, so every rank
    and attempt of the run agree on one MLflow run."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            existing = read_text(path, 4096).strip()
        except FileNotFoundError:
            existing = ""
        if existing:
            return existing
        run_id = create()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(run_id + "\n")
        os.replace(tmp, path)
        return run_id
