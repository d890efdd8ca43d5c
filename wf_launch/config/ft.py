"""The ``ft`` section: fault-tolerant training across replica groups, through torchft.

``ft=none`` (the default) runs one world as always. ``ft=torchft`` runs ``ft.replicas`` copies
of the engine layout, each its own distributed world (its own store and tp/cp/pp/dp groups);
torchft's Lighthouse forms a quorum of the replica groups at every step, a replica group that
fails is dropped and restarted on its own while the others keep stepping, and it heals from a
live peer when it comes back (docs/fault-tolerance.md).
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .fields import (
    check_choice,
    check_fields,
    check_single_line,
    choice,
    config_error,
    integer,
    number,
    unknown_field,
)

__all__ = ["FT_KINDS", "FtConfig", "lighthouse_answers", "parse_host_port"]

FT_KINDS = ("none", "torchft")
PACKAGE = "worldfoundry-launch"
CONNECT_TIMEOUT_S = 3.0
"""How long the check of a running Lighthouse (``ft.lighthouse=HOST:PORT``) waits for it."""


def parse_host_port(value: Any) -> tuple[str, int] | None:
    """``HOST:PORT`` (an IPv6 host in brackets) as (host, port); None if it is not one."""
    if not isinstance(value, str) or ":" not in value:
        return None
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def lighthouse_answers(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when a TCP connection to the Lighthouse opens; else why it did not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return exc.strerror or type(exc).__name__


@dataclass
class FtConfig:
    """Replica groups that fail and heal on their own (``ft=torchft``)."""

    name: str = choice("none", FT_KINDS)
    replicas: int = integer(2, low=2)
    min_replicas: int = integer(1, low=1)
    lighthouse: str | None = None
    quorum_timeout_s: float = number(60.0, 0, 86400, low_open=True, unit="seconds")
    join_timeout_s: float = number(600.0, 0, 86400, low_open=True, unit="seconds")
    timeout_s: float = number(10.0, 0, 86400, low_open=True, unit="seconds")
    heartbeat_timeout_s: float = number(2.0, 0, 3600, low_open=True, unit="seconds")
    hang_timeout_s: float | None = number(
        None,
        0,
        86400,
        low_open=True,
        unit="seconds",
        note=(
            "(null: ft.quorum_timeout_s less ft.heartbeat_timeout_s and 1 s; at least ft.timeout_s)"
        ),
        optional=True,
    )
    max_replica_restarts: int = integer(3, low=0)

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    @property
    def hang_after_s(self) -> float:
        """When the hang watch tears a replica group down: ``ft.hang_timeout_s``; by default just
        before the groups waiting for it would give up (``ft.quorum_timeout_s``, less the
        Lighthouse's ``ft.heartbeat_timeout_s`` to drop it and a second), at least half of it.
        Never before ``ft.timeout_s``: until then a group waiting in a collective for a hung one
        is in a step as long as the hung one, and could be taken for it."""
        if self.hang_timeout_s is not None:
            chosen = self.hang_timeout_s
        else:
            q = self.quorum_timeout_s
            chosen = max(q / 2, q - self.heartbeat_timeout_s - 1.0)
        return max(chosen, self.timeout_s)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> FtConfig:
        """The section as a checked FtConfig (ConfigError names the field, value and what is
        allowed).
        """
        section = dict(section or {})
        known = {f.name for f in fields(cls)}
        for key in section:
            if key not in known:
                raise unknown_field(f"ft.{key}", section[key], known)
        cfg = cls(**section)
        cfg.check()
        return cfg

    def check(self) -> None:
        """Each field's rule, then how they go together; the Lighthouse named must answer.

        With ``ft=none`` only the name is checked: the other fields are not used.
        """
        check_choice("ft", self.name, FT_KINDS)
        if not self.enabled:
            return
        check_fields(self, "ft")
        if self.min_replicas > self.replicas:
            raise config_error(
                "ft.min_replicas",
                self.min_replicas,
                f"an integer from 1 to ft.replicas={self.replicas}",
            )
        if self.hang_timeout_s is not None and self.hang_timeout_s >= self.quorum_timeout_s:
            raise config_error(
                "ft.hang_timeout_s",
                self.hang_timeout_s,
                f"seconds below ft.quorum_timeout_s={self.quorum_timeout_s:g} (a hung replica "
                "group is torn down before the others give up waiting for it), or null (just "
                "before they do)",
            )
        if self.lighthouse is not None:
            self._check_lighthouse()
        if importlib.util.find_spec("torchft") is None:
            raise config_error(
                "ft",
                self.name,
                f"torchft is not installed: pip install '{PACKAGE}[ft]' (or ft=none)",
            )

    def _check_lighthouse(self) -> None:
        check_single_line("ft.lighthouse", self.lighthouse)
        where = parse_host_port(self.lighthouse)
        if where is None:
            raise config_error(
                "ft.lighthouse",
                self.lighthouse,
                "null (the launcher starts one) or HOST:PORT of a running Lighthouse",
            )
        why = lighthouse_answers(*where)
        if why is not None:
            raise config_error(
                "ft.lighthouse",
                self.lighthouse,
                f"a Lighthouse that answers: connecting to {self.lighthouse} failed ({why}); "
                "null lets the launcher start one",
            )
