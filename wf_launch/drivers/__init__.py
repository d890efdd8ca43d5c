"""Commands that start runs through the CLI: ``run`` (torchrun's command line), ``drill`` (a
reference run and a run that is killed and resumed), and the layout tuner (:mod:`.tune`, rounds of
sweeps). They drive ``python -m wf_launch``; what they read back goes through
:mod:`wf_launch.readers` and :mod:`wf_launch.rundir`."""
