"""Secrets in a config stay out of places others may read (issue 29, item 9).

A value whose key looks secret (its last part holds ``token``, ``secret``, ``password``,
``key`` or ``credential``, in any case: ``task.kwargs.api_token``, ``WANDB_API_KEY``) is
shown as :data:`REDACTED` in tracker parameters, logs and printed commands. The run
itself still gets the value; only what is recorded or shown about it is redacted.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "REDACTED",
    "SECRET_WORDS",
    "is_secret",
    "redact_config",
    "redact_log_records",
    "redact_overrides",
    "redact_text",
]

SECRET_WORDS = ("token", "secret", "password", "key", "credential")
REDACTED = "***"
_ASSIGNMENT = re.compile(
    r"(?P<q>['\"])?"  # a quoted key ('api_token': ...) takes a colon, a bare one (KEY=...) "="
    r"(?P<key>[\w.+~/-]*(?:" + "|".join(SECRET_WORDS) + r")\w*)"
    r"(?P<eq>(?(q)['\"]\s*:\s*|\s*=\s*))"
    r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s,;'\"\])}]+)",
    re.IGNORECASE,
)


def is_secret(key: str) -> bool:
    """Whether the dotted ``key`` (``task.kwargs.api_token``) names a secret-looking value."""
    last = key.lstrip("+~").rsplit(".", 1)[-1].lower()
    return any(word in last for word in SECRET_WORDS)


def redact_config(config: Any) -> Any:
    """``config`` (mappings and lists, nested) with every secret-looking key's value redacted."""
    if isinstance(config, Mapping):
        return {
            k: REDACTED if is_secret(str(k)) and v is not None else redact_config(v)
            for k, v in config.items()
        }
    if isinstance(config, list | tuple):
        return [redact_config(v) for v in config]
    return config


def redact_overrides(overrides: list[str]) -> list[str]:
    """Hydra overrides (``KEY=VALUE``) with the value of each secret-looking key redacted."""
    return [
        f"{o.split('=', 1)[0]}={REDACTED}" if "=" in o and is_secret(o.split("=", 1)[0]) else o
        for o in overrides
    ]


def redact_text(text: str) -> str:
    """``text`` with the value of every secret-looking ``KEY=VALUE`` (or quoted ``'KEY': VALUE``)
    in it redacted: a line Hydra prints (``#0 : task.kwargs.api_token=s3cr3t``) shows ``***``;
    ``KeyError: 'x'`` is left as it is."""
    if not any(word in text.lower() for word in SECRET_WORDS):
        return text
    return _ASSIGNMENT.sub(lambda m: f"{m['q'] or ''}{m['key']}{m['eq']}{REDACTED}", text)


def redact_log_records() -> None:
    """Redact every record of Python's ``logging`` from now on (Hydra's launchers log each
    sweep point's overrides; the tune's and drill's logs, a SLURM job's output and the
    terminal receive them). Installed once by the CLI; idempotent."""
    current = logging.getLogRecordFactory()
    if getattr(current, "wf_redacts", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = current(*args, **kwargs)
        if isinstance(record.msg, str):
            message = record.getMessage()
            redacted = redact_text(message)
            if redacted != message:
                record.msg, record.args = redacted, ()
        return record

    factory.wf_redacts = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
