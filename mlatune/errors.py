"""Errors shared by table reading and the dispatcher (no heavy imports here)."""


class TableError(ValueError):
    """A table that cannot be used. The message is one line and names the file."""
