"""The checkpointing doc's example task, run through the real CLI: ctx.checkpoint, ctx.should_stop,
keep."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli_env, result

pytestmark = pytest.mark.slow
DOCS = Path(__file__).resolve().parents[1] / "docs" / "checkpointing.md"


def test_docs_example_trains_and_keeps_its_newest_checkpoints(tmp_path: Path) -> None:
    code = re.search(r"## Example task loop.*?```python\n(.*?)```", DOCS.read_text(), re.S)
    assert code, "docs/checkpointing.md lost its example"
    pkg = tmp_path / "src"
    pkg.mkdir()
    (pkg / "ckpt_example.py").write_text(code.group(1))
    env = cli_env()
    env["PYTHONPATH"] = f"{pkg}:{env['PYTHONPATH']}"
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "task=my_train",
            "task.modules=[ckpt_example]",
            "engine.dp_size=2",
            "task.steps=30",
            "task.save_every=5",
            "task.keep=3",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert result(run_dir)["results"]["0"] == {"step": 30, "stopped_early": False}
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith("."))
    assert kept == ["step_00000020", "step_00000025", "step_00000030"]
    assert all((run_dir / "checkpoints" / k / "COMMIT").is_file() for k in kept)
