"""The report's terms, shared by its numbers (``metrics``) and its vendor policies
(``policies``): a problem in a few words, the decode batch bands, the geometric mean."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

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
    """A problem key in a few words: "decode h8 q2 bf16/fp8_e4m3fn dcp1 b64 kv4096"."""
    if not key:
        return "-"
    f = dict(part.split("=", 1) for part in key.split("|"))
    causal = "" if f["causal"] == "1" else " non-causal"
    return (f"{f['phase']} h{f['num_heads']} q{f['qlen']} {f['q_dtype']}/{f['kv_dtype']}"
            f"{causal} dcp{f['dcp_size']} p{f['page_size']} b{f['batch']} kv{f['kv_len']}")
