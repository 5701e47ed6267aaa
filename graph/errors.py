"""Errors raised by the Agent Step Graph."""


class GraphError(ValueError):
    """A graph or a runtime state that cannot be an Agent Step Graph (the message says why)."""
