"""Dispatch: from a table to the route that serves a problem, at run time.

``dispatcher`` holds the ``Dispatcher`` engines load (its public names are
re-exported here, so ``mlatune.dispatch.Dispatcher`` is the spelling engines
use); ``environment`` compares a table's recorded environment with the running
one; ``predict`` models route times at unmeasured shapes (how ``select`` answers them
by default); ``first_sight`` times unsure answers at run time. Nothing here imports
pandas, pyarrow or Triton at import.
"""

from mlatune.dispatch.dispatcher import (
    Choice,
    Dispatcher,
    TableError,
    bundled_tables_dir,
    by_handle,
    device_for_arch,
    find_table,
    point_distance,
)
from mlatune.table.cost import step_cost

__all__ = ["Choice", "Dispatcher", "TableError", "bundled_tables_dir", "by_handle",
           "device_for_arch", "find_table", "point_distance", "step_cost"]
