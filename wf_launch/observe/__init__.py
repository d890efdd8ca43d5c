"""Code that runs in the launcher (or ``status --follow``) and watches ranks while they run.

:mod:`.live` is the live view and the final line, :mod:`.progress` the progress bar and
stall warnings, :mod:`.watch` the start-up heartbeat and bound, :mod:`.stacks` the hang
autopsy, :mod:`.rootcause` the verdict on a failed run, :mod:`.console` the launcher's
own log.
"""
