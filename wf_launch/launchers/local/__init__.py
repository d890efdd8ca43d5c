"""``launcher=local``: ranks as processes on this machine, on torch's elastic agent.

:mod:`.launcher` holds the config and the launcher (validate, describe, launch, the
run's outcome); :mod:`.agent` torch's agent with the hooks we need (every rank's exit
code, the fork gate, loopback stores); :mod:`.rank_entry` what each rank process runs.
"""

from __future__ import annotations

from .launcher import LocalLauncher, LocalLauncherConfig, choose_start_method, threads_per_rank

__all__ = ["LocalLauncher", "LocalLauncherConfig", "choose_start_method", "threads_per_rank"]
