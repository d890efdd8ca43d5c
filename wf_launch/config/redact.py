"""Secrets in a config stay out of places others may read (issue 29, item 9).

A value whose key looks secret (its last part holds ``token``, ``secret``, ``password``,
``key`` or ``credential``, in any case: ``task.kwargs.api_token``, ``WANDB_API_KEY``) is
shown as :data:`REDACTED` in tracker parameters, logs and printed commands. The run
itself still gets the value; only what is recorded or shown about it is redacted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "SECRET_WORDS", "is_secret", "redact_config", "redact_overrides"]

SECRET_WORDS = ("token", "secret", "password", "key", "credential")
REDACTED = "***"


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
