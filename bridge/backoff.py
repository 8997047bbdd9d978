"""Exponential backoff with jitter and a cap, reset after a healthy run: the one backoff of the bridge
(world reconnects, component restarts, LLM request retries, memory extraction retries, the shared memory
outbox, memory file writes on a failing disk). `delay_seconds` is the one formula; `Backoff` keeps the
attempt count for a loop that retries."""

from __future__ import annotations

import random
from collections.abc import Callable

BASE_SECONDS = 0.5
CAP_SECONDS = 30.0
HEALTHY_AFTER_SECONDS = 60.0


def delay_seconds(
    attempt: int, *, base: float, cap: float, jitter: float = 1.0, rand: Callable[[], float] = random.random
) -> float:
    """min(cap, base * 2**attempt), of which a random share of `jitter` is left to chance.

    jitter 1 is "full jitter" (uniform over [0, ceiling]: many waiting peers spread out), 0.5 keeps at
    least half the ceiling, 0 is exact (tests).
    """
    # The exponent is clamped: 2.0 ** 1100 overflows, and min() comes after the power.
    ceiling = min(cap, base * 2.0 ** min(max(attempt, 0), 64))
    return ceiling * (1.0 - jitter + jitter * rand())


class Backoff:
    """Delays for a retry loop: `delay_seconds` with the attempt count kept here (full jitter by default).

    Tests pass short `base_seconds` / `cap_seconds` (and a seeded `rand`) instead of patching time.
    """

    def __init__(
        self,
        *,
        base_seconds: float = BASE_SECONDS,
        cap_seconds: float = CAP_SECONDS,
        healthy_after_seconds: float = HEALTHY_AFTER_SECONDS,
        jitter: float = 1.0,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if base_seconds <= 0 or cap_seconds < base_seconds:
            raise ValueError("backoff needs 0 < base_seconds <= cap_seconds")
        self.base_seconds = base_seconds
        self.cap_seconds = cap_seconds
        self.healthy_after_seconds = healthy_after_seconds
        self.jitter = jitter
        self._rand = rand
        self.attempt = 0

    def ceiling(self) -> float:
        """The upper bound of the next delay."""
        return delay_seconds(self.attempt, base=self.base_seconds, cap=self.cap_seconds, jitter=0.0)

    def next_delay(self) -> float:
        """The next delay in seconds; each call widens the window until the cap."""
        delay = delay_seconds(
            self.attempt, base=self.base_seconds, cap=self.cap_seconds, jitter=self.jitter, rand=self._rand
        )
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
