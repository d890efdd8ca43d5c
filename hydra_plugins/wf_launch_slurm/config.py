# No ``from __future__ import annotations`` here: Hydra's plugin scanner executes this module
# before registering it in sys.modules, and a dataclass with string annotations then fails.
"""The ``hydra/launcher=wf_slurm`` config node (the only thing done at import)."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore


@dataclass
class WfSlurmLauncherConf:
    _target_: str = "hydra_plugins.wf_launch_slurm.wf_slurm_launcher.WfSlurmLauncher"


ConfigStore.instance().store(
    group="hydra/launcher", name="wf_slurm", node=WfSlurmLauncherConf, provider="wf_launch"
)
