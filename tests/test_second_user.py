"""Another user of the same host reads no file the project writes (issue 29, "done when").

As root, a real second Unix user is made and tries to open every file and folder that a
launch, a tune directory and a tool log leave under a base directory open to it (``0755``),
under the usual ``022`` umask. Skipped unless root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from cli_helpers import run_cli

from wf_launch.rundir.claim import claim_tool_dir
from wf_launch.rundir.io import open_log

pytestmark = pytest.mark.slow

_TRY = (
    'while IFS= read -r p; do if [ -d "$p" ]; then ls "$p" >/dev/null 2>&1 && echo "$p"; '
    'elif [ -f "$p" ]; then head -c 1 "$p" >/dev/null 2>&1 && echo "$p"; fi; done'
)
"""Print each path read from stdin that can be listed (a folder) or read (a file)."""


def test_a_second_user_opens_no_file_a_launch_or_a_tool_writes(other_user: str) -> None:
    base = Path(tempfile.mkdtemp(prefix="wf-second-user-"))
    base.chmod(0o755)  # the base is the other user's to walk: only the project's modes protect
    old = os.umask(0o022)
    try:
        run = base / "run"
        proc = run_cli(["task=noop", "engine.dp_size=2"], run)
        assert proc.returncode == 0, proc.stderr[-2000:]
        with claim_tool_dir(base / "tune", "--dir"):
            (base / "tune" / "rounds").mkdir()
            os.close(open_log(base / "tune" / "rounds" / "r0.log"))
        written = sorted(str(p) for p in base.rglob("*"))
        assert any(p.endswith("result.json") for p in written)
        tried = subprocess.run(
            ["runuser", "-u", other_user, "--", "sh", "-c", _TRY],
            input="\n".join([str(base), *written]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert tried.returncode == 0, tried.stderr
        assert tried.stdout.splitlines() == [str(base)]  # the base only: nothing of the project
    finally:
        os.umask(old)
        shutil.rmtree(base, ignore_errors=True)
