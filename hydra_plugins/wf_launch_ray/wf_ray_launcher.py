# No ``from __future__ import annotations`` here (see config.py): Hydra's plugin scanner
# executes this module before it is in sys.modules.
"""Hydra launcher ``wf_ray`` (selected by ``launcher=ray``, see wf_launch/conf/launcher/ray.yaml).

Hydra's basic launcher calls the app once per point and waits for it: a Ray sweep would run
one point after another. This launcher runs every point through the app inline, exactly as the
basic launcher does (job dirs, ``.hydra/``, callbacks, validation: an invalid point is recorded
and the others go on), inside a :class:`~wf_launch.launchers.ray.submit.RayBatch` scope: a
``launcher=ray`` point is then only checked against the cluster and *prepared*. Once every
point ran, the batch starts them all, one supervisor actor each, and they run side by side
while the cluster has room (the others wait for it); the sweep waits for them (unless
``launcher.wait=false``), reporting each failed point as it ends. Hydra's ``on_multirun_end``
callbacks (the sweep report) run after this, on final results.

For any other Hydra app (and points of another wf_launch launcher) nothing is prepared: every
job runs inline and returns its value, as with the basic launcher.

Its body repeats ``wf_slurm``'s on purpose: Hydra's plugin scan imports both modules in every
Hydra app, and neither may import wf_launch then (a base class shared with it would be).
"""

import logging
from collections.abc import Sequence
from pathlib import Path

from hydra.core.utils import (
    JobReturn,
    JobStatus,
    configure_log,
    filter_overrides,
    run_job,
    setup_globals,
)
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


class WfRayLauncher(Launcher):
    """Run every point inline; start the Ray points prepared meanwhile together, then wait for
    them."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def _run_points(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> list[JobReturn]:
        assert (
            self.config is not None
            and self.hydra_context is not None
            and self.task_function is not None
        )
        runs: list[JobReturn] = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            sweep_config = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides)
            )
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            runs.append(
                run_job(
                    hydra_context=self.hydra_context,
                    task_function=self.task_function,
                    config=sweep_config,
                    job_dir_key="hydra.sweep.dir",
                    job_subdir_key="hydra.sweep.subdir",
                )
            )
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        # Hydra imports every plugin module on each app's start: ours stays empty until used
        from wf_launch.launchers.ray.submit import RayBatch

        assert self.config is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        sweep_dir.mkdir(
            mode=0o700, parents=True, exist_ok=True
        )  # owner-only: points keep their runs there
        log.info(f"Launching {len(job_overrides)} jobs locally (Ray points then run side by side)")
        batch = RayBatch(sweep_dir)
        with batch.collecting():  # an exception here drops the prepared points unstarted
            runs = self._run_points(job_overrides, initial_job_idx)
        if not batch:
            batch.close()
            return runs
        outcomes = batch.run()
        for ret in runs:
            if ret.status is not JobStatus.COMPLETED:
                continue
            run_dir = getattr(ret.return_value, "run_dir", None)
            if run_dir is not None and Path(str(run_dir)) in outcomes:
                ret.return_value = outcomes[Path(str(run_dir))]
        return runs
