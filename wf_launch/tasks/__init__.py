"""Built-in tasks (demo, layout, noop) and the task registry; tasks register on import."""

__all__: list[str] = []
