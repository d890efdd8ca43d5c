"""WorldFoundry: runtime library for distributed video / world-model jobs."""
