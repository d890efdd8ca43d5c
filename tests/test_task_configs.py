"""Typed task configs: the docs' example task, run through the real CLI, gets ``ctx.cfg``."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from cli_helpers import cli_env, result, run_cli, run_python_m

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"


def _example_package(tmp_path: Path) -> dict[str, str]:
    text = DOCS.read_text()
    section = text[text.index("## Writing your own task") :]
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
    return run_python_m(
        "wf_launch",
        [*args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=180,
    )


@pytest.mark.slow
def test_docs_example_task_runs_with_a_typed_config(tmp_path: Path) -> None:
    env = _example_package(tmp_path)
    run_dir = tmp_path / "run"
    proc = _cli(
        [
            "task=allreduce",
            "task.modules=[my_pkg.tasks]",
            "engine.dp_size=2",
            "task.numel=4096",
            f"hydra.run.dir={run_dir}",
        ],
        env,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    from wf_launch.rundir.record import RunRecord

    record = RunRecord.read(run_dir)
    assert record is not None and record.results["0"] == {"ok": True, "numel": 4096}


def test_docs_example_task_validates_before_any_process_starts(tmp_path: Path) -> None:
    env = _example_package(tmp_path)
    proc = _cli(
        [
            "task=allreduce",
            "task.modules=[my_pkg.tasks]",
            "task.numel=0",
            f"hydra.run.dir={tmp_path / 'bad'}",
        ],
        env,
        tmp_path,
    )
    assert proc.returncode == 2
    assert "task.numel=0 is not allowed: expected an integer >= 1" in proc.stderr
    assert not (tmp_path / "bad" / "logs").exists()
    unknown = _cli(
        [
            "task=allreduce",
            "task.modules=[my_pkg.tasks]",
            "+task.numell=3",
            f"hydra.run.dir={tmp_path / 'bad2'}",
        ],
        env,
        tmp_path,
    )
    assert unknown.returncode != 0 and "numell" in unknown.stderr


def test_ctx_cfg_is_the_registered_dataclass_with_defaults() -> None:
    from wf_launch.rank.task_registry import task_config_class
    from wf_launch.tasks.demo import DemoTaskConfig

    cls = task_config_class("demo")
    assert cls is DemoTaskConfig
    cfg = cls.build({"name": "demo", "frames": 8, "patch": (1, 2, 2)})
    assert (
        isinstance(cfg, DemoTaskConfig)
        and cfg.frames == 8
        and cfg.height == 32
        and cfg.patch == [1, 2, 2]
    )


def test_preload_is_kept_per_task_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from wf_launch.rank import task_registry as registry
    from wf_launch.rank.task_registry import load_task_modules, register_task, task_preload

    load_task_modules()  # built-ins register into the real registry, not only into the copy below
    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    register_task("preload_probe", preload=("json", "wf_launch.checkpoint"))(lambda ctx: None)
    assert task_preload("preload_probe") == ("json", "wf_launch.checkpoint")
    assert task_preload("noop") == ()
    assert "torch.distributed.checkpoint" in task_preload("train")
    with pytest.raises(ValueError, match="preload=.* must be module names"):
        register_task("preload_bad", preload=("json", ""))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_forked_ranks_inherit_the_preloaded_modules(tmp_path: Path, method: str) -> None:
    proc = run_cli(
        [
            "task=preloaded",
            "task.modules=[wf_test_tasks]",
            "engine.dp_size=2",
            f"launcher.start_method={method}",
        ],
        tmp_path / "run",
    )
    assert proc.returncode == 0, proc.stderr
    results = result(tmp_path / "run")["results"]
    for r in results.values():
        launcher_imported = r["imported_by"] == r["parent_pid"] != r["rank_pid"]
        assert launcher_imported == (method == "fork"), r  # spawned ranks import it themselves


def test_demo_and_train_share_one_model_declaration() -> None:
    """The model's fields and their rules are declared once; train only changes defaults."""
    from dataclasses import fields

    from wf_launch.config import ConfigError
    from wf_launch.tasks._vdit import VDiTConfig
    from wf_launch.tasks.demo import DemoTaskConfig
    from wf_launch.tasks.train import TrainConfig

    model = [f.name for f in fields(VDiTConfig)]
    for cls in (DemoTaskConfig, TrainConfig):
        assert [f.name for f in fields(cls)][: len(model)] == model
    assert (DemoTaskConfig().frames, TrainConfig().frames) == (6, 4)
    for cls in (DemoTaskConfig, TrainConfig):
        with pytest.raises(ConfigError) as err:
            cls(frames=0).validate()
        assert str(err.value) == "task.frames=0 is not allowed: expected an integer >= 1"
        with pytest.raises(ConfigError) as err:
            cls(hidden=10, heads=4).validate()
        assert str(err.value) == "task.heads=4 is not allowed: must divide task.hidden=10"


def test_each_task_is_one_record() -> None:
    from wf_launch.config import TaskConfig
    from wf_launch.rank.task_registry import TaskSpec, task_spec
    from wf_launch.tasks.train import TrainConfig, train

    spec = task_spec("train")
    assert isinstance(spec, TaskSpec)
    assert (spec.name, spec.fn, spec.config, spec.own_group) == ("train", train, TrainConfig, False)
    assert "torch.distributed.checkpoint" in spec.preload
    assert task_spec("script").own_group
    assert task_spec("noop").config in (None, TaskConfig)
    with pytest.raises(KeyError, match="task.name='nope' is not registered"):
        task_spec("nope")
