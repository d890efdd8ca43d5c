"""Code that runs inside rank processes.

Every launcher's rank enters :func:`.entrypoint.rank_main`; around the task it sets up
the rank's log (:mod:`.ranklog`), the stack-dump signal (:mod:`.stackdump`), the stop
flag (:mod:`.stop`) and preemption (:mod:`.preempt`), records a failure
(:mod:`.failure`) and leaves without torch's teardown where that can abort
(:mod:`.hardexit`). A task's checkpoints (:mod:`.checkpoint`) and progress
(:mod:`.progress`) are written from here too. Nothing in this package runs in the
launcher; what the launcher reads back lives in :mod:`wf_launch.rundir`.
"""
