"""Typed task configs: the docs' example task, run through the real CLI, gets ``ctx.cfg``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli_env

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"


def _example_package(tmp_path: Path) -> dict[str, str]:
    text = DOCS.read_text()
    section = text[text.index("## Writing your own task"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "docs/tasks.md lost its example task"
    pkg = tmp_path / "src" / "my_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tasks.py").write_text(code.group(1))
    env = cli_env()
    env["PYTHONPATH"] = f"{tmp_path / 'src'}:{env['PYTHONPATH']}"
    return env


def _cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "wf_launch", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=180)


@pytest.mark.slow
def test_docs_example_task_runs_with_a_typed_config(tmp_path: Path) -> None:
    env = _example_package(tmp_path)
    run_dir = tmp_path / "run"
    proc = _cli(["task=allreduce", "task.modules=[my_pkg.tasks]", "engine.dp_size=2", "task.numel=4096",
                 f"hydra.run.dir={run_dir}"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    from wf_launch.record import RunRecord

    record = RunRecord.read(run_dir)
    assert record is not None and record.results["0"] == {"ok": True, "numel": 4096}


def test_docs_example_task_validates_before_any_process_starts(tmp_path: Path) -> None:
    env = _example_package(tmp_path)
    proc = _cli(["task=allreduce", "task.modules=[my_pkg.tasks]", "task.numel=0",
                 f"hydra.run.dir={tmp_path / 'bad'}"], env, tmp_path)
    assert proc.returncode == 2
    assert "task.numel=0 is not allowed: expected an integer >= 1" in proc.stderr
    assert not (tmp_path / "bad" / "logs").exists()
    unknown = _cli(["task=allreduce", "task.modules=[my_pkg.tasks]", "+task.numell=3",
                    f"hydra.run.dir={tmp_path / 'bad2'}"], env, tmp_path)
    assert unknown.returncode != 0 and "numell" in unknown.stderr


def test_ctx_cfg_is_the_registered_dataclass_with_defaults() -> None:
    from wf_launch.tasks.demo import DemoTaskConfig
    from wf_launch.tasks.registry import task_config_class

    cls = task_config_class("demo")
    assert cls is DemoTaskConfig
    cfg = cls.build({"name": "demo", "frames": 8, "patch": (1, 2, 2)})
    assert isinstance(cfg, DemoTaskConfig) and cfg.frames == 8 and cfg.height == 32 and cfg.patch == [1, 2, 2]
