"""Exponential backoff with full jitter and a cap, reset after a healthy run: the one backoff of the bridge
(world reconnects, memory extraction retries, the shared memory outbox, memory file writes on a failing disk)."""

from __future__ import annotations

import random
from collections.abc import Callable

BASE_SECONDS = 0.5
CAP_SECONDS = 30.0
HEALTHY_AFTER_SECONDS = 60.0


class Backoff:
    """Delays for reconnection attempts: uniform(0, min(cap, base * 2**attempt)) ("full jitter").

    Tests pass short `base_seconds` / `cap_seconds` (and a seeded `rand`) instead of patching time.
    """

    def __init__(
        self,
        *,
        base_seconds: float = BASE_SECONDS,
        cap_seconds: float = CAP_SECONDS,
        healthy_after_seconds: float = HEALTHY_AFTER_SECONDS,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if base_seconds <= 0 or cap_seconds < base_seconds:
            raise ValueError("backoff needs 0 < base_seconds <= cap_seconds")
        self.base_seconds = base_seconds
        self.cap_seconds = cap_seconds
        self.healthy_after_seconds = healthy_after_seconds
        self._rand = rand
        self.attempt = 0

    def ceiling(self) -> float:
        """The upper bound of the next delay."""
        # min() before the power would overflow after ~1000 attempts; clamp the exponent instead.
        return min(self.cap_seconds, self.base_seconds * 2.0 ** min(self.attempt, 64))

    def next_delay(self) -> float:
        """The next delay in seconds; each call widens the window until the cap."""
        delay = self._rand() * self.ceiling()
        self.attempt += 1
        return delay

    def slow_delay(self) -> float:
        """The delay after a configuration error (refused token): near the cap, never a tight loop."""
        self.attempt += 1
        return self.cap_seconds * (0.75 + 0.25 * self._rand())

    def reset(self) -> None:
        """Start again from the base delay (after a connection that stayed up)."""
        self.attempt = 0

    def connection_ended(self, uptime_seconds: float) -> None:
        """Reset if the connection that just ended was healthy (stayed up long enough)."""
        if uptime_seconds >= self.healthy_after_seconds:
            self.reset()
