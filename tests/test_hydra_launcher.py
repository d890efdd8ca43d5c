"""``hydra/launcher=wf_slurm`` against Hydra's own launcher contract suites, as Hydra's plugins test
theirs.

For a generic (non-wf_launch) Hydra app ``wf_slurm`` runs every job inline, exactly as
Hydra's basic launcher does (nothing is submitted to SLURM: only ``launcher=slurm`` points
of wf_launch are). The integration suite starts each app in a fresh interpreter, so it
also proves that Hydra's own plugin scan finds ``wf_slurm`` in this install (editable or wheel).
"""

from __future__ import annotations

import subprocess
import sys

from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite
from pytest import mark

from hydra_plugins.wf_launch_slurm.wf_slurm_launcher import WfSlurmLauncher


def test_discovery() -> None:
    """Hydra's plugin scan (in this process) lists the launcher."""
    assert WfSlurmLauncher.__name__ in [x.__name__ for x in Plugins.instance().discover(Launcher)]


def test_scan_in_a_fresh_interpreter_loads_cleanly_and_imports_nothing_of_ours() -> None:
    """What every other Hydra app in the environment does at start-up: scan ``hydra_plugins`` (the
    module is executed before it is in sys.modules). No warning, the launcher found, and nothing
    imported beyond registering its config (wf_launch, submitit and torch stay out)."""
    code = (
        "import sys, warnings; warnings.simplefilter('error')\n"
        "from hydra.core.plugins import Plugins\nfrom hydra.plugins.launcher import Launcher\n"
        "names = [c.__module__ + '.' + c.__name__ for c in Plugins.instance().discover(Launcher)]\n"
        "print('\\n'.join(names))\n"
        "heavy = [m for m in ('wf_launch', 'submitit', 'torch', 'loguru') if m in sys.modules]\n"
        "assert not heavy, f'imported at plugin scan: {heavy}'\n"
        "from hydra.core.config_store import ConfigStore\n"
        "assert 'wf_slurm.yaml' in ConfigStore.instance().list('hydra/launcher')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert proc.returncode == 0, proc.stderr
    assert "hydra_plugins.wf_launch_slurm.wf_slurm_launcher.WfSlurmLauncher" in proc.stdout.split()
    assert "Hydra plugins scanner" not in proc.stderr and "Error importing" not in proc.stderr, (
        proc.stderr
    )


@mark.parametrize("launcher_name, overrides", [("wf_slurm", [])])
class TestWfSlurmLauncher(LauncherTestSuite):
    """Hydra's LauncherTestSuite, in process."""


@mark.slow
@mark.parametrize("task_launcher_cfg, extra_flags", [({}, ["-m", "hydra/launcher=wf_slurm"])])
class TestWfSlurmLauncherIntegration(IntegrationTestSuite):
    """Hydra's IntegrationTestSuite: generic apps in a fresh interpreter each."""
