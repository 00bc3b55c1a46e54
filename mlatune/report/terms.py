"""The report's terms, shared by its numbers (``metrics``) and its vendor policies
(``policies``): a problem in a few words, the decode batch bands, the geometric mean."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from mlatune.problem import MLAProblem

# Decode batch bands of the winner map: (lowest, highest or None, label).
BATCH_BANDS: tuple[tuple[int, int | None, str], ...] = (
    (1, 4, "batch 1-4"), (5, 64, "batch 5-64"), (65, None, "batch >= 65"))


def batch_band(batch: int) -> str:
    for low, high, label in BATCH_BANDS:
        if batch >= low and (high is None or batch <= high):
            return label
    raise AssertionError(batch)  # the bands cover every positive batch


def geomean(values: Sequence[float] | pd.Series) -> float:
    array = np.asarray(values, dtype="float64")
    return float(np.exp(np.log(array).mean())) if len(array) else math.nan


def problem_label(key: str) -> str:
    """A problem key as ``MLAProblem.label`` words; "-" for none."""
    return MLAProblem.from_key(key).label if key else "-"
