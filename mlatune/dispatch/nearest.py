"""The measured points of a bucket, nearest first: the dispatcher's ``nearest`` answers.

Points are (log2 batch, log2 kv_len) of a bucket's measured problems; the distance weighs
the total KV tokens first, then the batch (``point_distance``).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from mlatune.table.schema import competing

if TYPE_CHECKING:
    from mlatune.dispatch.choice import Choice

BATCH_WEIGHT = 0.5  # of the batch difference in point_distance, below 1: see there


def point_distance(d_batch: float, d_kv_len: float) -> float:
    """Squared distance between two points of a bucket, from the differences of their
    log2 batch and log2 kv_len.

    Total KV tokens (batch x kv_len) set the memory traffic, batch how many programs
    there are to fill the device; a point of the same size at the next batch comes
    before one of the same batch at the next KV length (the weight was chosen by
    leave-one-out on the H200 table: benchmarks/RESULTS.md).
    """
    return (d_batch + d_kv_len) ** 2 + BATCH_WEIGHT * d_batch ** 2


class Bucket:
    """Measured points of one bucket, by log2 batch then log2 kv_len, with their winners."""

    __slots__ = ("log_batches", "rows")

    def __init__(self, points: Sequence[tuple[int, int, Choice]]):
        by_batch: dict[float, list[tuple[float, Choice]]] = {}
        for batch, kv_len, choice in points:
            by_batch.setdefault(math.log2(batch), []).append((math.log2(kv_len), choice))
        self.log_batches = sorted(by_batch)
        self.rows = []
        for lb in self.log_batches:
            row = sorted(by_batch[lb], key=lambda p: p[0])
            self.rows.append(([p[0] for p in row], [p[1] for p in row]))

    def closest(self, x: float, y: float) -> Choice:
        """The point nearest (x, y) by point_distance; ties go to the smaller batch,
        then kv_len.

        Rows are visited outward from x in order of |dx|; the distance is at least
        BATCH_WEIGHT * dx^2, so once that alone exceeds the best distance, no later
        row can win. Within a row the nearest kv_len is the one closest to y - dx
        (the same total tokens).
        """
        lbs, n = self.log_batches, len(self.log_batches)
        right = bisect_left(lbs, x)
        left = right - 1
        best: tuple[float, float, float] | None = None
        best_choice = None
        while left >= 0 or right < n:
            if right >= n or (left >= 0 and x - lbs[left] <= lbs[right] - x):
                j, left = left, left - 1
            else:
                j, right = right, right + 1
            dx = lbs[j] - x
            if best is not None and BATCH_WEIGHT * dx * dx > best[0]:
                break
            kvs, choices = self.rows[j]
            k = bisect_left(kvs, y - dx)
            for m in (k - 1, k):
                if 0 <= m < len(kvs):
                    candidate = (point_distance(dx, kvs[m] - y), lbs[j], kvs[m])
                    if best is None or candidate < best:
                        best, best_choice = candidate, choices[m]
        assert best_choice is not None  # a bucket holds at least one point
        return best_choice

    def by_distance(self, x: float, y: float) -> list[Choice]:
        """Every point's winner, nearest first (the same order ``closest`` implies)."""
        scored = [(point_distance(lb - x, lk - y), lb, lk, i, choices[i])
                  for lb, (kvs, choices) in zip(self.log_batches, self.rows, strict=True)
                  for i, lk in enumerate(kvs)]
        scored.sort(key=lambda s: s[:4])
        return [s[4] for s in scored]


def learnable(points: dict[tuple, list[tuple[int, int, Choice]]], measured: Collection[str]
               ) -> dict[tuple, list[tuple[int, int, Choice]]]:
    """Per bucket the points that answer its unmeasured shapes (nearest, predicted): in a
    bucket with points timed across processes only those (``schema.competing``)."""
    if not measured:
        return points
    learnable = {}
    for bucket, bucket_points in points.items():
        keep = competing([bucket] * len(bucket_points),
                         [winner.key in measured for _, _, winner in bucket_points])
        learnable[bucket] = [p for p, kept in zip(bucket_points, keep, strict=True) if kept]
    return learnable
