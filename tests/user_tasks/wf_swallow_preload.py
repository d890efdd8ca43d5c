"""Imported by the launcher before it forks the ranks (``register_task(preload=...)``), as a
heavy library is: touches ``WF_TEST_SWALLOW_MARK``, then sleeps ``WF_TEST_SWALLOW_S`` inside
``try: ... except: pass``, so a Ctrl-C in that sleep is swallowed, as a library's bare
``except:`` can swallow the KeyboardInterrupt of an import it cut short."""

from __future__ import annotations

import os
import time
from pathlib import Path

if os.environ.get("WF_TEST_SWALLOW_S"):
    Path(os.environ["WF_TEST_SWALLOW_MARK"]).touch()
    try:
        time.sleep(float(os.environ["WF_TEST_SWALLOW_S"]))
    except:  # noqa: E722 - the point: a library that swallows everything
        pass
