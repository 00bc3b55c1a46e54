"""Moved to ``mlatune.measure.records``; this name goes once its last importers move."""
from mlatune.measure.records import *  # noqa: F403
from mlatune.measure.records import COST_PARTS, Record, Result, Status, Task  # noqa: F401
