"""Errors shared by table reading, the dispatcher and decode's argument checks (no heavy
imports here)."""


class TableError(ValueError):
    """A table that cannot be used. The message is one line and names the file."""


class DecodeArgumentError(ValueError):
    """An argument of ``mlatune.attention.decode`` that the kernels cannot serve.

    The message starts with the argument's name (``"kv_scale: ..."``), so an engine's
    log says which tensor to fix. A ValueError, so callers that caught ValueError from
    decode's older checks still catch it.
    """
