"""A failing memory disk, seen from the store: one warning a minute, and the writers woken when it works.

While writes fail, the first failure and then at most one a minute is logged (`memory_write_failed`,
with the count of failures since the last warning and the NPCs whose changes wait in RAM); the
first write that goes through again logs `memory_write_recovered` and wakes every writer waiting out
its backoff, so what waited is written at once instead of up to a backoff cap later.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

WARNING_EVERY_SECONDS = 60.0


class DiskFaults:
    """Whether writes fail, one warning a minute about it, and the wake-up of writers when they work."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._since: float | None = None  # when writes started failing
        self._warned = float("-inf")
        self._failures = 0  # failed writes since the last warning
        self._recovered: asyncio.Event | None = None

    def failed(self, path: Path, exc: OSError, unwritten: Callable[[], list[str]]) -> None:
        now = self._clock()
        if self._since is None:
            self._since = now
        self._failures += 1
        if now - self._warned >= WARNING_EVERY_SECONDS:
            waiting = unwritten()
            log.warning(
                "memory_write_failed",
                path=str(path),
                error=errno.errorcode.get(exc.errno or 0, type(exc).__name__),
                detail=str(exc)[:200],
                failures=self._failures,
                npcs_waiting=len(waiting),
                npc_ids=waiting[:20],
                kept="in RAM, written once the disk takes writes again",
            )
            self._warned, self._failures = now, 0

    def succeeded(self) -> None:
        """Note a good write (the end of a time of failing writes, if it was one)."""
        if self._since is None:
            return
        log.info("memory_write_recovered", failing_seconds=round(self._clock() - self._since, 1))
        self._since, self._warned, self._failures = None, float("-inf"), 0
        self.retry_now()

    def retry_now(self) -> None:
        """Wake every writer waiting out its backoff (a write went through, or shutdown is here)."""
        if self._recovered is not None:
            self._recovered.set()
            self._recovered = None

    async def wait(self, seconds: float) -> None:
        """Sleep `seconds`, or less when a write goes through meanwhile."""
        if self._recovered is None:
            self._recovered = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._recovered.wait(), seconds)
