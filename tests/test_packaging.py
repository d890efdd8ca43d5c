"""The built wheel is self-contained: configs ship inside it and the CLI runs from it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from cli_helpers import cli_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cli_runs_from_the_built_wheel(tmp_path: Path) -> None:
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "dist"), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for cfg in ("config.yaml", "engine/default.yaml", "launcher/local.yaml", "hydra/help/wf_launch.yaml"):
        assert f"wf_launch/conf/{cfg}" in names
    assert "wf_launch/__main__.py" in names and "worldfoundry/core/distributed/groups.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = cli_env({"PYTHONPATH": str(site)})
    where = subprocess.run([sys.executable, "-c", "import wf_launch.conf as c; print(c.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    proc = subprocess.run([sys.executable, "-m", "wf_launch", "launcher.dry_run=true", "engine.cp_size=2",
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tp=1 cp=2 pp=1 dp=1 (order tp-cp-pp-dp, 2 ranks)" in proc.stdout


def test_importing_worldfoundry_core_is_cheap() -> None:
    code = ("import sys, worldfoundry.core as c; assert 'torch' not in sys.modules, 'torch imported'; "
            "c.Layout; assert 'torch.distributed' not in sys.modules; print(len(c.__all__))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 50
