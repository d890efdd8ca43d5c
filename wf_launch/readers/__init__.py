"""Commands that read runs and start nothing: ``status``, ``runs``, ``plot``, ``checkpoint`` (list,
export) and the sweep report (:mod:`.sweep`, with the Hydra callback that writes it when a sweep
ends). They read the run directory (:mod:`wf_launch.rundir`) and ask the run's launcher (its
hooks) about anything scheduler-specific. Each is ``python -m wf_launch.NAME`` through a one-line
module at the top of ``wf_launch``."""
