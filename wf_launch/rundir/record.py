"""The run record: the one reader and writer of a run directory's ``result.json``.

Every launcher, rank 0, ``status``, the sweep report and the runs list go through
:class:`RunRecord`. A run's :class:`Status` decides its exit code, in one table
(:data:`EXIT_CODES`); an interrupted run exits 128 + the signal's number.

Rank 0 writes a record with status ``ok`` and the ranks' results; the launcher
then *finalizes* it (adds its own facts and the exit code). A record without an
exit code is therefore not final yet (a SLURM job whose launcher detached).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from worldfoundry.core.distributed.topology import Layout
from worldfoundry.core.validation import is_int, is_number

from . import files
from .identity import RunIdError, read_run_id
from .io import UnreadableFile, atomic_write_json, read_json
from .space import using_reserve

try:
    from enum import StrEnum
except ImportError:  # Python 3.10

    class StrEnum(str, Enum):  # type: ignore[no-redef]
        """A str-valued Enum whose str() is its value."""

        def __str__(self) -> str:
            return str(self.value)


__all__ = [
    "EXIT_CODES",
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_OK",
    "RecordError",
    "RunRecord",
    "Status",
    "exit_code_of",
    "layout_record",
]


class Status(StrEnum):
    """How a run ended (or where it stands)."""

    OK = "ok"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    INVALID = "invalid"
    SUBMITTED = "submitted"
    DRY_RUN = "dry_run"
    UNKNOWN = "unknown"

    @property
    def is_failure(self) -> bool:
        """Whether the run did not do its work (a non-zero exit code)."""
        return EXIT_CODES[self] != 0


EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2

EXIT_CODES: dict[Status, int] = {
    Status.OK: EXIT_OK,
    Status.SUBMITTED: EXIT_OK,
    Status.DRY_RUN: EXIT_OK,
    Status.FAILED: EXIT_FAILED,
    Status.INVALID: EXIT_CONFIG,
    Status.TIMEOUT: 124,
    Status.CANCELLED: 128 + signal.SIGTERM,
    Status.INTERRUPTED: 128 + signal.SIGINT,
    Status.UNKNOWN: 3,
}
"""Exit code of each status; an interrupted run uses 128 + its signal instead
(:func:`exit_code_of`)."""


def exit_code_of(status: Status | str, signal_name: str | None = None) -> int:
    """The process exit code for ``status`` (``signal_name`` refines 'interrupted': 'SIGTERM' ->
    143)."""
    status = Status(status)
    if status is Status.INTERRUPTED and signal_name:
        try:
            return 128 + int(signal.Signals[signal_name])
        except KeyError:
            pass
    return EXIT_CODES[status]


_KINDS: dict[str, tuple[type, ...]] = {
    "run_dir": (str,),
    "task": (str, type(None)),
    "launcher": (str, type(None)),
    "overrides": (list,),
    "layout": (dict, type(None)),
    "results": (dict,),
    "timings": (dict,),
    "hosts": (list,),
    "failure": (dict, type(None)),
    "exits": (dict, type(None)),
    "attempts": (list,),
    "environment": (dict, type(None)),
    "signal": (str, type(None)),
    "run_id": (str, type(None)),
    "finished_at": (int, float, type(None)),
}
"""The JSON type each record field must have (a reader relies on it)."""


def _field_problem(values: dict[str, Any]) -> str | None:
    """Why ``values`` (a record's fields from JSON) cannot be a record, or None."""
    for name, value in values.items():
        kinds = _KINDS.get(name, (object,))
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            allowed = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            return f"field {name!r} is a {type(value).__name__} ({value!r:.60}), expected {allowed}"
    if not all(isinstance(a, dict) for a in values.get("attempts") or []):
        return "field 'attempts' holds an entry that is not an object"
    wall = (values.get("timings") or {}).get("wall_s")
    if wall is not None and not is_number(wall):
        return f"field 'timings.wall_s' is {wall!r:.60}, expected a number of seconds"
    return None


def _run_id_of(run_dir: Path | str) -> str | None:
    """The run's stable id for its record (None when it has none or it is unreadable)."""

    try:
        return read_run_id(run_dir)
    except RunIdError:
        return None


_NOT_FIELDS = ("status", "final", "extra", "format_version", "unwritten")
"""What :meth:`RunRecord.to_json` writes otherwise, or never."""


class RecordError(ValueError):
    """A ``result.json`` that cannot be read as a run record (truncated, not JSON, foreign)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: not a readable run record: {why}")
        self.path = path


@dataclass
class RunRecord:
    """Everything ``result.json`` holds about one run.

    ``results`` maps each rank (as a string) to the dict its task returned;
    ``format_version`` is the version of the run-directory format the record was read in
    (:data:`~wf_launch.rundir.files.FORMAT_VERSION` for a new one, 0 for a record from before
    versions); a record is always written in the current version.
    ``timings`` has ``wall_s`` (launcher) and ``ranks`` (per-rank phases);
    ``failure`` is the root cause of a failed run; ``exits`` the failed ranks'
    exit codes; ``extra`` keeps fields a launcher adds of its own (e.g. ``slurm``)
    so that reading and writing a record never drops them.
    """

    status: Status
    run_dir: str = ""
    run_id: str | None = None
    task: str | None = None
    launcher: str | None = None
    overrides: list[str] = field(default_factory=list)
    layout: dict[str, Any] | None = None
    results: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    exits: dict[str, int] | None = None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] | None = None
    signal: str | None = None
    finished_at: float | None = None
    final: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = files.FORMAT_VERSION
    unwritten: str | None = field(default=None, compare=False)
    """Why :meth:`finalize` could not write the record (a full disk); never saved."""

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    @property
    def exit_code(self) -> int:
        """The exit code this record's status stands for."""
        return exit_code_of(self.status, self.signal)

    @property
    def summary(self) -> str:
        """What rank 0's result asks the launcher to print: its ``summary`` or ``table``, if any."""
        rank0 = self.results.get("0") or {}
        return (
            str(rank0.get("summary") or rank0.get("table") or "") if isinstance(rank0, dict) else ""
        )

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """The record as ``result.json`` holds it (``exit_code`` only once final)."""
        out: dict[str, Any] = {"status": str(self.status)}
        if self.final:
            out["exit_code"] = self.exit_code
        out["format_version"] = (
            files.FORMAT_VERSION
        )  # what this code writes, whatever version it read
        for f in fields(self):
            if f.name in _NOT_FIELDS:
                continue
            value = getattr(self, f.name)
            if value is None or value == [] or value == {}:
                continue
            out[f.name] = value
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    @classmethod
    def from_json(cls, data: Any, path: Path | None = None) -> RunRecord:
        """Build a record from parsed JSON; :class:`RecordError` if it is not one (a field of the
        wrong type too)."""
        where = path or Path(files.RESULT)
        if not isinstance(data, dict):
            raise RecordError(where, f"expected a JSON object, found {type(data).__name__}")
        try:
            status = Status(data.get("status"))
        except (ValueError, TypeError):
            raise RecordError(
                where, f"unknown status {data.get('status')!r}; known: {[str(s) for s in Status]}"
            ) from None
        known = {f.name for f in fields(cls)} - set(_NOT_FIELDS)
        values = {k: data[k] for k in known if k in data}
        version = data.get("format_version", 0)  # a record from before the format was versioned
        if not (is_int(version) and version >= 0):
            raise RecordError(where, f"format_version {version!r} is not a version number")
        problem = _field_problem(values)
        if problem:
            raise RecordError(where, problem)
        return cls(
            status=status,
            final="exit_code" in data,
            format_version=version,
            extra={
                k: v
                for k, v in data.items()
                if k not in known and k not in ("status", "exit_code", "format_version")
            },
            **values,
        )

    # ------------------------------------------------------------------ files
    @staticmethod
    def path(run_dir: Path | str) -> Path:
        """Where the record of the run at ``run_dir`` lives."""
        return Path(run_dir) / files.RESULT

    @classmethod
    def read(cls, run_dir: Path | str) -> RunRecord | None:
        """The record in ``run_dir`` (None when there is none yet); :class:`RecordError` when
        unreadable.

        Unreadable covers every way a file can be wrong: not a regular file, larger than
        :data:`~wf_launch.rundir.io.MAX_RECORD_BYTES`, not UTF-8 JSON, nested too deeply,
        or a field of the wrong type; the error names the file and why.
        """
        path = cls.path(run_dir)
        try:
            data = read_json(path)
        except UnreadableFile as exc:
            raise RecordError(path, exc.why) from None
        if data is None:
            return None
        return cls.from_json(data, path)

    def write(self, run_dir: Path | str | None = None) -> None:
        """Write ``result.json`` atomically (readers see the old record or the whole new one)."""
        atomic_write_json(self.path(run_dir or self.run_dir), self.to_json())

    @classmethod
    def finalize(
        cls,
        run_dir: Path | str,
        status: Status | str,
        /,
        *,
        signal_name: str | None = None,
        **facts: Any,
    ) -> RunRecord:
        """Merge the launcher's facts into the run's record (rank 0's, if any), mark it final, write
        it.

        ``facts`` are record fields (``run_dir`` too) or extra fields. A dict fact is merged into
        the same dict of the existing record (``timings``); anything else replaces it. A non-ok
        status drops rank 0's ``finished_at`` (the launcher's time is used instead). A record that
        cannot be written (a full disk) is returned with :attr:`unwritten` saying why, never raised:
        the launcher still ends and prints its root cause.
        """
        try:
            record = cls.read(run_dir)
        except RecordError:
            record = None
        if record is None:
            record = cls(status=Status(status), run_dir=str(run_dir))
        record.status = Status(status)
        record.signal = signal_name
        if record.status is not Status.OK:
            record.finished_at = None
        known = {f.name for f in fields(cls)}
        for key, value in facts.items():
            current = getattr(record, key, None) if key in known else record.extra.get(key)
            if isinstance(value, dict) and isinstance(current, dict):
                value = {**current, **value}
            if key in known:
                setattr(record, key, value)
            else:
                record.extra[key] = value
        _where_ranks_ran(record, run_dir)
        if record.finished_at is None:
            record.finished_at = time.time()
        if record.run_id is None:
            record.run_id = _run_id_of(run_dir)
        record.final = True
        try:
            using_reserve(run_dir, lambda: record.write(run_dir))
        except OSError as exc:  # a full disk: the launcher still ends, and says so in one line
            record.unwritten = f"could not write {cls.path(run_dir)} ({exc})"
        return record


def _where_ranks_ran(record: RunRecord, run_dir: Path | str) -> None:
    """``layout`` and ``hosts`` once ranks ran (the launcher's ``placement`` names them), whatever
    the outcome: rank 0 records them only for a run it saw through."""
    placement = record.extra.get("placement")
    if not isinstance(placement, dict) or not placement:
        return
    if not record.hosts:
        hosts = {p.get("host") for p in placement.values() if isinstance(p, dict)}
        record.hosts = sorted(h for h in hosts if isinstance(h, str))
    if record.layout is None:
        record.layout = layout_record(files.read_config(run_dir).get("engine"))


def layout_record(engine: Any) -> dict[str, Any] | None:
    """The layout as ``result.json`` holds it (sizes, ``order``, ``world_size``) for an engine
    section; None when it is not a valid layout."""
    try:
        layout = Layout.from_engine(engine)
    except (TypeError, ValueError, AttributeError):
        return None
    return {**layout.sizes, "order": "-".join(layout.dims), "world_size": layout.world_size}
