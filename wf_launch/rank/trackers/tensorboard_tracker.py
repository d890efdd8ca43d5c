"""``tracking=tensorboard``: event files in ``RUN_DIR/tensorboard/`` (``torch.utils.tensorboard``).

A resumed attempt opens its writer with ``purge_step`` one past the last step the run recorded
as flushed: TensorBoard then hides whatever a killed attempt wrote after that step, and the hub
writes those steps again (from ``metrics.jsonl``, then live), so each curve goes on without a
duplicate or a step back. The config goes in as hyper-parameters (the HParams dashboard) and as
text; each attempt's end as text ``wf_launch/status`` (``ok``, ``interrupted``, ``failed``) and the
run's completion as the HParams session's end (success; an attempt that failed or stopped leaves the
session open, since TensorBoard keeps only the first end of a session and a later attempt may
complete it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import yaml

from ...rundir import files
from .base import Tracker, flat_params

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker(Tracker):
    """One ``SummaryWriter`` per tracked rank."""

    name: ClassVar[str] = "tensorboard"

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.writer: Any = None
        self.last: int | None = None

    @property
    def log_dir(self) -> Path:
        s = self.settings
        base = (
            Path(s.section["log_dir"])
            if s.section.get("log_dir")
            else files.tensorboard_dir(s.run_dir)
        )
        return base / f"rank{s.rank}" if s.tagged else base

    def open(self) -> int | None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        held = self.settings.last_step
        self.writer = SummaryWriter(
            str(self.log_dir), purge_step=None if held is None else held + 1, flush_secs=3600
        )  # the hub flushes
        params = flat_params(self.settings.config)
        experiment, start, _ = hparams(params, {})
        for summary in (experiment, start):
            self.writer.file_writer.add_summary(summary)
        if held is None:
            self.writer.add_text(
                "wf_launch/config",
                "```\n" + yaml.safe_dump(self.settings.config, sort_keys=False) + "```",
                0,
            )
        self.writer.add_text(
            "wf_launch/run_id", self.settings.run_id, 0 if held is None else held + 1
        )
        self.writer.flush()
        self.last = held
        return held

    def log(self, points: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in points:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
            self.last = step

    def flush(self) -> None:
        self.writer.flush()

    def close(self, status: str) -> None:
        if self.writer is None:
            return
        if (
            status == "ok"
        ):  # TensorBoard keeps the first end of a session: only the run's own end is one
            self.writer.file_writer.add_summary(_session_end(status))
        self.writer.add_text("wf_launch/status", status, self.last or 0)
        self.writer.close()
        self.writer = None


def _session_end(status: str) -> Any:
    """The HParams plugin's end of a session: success for ``ok``, failure otherwise."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import api_pb2, metadata
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData, SessionEndInfo

    end = SessionEndInfo(
        status=api_pb2.Status.Value("STATUS_SUCCESS" if status == "ok" else "STATUS_FAILURE")
    )
    content = HParamsPluginData(session_end_info=end, version=metadata.PLUGIN_DATA_VERSION)
    meta = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(
            plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString()
        )
    )
    return Summary(value=[Summary.Value(tag=metadata.SESSION_END_INFO_TAG, metadata=meta)])
