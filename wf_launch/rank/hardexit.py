"""Leave a rank process without running interpreter finalization.

Torch's C++ teardown can abort a rank at interpreter exit after all its work is done
("terminate called without an active exception", SIGABRT, exit -6), on gloo with or without
FSDP2: measured with torch 2.13's CPU wheel, about one run in three of a 4-rank job that
shards a small model with ``fully_shard``, trains a step and destroys its process group, with
plain torch.distributed alone. A finished job then reads as FAILED; a process that leaves
through ``os._exit`` after flushing its files never meets it.
Forked local ranks never meet it, since multiprocessing leaves them through
``os._exit``. A SLURM task returns through submitit, which must first write its result
file; :func:`exit_after_cleanup` lets it, and then leaves from an ``atexit`` hook,
before module teardown and C++ static destructors run.
"""

from __future__ import annotations

import atexit
import os
import sys

from worldfoundry.core.validation import is_int

__all__ = ["exit_after_cleanup", "exit_status", "flush_and_exit"]


def exit_status(exc: BaseException) -> int:
    """The exit code a rank that failed with ``exc`` leaves with: the code of a ``sys.exit(n)``
    (``SystemExit``, or an exception carrying ``exit_code``, as a script's does) when it is 1..255,
    else 1."""
    code = getattr(exc, "exit_code", exc.code if isinstance(exc, SystemExit) else None)
    return code if is_int(code) and 0 < code < 256 else 1


def flush_and_exit(code: int) -> None:
    """Flush the logs and standard streams, then ``os._exit(code)``."""
    try:
        from loguru import logger

        logger.complete()
        logger.remove()  # closes (so flushes) every sink, the rank log included
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    os._exit(code)


def exit_after_cleanup(code: int) -> None:
    """Leave with ``code`` once the interpreter starts to exit: after the caller's caller (submitit)
    has returned and after non-daemon threads have been joined, but before finalization.

    ``atexit`` hooks run last-registered first, so hooks registered earlier (loguru's,
    for instance) do not run; :func:`flush_and_exit` flushes what they would have.
    """
    atexit.register(flush_and_exit, code)
