"""mlatune: measure every MLA attention route per shape and ship the winners as a table."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Loaded on first use: importing mlatune (every module does) never loads the tuner.
    if name == "tune_at_load":
        import importlib

        return importlib.import_module("mlatune.sweep.at_load").tune_at_load
    raise AttributeError(f"module 'mlatune' has no attribute {name!r}")
