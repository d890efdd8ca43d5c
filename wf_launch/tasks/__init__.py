"""Built-in tasks (demo, layout, noop, train; script and call for code written for torchrun);
tasks register on import (the registry and the task context live in :mod:`wf_launch.rank`)."""

__all__: list[str] = []
