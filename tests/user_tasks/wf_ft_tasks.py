"""An ft task for the tests: ``train``, whose heal takes long enough to fail in the middle of.

``train_slow_heal`` is ``train`` but for a sleep before it loads a peer's state, so that a drill
can kill a rank of the group while it heals (``kill9:replicaK@heal``) without racing the load.
"""

from __future__ import annotations

import time
from typing import Any

from wf_launch import TaskContext, register_task
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
