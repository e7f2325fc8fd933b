"""Wake: what the scheduler should look at next, and whether it is idle.

Intake, executor status, liveness and replica sync say what changed; only the scheduler takes
the work out. Intake reads ``idle()`` to decide whether it may place new jobs itself.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass
class Wake:
    new_jobs: list[str] = field(default_factory=list)
    capacity_changed: bool = False
    # A pass over every waiting job, without stopping early (periodic safety net).
    thorough: bool = False
    # Counts capacity changes, so work that ran beside one can tell it missed it.
    epoch: int = 0
    # The scheduler is in a pass; passes counts the passes begun, so that work holding waiting
    # rows locked can tell a pass ran beside it (and skipped those rows: SKIP LOCKED).
    passing: bool = False
    passes: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def jobs(self, ids: list[str]) -> None:
        """New waiting jobs to look at."""
        self.new_jobs.extend(ids)
        self.event.set()

    def capacity(self) -> None:
        """Capacity may have changed: every waiting job is worth another look."""
        self.capacity_changed = True
        self.epoch += 1
        self.event.set()

    async def request_thorough(self) -> None:
        """Ask for a pass that never stops early (async: it runs as a periodic step)."""
        self.thorough = True
        self.event.set()

    def idle(self) -> bool:
        """No pass running or due: new jobs can be matched where they are ingested without
        overtaking anything older (same rule as a pass over new jobs only)."""
        return not (self.passing or self.capacity_changed or self.thorough or self.new_jobs)

    def begin_pass(self) -> None:
        self.passing = True
        self.passes += 1

    def take(self) -> tuple[list[str], bool, bool]:
        """The work asked for so far (new jobs, capacity changed, thorough), cleared."""
        new, self.new_jobs = self.new_jobs, []
        full, self.capacity_changed = self.capacity_changed, False
        thorough, self.thorough = self.thorough, False
        return new, full, thorough
