"""The built wheel is self-contained: configs ship inside it and the CLI runs from it; installing
the project leaves every other Hydra app working (issue 14).

These tests run in the dev (editable) install and, through scripts/ci_wheel_check.sh, in a fresh
venv with the wheel installed (``WF_WHEEL`` names that wheel; no source tree there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from cli_helpers import cli_env

ROOT = Path(__file__).resolve().parents[1]
GENERIC_APP = """\
import hydra

@hydra.main(version_base=None, config_path=None)
def main(cfg):
    print(f"generic app: {dict(cfg)}")

if __name__ == "__main__":
    main()
"""


def _wheel(tmp_path: Path) -> Path:
    """The wheel under test: ``WF_WHEEL`` (CI's wheel check) or one built from this source tree."""
    if os.environ.get("WF_WHEEL"):
        return Path(os.environ["WF_WHEEL"])
    if not (ROOT / "pyproject.toml").is_file():
        pytest.skip("no source tree to build a wheel from, and WF_WHEEL is not set")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return wheel


@pytest.mark.slow
def test_cli_runs_from_the_built_wheel(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for cfg in (
        "config.yaml",
        "engine/default.yaml",
        "launcher/local.yaml",
        "hydra/help/wf_launch.yaml",
        "tracking/none.yaml",
        "tracking/wandb.yaml",
    ):
        assert f"wf_launch/conf/{cfg}" in names
    assert "wf_launch/__main__.py" in names and "worldfoundry/core/distributed/groups.py" in names
    for mod in (
        "hydra_plugins/wf_launch_slurm/config.py",
        "hydra_plugins/wf_launch_slurm/wf_slurm_launcher.py",
        "wf_launch/launchers/slurm/submitit_adapter.py",
        "wf_launch/launchers/slurm/poll.py",
        "hydra_plugins/wf_launch_ray/wf_ray_launcher.py",
        "wf_launch/launchers/ray/ray_adapter.py",
        "wf_launch/conf/launcher/ray.yaml",
        "wf_launch/rank/trackers/hub.py",
    ):
        assert mod in names
    assert (
        "hydra_plugins/__init__.py" not in names
    )  # a namespace package, shared with other plugins
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = cli_env({"PYTHONPATH": str(site)})
    where = subprocess.run(
        [sys.executable, "-c", "import wf_launch.conf as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wf_launch",
            "launcher.dry_run=true",
            "engine.cp_size=2",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tp=1 cp=2 pp=1 dp=1 (order tp-cp-pp-dp, 2 ranks)" in proc.stdout


def test_importing_worldfoundry_core_is_cheap() -> None:
    code = (
        "import sys, worldfoundry.core as c; assert 'torch' not in sys.modules, 'torch imported'; "
        "c.Layout; assert 'torch.distributed' not in sys.modules; print(len(c.__all__))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 50


def test_a_generic_hydra_app_runs_in_this_install(tmp_path: Path) -> None:
    """Another Hydra app in the same environment: Hydra scans hydra_plugins (ours included) at
    start-up, and ``hydra/launcher=wf_slurm`` runs its jobs inline, as the basic launcher does."""
    app = tmp_path / "app.py"
    app.write_text(GENERIC_APP)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    plain = subprocess.run(
        [sys.executable, str(app), "+x=1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stderr
    assert "generic app: {'x': 1}" in plain.stdout
    assert "Hydra plugins scanner" not in plain.stderr and "Error importing" not in plain.stderr, (
        plain.stderr
    )
    sweep = subprocess.run(
        [
            sys.executable,
            str(app),
            "-m",
            "hydra/launcher=wf_slurm",
            "+x=1,2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert sweep.returncode == 0, sweep.stderr
    assert "generic app: {'x': 1}" in sweep.stdout and "generic app: {'x': 2}" in sweep.stdout
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1"]


def test_help_lists_only_what_a_user_picks(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wf_launch", "--help"],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    groups = proc.stdout.split("== Config groups ==", 1)[1].split("== Config ==", 1)[0]
    assert "_schema" not in groups, groups
    assert "engine: default\n" in groups and "launcher: local, ray, slurm\n" in groups
