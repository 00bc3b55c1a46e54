"""Errors shared by specs, journals, table reading and writing, the dispatcher and decode's
argument checks (no heavy imports here).

Every error a user's input or environment can cause (a bad spec, a damaged journal or
table, an output that cannot be written) is one of the ``ValueError`` subclasses below,
with a one-line message naming the file: the CLI prints it as one line and exits 1.
"""


class SpecError(ValueError):
    """A spec that cannot be used; the message names the file and the key."""


class JournalError(ValueError):
    """A sweep journal that cannot be used: damaged, written for another sweep, or in use
    by another sweep. The message names the file (and the line, for a damaged one)."""


class TableError(ValueError):
    """A table that cannot be used. The message is one line and names the file."""


class OutputError(ValueError, OSError):
    """An output that cannot be written: a directory in the way, a parent that is not
    writable or cannot be made, a read-only file system, a full disk. The message is one
    line and names the path. Also an ``OSError``, so callers that caught the OSError of a
    failed write before still catch it."""


class DecodeArgumentError(ValueError):
    """An argument of ``mlatune.attention.decode`` that the kernels cannot serve.

    The message starts with the argument's name (``"kv_scale: ..."``), so an engine's
    log says which tensor to fix. A ValueError, so callers that caught ValueError from
    decode's older checks still catch it.
    """


class RankMismatchError(ValueError):
    """The ranks of one torch.distributed process group would not serve the same answers:
    at load their tables, GPU models, routes, libraries or load arguments differ; on first
    sight they timed different candidates. The message is one line and names each rank
    with what it has."""


class SettingError(ValueError):
    """An environment variable of mlatune's whose value cannot be used (a flag that is
    neither on nor off, a plugin module that does not import). The message starts with
    the variable's name."""
