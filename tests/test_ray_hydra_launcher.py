"""``hydra/launcher=wf_ray`` against Hydra's own launcher contract suites, as ``wf_slurm`` is
(tests/test_hydra_launcher.py): for a generic Hydra app it runs every job inline, as Hydra's
basic launcher does (only ``launcher=ray`` points of wf_launch are run on Ray), and Hydra's plugin
scan finds it without importing wf_launch, Ray or torch."""

from __future__ import annotations

import subprocess
import sys

from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from pytest import mark

from hydra_plugins.wf_launch_ray.wf_ray_launcher import WfRayLauncher


def test_discovery() -> None:
    assert WfRayLauncher.__name__ in [x.__name__ for x in Plugins.instance().discover(Launcher)]


def test_scan_in_a_fresh_interpreter_imports_nothing_of_ours() -> None:
    code = (
        "import sys, warnings; warnings.simplefilter('error')\n"
        "from hydra.core.plugins import Plugins\nfrom hydra.plugins.launcher import Launcher\n"
        "names = [c.__module__ + '.' + c.__name__ for c in Plugins.instance().discover(Launcher)]\n"
        "print('\\n'.join(names))\n"
        "heavy = [m for m in ('wf_launch', 'ray', 'torch', 'loguru') if m in sys.modules]\n"
        "assert not heavy, f'imported at plugin scan: {heavy}'\n"
        "from hydra.core.config_store import ConfigStore\n"
        "assert 'wf_ray.yaml' in ConfigStore.instance().list('hydra/launcher')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    assert "hydra_plugins.wf_launch_ray.wf_ray_launcher.WfRayLauncher" in proc.stdout.split()


def test_launching_wf_launch_never_imports_ray_unless_asked() -> None:
    code = (
        "import sys\nfrom wf_launch.launchers import registered_launchers\n"
        "assert 'ray' in registered_launchers()\nassert 'ray' not in sys.modules, 'ray imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@mark.parametrize("launcher_name, overrides", [("wf_ray", [])])
class TestWfRayLauncher(LauncherTestSuite):
    """Hydra's LauncherTestSuite, in process."""


@mark.slow
@mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", "hydra/launcher=wf_ray"])])
class TestWfRayLauncherIntegration(IntegrationTestSuite):
    """Hydra's IntegrationTestSuite: generic apps in a fresh interpreter each."""
