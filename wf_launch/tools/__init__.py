"""Commands that read runs after (or beside) the launch: ``status``, ``runs``, ``plot``, ``drill`` and the
sweep report (:mod:`.sweep`). Each is ``python -m wf_launch.NAME`` through a one-line module at the top of
``wf_launch``."""
