"""An ft task for the tests: ``train``, whose heal takes long enough to fail in the middle of.

``train_slow_heal`` is ``train`` but for a sleep before it loads a peer's state, so that a drill
can kill a rank of the group while it heals (``kill9:replicaK@heal``) without racing the load.

``train_hangs_once`` is ``train`` but for a hang in Python (not a stopped process): with
``WF_TEST_HANG_AT=K:S`` in the environment, rank 0 of replica group K sleeps forever in step S of
its first attempt, right after the step's quorum, where a deadlock in a forward would sit.

With ``WF_TEST_BACK_LATE=1`` in the environment, a restarted replica group joins torchft only
once every other group has ended its steps: back after its peers finished, as a restart slower
than the rest of the run would be (any task of a run that loads this module). With
``WF_TEST_ASK_LATE=1`` as well, its rank 0 then asks the Lighthouse for its first quorum only
once a holding group has formed a quorum without it: the race between writing its phase and
asking, lost every time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from wf_launch import TaskContext, register_task
from wf_launch.rank import ft
from wf_launch.rank.ft import ENDED, FtSession, read_mark, replica_id, restarted
from wf_launch.rundir import files
from wf_launch.tasks.train import PRELOAD, TrainConfig, train

HEAL_SLEEP_S = 3.0


@register_task("train_slow_heal", config=TrainConfig, preload=PRELOAD, ft=True)
def train_slow_heal(ctx: TaskContext) -> dict[str, Any]:
    register = ctx.ft.register_state_dict_fn

    def register_slowly(key: str, load: Any, save: Any) -> None:
        def load_slowly(state: Any) -> None:
            time.sleep(HEAL_SLEEP_S)
            load(state)

        register(key, load_slowly, save)

    ctx.ft.register_state_dict_fn = register_slowly
    return train(ctx)


HANG_AT_ENV = "WF_TEST_HANG_AT"


@register_task("train_hangs_once", config=TrainConfig, preload=PRELOAD, ft=True)
def train_hangs_once(ctx: TaskContext) -> dict[str, Any]:
    replica, _, step = os.environ.get(HANG_AT_ENV, "").partition(":")
    manager = ctx.ft
    if replica and int(replica) == replica_id() and ctx.rank == 0 and not restarted():
        start_quorum = manager.start_quorum

        def start_quorum_then_hang(*args: Any, **kwargs: Any) -> None:
            start_quorum(*args, **kwargs)
            if manager.current_step() == int(step):
                while True:
                    time.sleep(60)

        manager.start_quorum = start_quorum_then_hang
    return train(ctx)


BACK_LATE_ENV = "WF_TEST_BACK_LATE"
BACK_LATE_WAIT_S = 120.0
_join_torchft = FtSession.__init__


def _join_after_the_others_ended(
    self: FtSession, config: dict[str, Any], run_dir: Any, *args: Any, **kwargs: Any
) -> None:
    """With ``WF_TEST_BACK_LATE=1``: a restarted group joins torchft only once every other group
    has ended its steps (before its Manager heartbeats: a slow restart, not a hung group)."""
    if os.environ.get(BACK_LATE_ENV) == "1" and restarted():
        me, top = replica_id(), Path(run_dir).parent.parent
        others = [
            files.ft_replica_dir(top, k) for k in range(int(config["ft"]["replicas"])) if k != me
        ]
        deadline = time.monotonic() + BACK_LATE_WAIT_S
        while time.monotonic() < deadline and not all(read_mark(d) == ENDED for d in others):
            time.sleep(0.05)
    _join_torchft(self, config, run_dir, *args, **kwargs)


FtSession.__init__ = _join_after_the_others_ended  # type: ignore[method-assign]


ASK_LATE_ENV = "WF_TEST_ASK_LATE"
ASK_LATE_WAIT_S = 30.0
MISSED = "the quorum formed without replica group(s)"
_write_phase = ft.write_phase


def _write_phase_then_ask_late(
    replica_dir: Any, rank: int, phase: str, step: int, first: bool = False
) -> None:
    """With ``WF_TEST_ASK_LATE=1``: a restarted group's rank 0, having written its first
    quorum's phase, waits until another group's rank 0 has logged a quorum formed without it."""
    _write_phase(replica_dir, rank, phase, step, first)
    if not (first and rank == 0 and os.environ.get(ASK_LATE_ENV) == "1" and restarted()):
        return
    top = Path(replica_dir).parent.parent
    logs = [p / "logs" / "rank0.log" for p in top.glob("replicas/*") if p != Path(replica_dir)]
    deadline = time.monotonic() + ASK_LATE_WAIT_S
    while time.monotonic() < deadline:
        if any(log.exists() and MISSED in log.read_text() for log in logs):
            return
        time.sleep(0.05)


ft.write_phase = _write_phase_then_ask_late
