"""RunOutcome: how a launch ended, as the launcher hands it back to the CLI and the sweep."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .record import RunRecord, Status, exit_code_of

__all__ = ["RunOutcome"]


@dataclass
class RunOutcome:
    """A launch's :class:`~wf_launch.rundir.record.Status`, where it is recorded, and what to print.

    ``record`` is the run record when one was written; the exit code follows
    from the status (:data:`wf_launch.rundir.record.EXIT_CODES`).
    """

    status: Status
    run_dir: Path | None = None
    summary: str = ""
    record: RunRecord | None = None
    signal: str | None = None

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    @property
    def exit_code(self) -> int:
        return exit_code_of(self.status, self.signal)

    @classmethod
    def of(
        cls, record: RunRecord, run_dir: Path | None = None, summary: str | None = None
    ) -> RunOutcome:
        """The outcome a written record stands for (``summary`` defaults to rank 0's)."""
        return cls(
            record.status,
            run_dir or Path(record.run_dir),
            record.summary if summary is None else summary,
            record,
            record.signal,
        )
