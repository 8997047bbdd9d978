"""Supervision of the daemon's components: restart after a crash, give up after too many.

Each component runs in its own task. One that raises (or returns before shutdown) is logged with its
traceback and started again after a growing delay (reset after a healthy run). One that crashes
`max_crashes` times within `window_seconds` is not restarted: the supervisor reports it (`on_give_up`)
and the daemon ends with exit code 1, so systemd (`Restart=on-failure`) starts a fresh process —
never a daemon that says READY and cannot hear the world. `all_running()` is what the watchdog ping
vouches for; `restarting()` names the components now waiting to be started again.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable

import structlog

from bridge.backoff import Backoff

log = structlog.get_logger(__name__)

RESTART_BACKOFF_FIRST_SECONDS = 1.0
RESTART_BACKOFF_CAP_SECONDS = 30.0
HEALTHY_RUN_SECONDS = 60.0
MAX_CRASHES = 5
CRASH_WINDOW_SECONDS = 300.0


class Supervisor:
    def __init__(
        self,
        *,
        stopping: Callable[[], bool] = lambda: False,
        on_change: Callable[[], None] = lambda: None,
        on_give_up: Callable[[str, int], None] = lambda name, crashes: None,
        first_delay: float = RESTART_BACKOFF_FIRST_SECONDS,
        cap: float = RESTART_BACKOFF_CAP_SECONDS,
        healthy_after: float = HEALTHY_RUN_SECONDS,
        max_crashes: int = MAX_CRASHES,
        window_seconds: float = CRASH_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stopping = stopping
        self._on_change = on_change
        self._on_give_up = on_give_up
        self._first_delay = first_delay
        self._cap = cap
        self._healthy_after = healthy_after
        self.max_crashes = max_crashes
        self.window_seconds = window_seconds
        self._clock = clock
        self._running: dict[str, bool] = {}
        self._crashes: dict[str, deque[float]] = {}

    def all_running(self) -> bool:
        return all(self._running.values())

    def restarting(self) -> list[str]:
        return [name for name, running in self._running.items() if not running]

    def recent_crashes(self, name: str) -> int:
        return len(self._crashes.get(name, ()))

    def _set(self, name: str, running: bool) -> None:
        if self._running.get(name) != running:
            self._running[name] = running
            self._on_change()

    async def supervise(self, name: str, component: Callable[[], Awaitable[None]]) -> None:
        """Run a component until shutdown, restarting it after crashes; return after giving up on it."""
        # At least half of each step's delay: a crash loop never restarts at once.
        backoff = Backoff(
            base_seconds=self._first_delay, cap_seconds=self._cap, healthy_after_seconds=self._healthy_after, jitter=0.5
        )
        crashes = self._crashes.setdefault(name, deque())
        while True:
            started = self._clock()
            self._set(name, True)
            try:
                await component()
                if self._stopping():
                    return
                log.warning("component_returned", component=name)
            except asyncio.CancelledError:
                raise
            except Exception:
                if self._stopping():
                    return
                log.exception("component_crashed", component=name)
            now = self._clock()
            crashes.append(now)
            while crashes and now - crashes[0] > self.window_seconds:
                crashes.popleft()
            if len(crashes) >= self.max_crashes:
                log.error("component_failed", component=name, crashes=len(crashes), window_s=self.window_seconds)
                self._on_give_up(name, len(crashes))
                self._set(name, False)
                return
            backoff.connection_ended(now - started)
            wait = backoff.next_delay()
            log.info("component_restarting", component=name, delay_s=round(wait, 2), crashes=len(crashes))
            self._set(name, False)
            await asyncio.sleep(wait)
