"""The Hydra callback that keeps secrets out of Hydra's own crash line (issue 29, item 9)."""

from __future__ import annotations

from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback

from .redact import redact_overrides

__all__ = ["RedactFailedJob"]


class RedactFailedJob(Callback):
    """Hydra's callback (``hydra.callbacks.redact`` in ``wf_launch/conf/config.yaml``) that
    redacts a failed job's overrides: Hydra prints them in its ``Error executing job with
    overrides:`` line when the app itself raises, straight to stderr, after this runs."""

    def on_job_end(self, config: Any, job_return: JobReturn, **kwargs: Any) -> None:
        if job_return.status is JobStatus.FAILED and job_return.overrides:
            job_return.overrides = redact_overrides(list(job_return.overrides))
