"""What a sweep tells about its progress (``Observer``): each stage that runs candidates
(``runner``'s compiling ahead, one-device pass and reference fallbacks; ``dcp_stage``)
says how many it starts and hands over every record as it finishes. The CLI's progress
bars are one; tests count with another.
"""

from __future__ import annotations

from typing import Protocol

from mlatune.measure.records import Record

__all__ = ["Observer"]


class Observer(Protocol):
    """Told what a sweep runs. ``started`` counts candidates that run (a progress bar's
    whole), never the (problem, route) pairs a rule refuses: those are recorded at once
    and run nothing. An observer may also have ``refused(count)``, told their number."""

    def started(self, total: int, already_done: int, what: str = "sweep") -> None: ...
    def finished(self, record: Record) -> None: ...
