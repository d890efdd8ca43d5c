"""WorldFoundry: runtime library for distributed video / world-model jobs."""

__all__: list[str] = []
