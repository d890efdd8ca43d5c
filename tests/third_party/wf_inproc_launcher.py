"""A third-party launcher, as another package would ship it: ``launcher=inproc``.

It runs a one-rank job inside the launcher's own process (no new process at
all), which is the smallest thing that satisfies the launcher protocol. Its
package registers it through the ``wf_launch.launchers`` entry point (see the
``.dist-info`` folder beside this file), so wf_launch finds it without any change.
Everything it needs comes from ``wf_launch.launchers``, the launcher authors' one import.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from wf_launch.launchers import (
    ATTEMPT_ENV,
    LauncherConfig,
    RankSpec,
    RunOutcome,
    RunRecord,
    Status,
    config_error,
    rank_main,
)


@dataclass
class InprocLauncherConfig(LauncherConfig):
    """``launcher=inproc``: one rank, in this process."""

    name: str = "inproc"
    greeting: str = "hello"


class InprocLauncher:
    """Runs rank 0 of a one-rank layout in the launcher's own process."""

    name: ClassVar[str] = "inproc"
    config_class: ClassVar[type] = InprocLauncherConfig

    def validate(self, cfg: InprocLauncherConfig, layout: Any, engine: Any) -> None:
        if layout.world_size != 1:
            raise config_error(
                "launcher.name", "inproc", f"runs one rank; the layout has {layout.world_size}"
            )

    def describe(self, plan: Any) -> str:
        return f"launcher      inproc ({plan.launcher_config.greeting}): 1 rank in this process"

    def launch(self, plan: Any) -> RunOutcome:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", ATTEMPT_ENV: "0"})
        spec = RankSpec(config=plan.config, run_dir=str(plan.run_dir), launch_time=time.time())
        stdout, stderr = sys.stdout, sys.stderr
        t0 = time.time()
        try:
            rank_main(spec)
        finally:
            sys.stdout, sys.stderr = stdout, stderr
        record = RunRecord.finalize(
            plan.run_dir,
            Status.OK,
            launcher=self.name,
            task=plan.task,
            overrides=plan.overrides,
            timings={"wall_s": round(time.time() - t0, 4)},
        )
        return RunOutcome.of(record, plan.run_dir)
