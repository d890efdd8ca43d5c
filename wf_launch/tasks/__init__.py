"""Built-in tasks (demo, layout, noop, train; script and call for code written for torchrun) and the task
registry; tasks register on import."""

__all__: list[str] = []
