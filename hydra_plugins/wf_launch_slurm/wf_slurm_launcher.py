"""Hydra launcher ``wf_slurm`` (selected by ``launcher=slurm``, see conf/launcher/slurm.yaml).

Hydra's basic launcher calls the app once per point and waits for it; that would submit
a SLURM sweep one job after another. This launcher runs every point through the app as
the basic launcher does (job dirs, ``.hydra/``, callbacks, validation: an invalid point
is recorded and the others go on), but the SLURM launcher only *prepares* each point;
once all are prepared, they are submitted together (one job array per distinct sbatch
shape) and the sweep waits for all of them (unless ``launcher.wait=false``), reporting
each point as it ends. Hydra's ``on_multirun_end`` callbacks (the sweep report) run after
this, on final results. Points of another launcher run inline, as with the basic one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn


@dataclass
class WfSlurmLauncherConf:
    _target_: str = "hydra_plugins.wf_launch_slurm.wf_slurm_launcher.WfSlurmLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="wf_slurm", node=WfSlurmLauncherConf,
                             provider="wf_launch")


class WfSlurmLauncher(BasicLauncher):
    """Prepare every point, submit all SLURM points at once, then wait for them."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from wf_launch.launchers import slurm
        from wf_launch.outcome import RunOutcome
        from wf_launch.record import Status

        assert self.config is not None
        slurm.begin_batch()
        try:
            runs = list(super().launch(job_overrides, initial_job_idx))
        except BaseException:
            slurm.drop_batch()
            raise
        submitted = slurm.submit_batch(Path(str(self.config.hydra.sweep.dir)).absolute())
        by_dir = {Path(str(r._return_value.run_dir)): r for r in runs
                  if isinstance(getattr(r, "_return_value", None), RunOutcome)}
        waiting = [p.plan.run_dir for p, job_id, _ in submitted if job_id and p.plan.config["launcher"]["wait"]]
        failed = {p.plan.run_dir: err for p, job_id, err in submitted if not job_id}
        for run_dir, err in failed.items():
            if run_dir in by_dir:
                by_dir[run_dir].return_value = RunOutcome(Status.FAILED, run_dir, err)
        if waiting:
            poll = min(p.plan.config["launcher"]["poll_interval_s"] for p, _, _ in submitted)
            print(f"wf_launch: waiting for {len(waiting)} SLURM job(s)", flush=True)
            for outcome in slurm.wait_all(waiting, poll):
                if outcome.run_dir in by_dir:
                    by_dir[outcome.run_dir].return_value = outcome
        return runs


def register() -> None:
    """Make the launcher known to Hydra even where its plugin scan misses it (editable installs)."""
    from hydra.core.plugins import Plugins

    Plugins.instance().register(WfSlurmLauncher)
