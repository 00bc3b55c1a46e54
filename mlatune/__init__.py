"""mlatune: measure every MLA attention route per shape and ship the winners as a table."""

__version__ = "0.1.0"
