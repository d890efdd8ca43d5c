"""The layout tuner, ``python -m wf_launch.tune`` (docs/tune.md).

By role: :mod:`.space` (the candidates and the command line's checks), :mod:`.prune`
(validation and memory estimates, nothing started), :mod:`.measure` (a trial's steady
step time and metric, or its cause of failure), :mod:`.rounds` (one round as a sweep,
watched), :mod:`.stall` (a trial that stopped moving), :mod:`.search` (successive
halving), :mod:`.state` (``tune.json``, resume), :mod:`.report` and :mod:`.chart`
(the report, ``best.yaml``), :mod:`.cli` (the command).
"""
