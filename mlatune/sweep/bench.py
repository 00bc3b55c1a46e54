"""Moved to ``mlatune.measure.timers``; this name goes once its last importers move."""
from mlatune.measure.timers import *  # noqa: F403
from mlatune.measure.timers import Budget, Timing, host_us, measure  # noqa: F401
