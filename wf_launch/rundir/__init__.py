"""The run directory: its format (docs/run-dir.md), and every reader and writer of it.

:mod:`.files` names every file (nothing else spells one) and reads ``config.yaml``;
:mod:`.io` writes atomically; :mod:`.record` is the one reader and writer of
``result.json`` and :mod:`.outcome` what a launch hands back; :mod:`.attempts`,
:mod:`.failures`, :mod:`.progress` and :mod:`.environment` the other records;
:mod:`.claim` makes a directory one launch's own; :mod:`.checkpoints` is the format of
``checkpoints/`` (step names, ``COMMIT``, which checkpoints are complete). Ranks write
through these modules, launchers and tools read through them.
"""
