"""The reply deadline: one instant on the monotonic clock, handed down the whole reply path.

`NPC_BRIDGE_REPLY_DEADLINE_SECONDS` counts from the moment a player's line reached the bridge
(queue time included). The dispatcher makes one `Deadline` per line when it arrives; the wait for
the NPC, the memory recall, the wait for the LLM slot, every LLM request (as its
`deadline_seconds`) and the reply's single timeout scope all read what is left of that same
instant. Shutdown may bring it forward (`shorten`), which reschedules the scopes already running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

Reason = Literal["deadline", "shutdown"]


class Deadline:
    """When a reply must be said at the latest, as a `time.monotonic()` instant."""

    def __init__(self, at: float) -> None:
        self._at = at
        self._reason: Reason = "deadline"
        self._scopes: set[asyncio.Timeout] = set()

    @classmethod
    def after(cls, seconds: float, *, since: float | None = None) -> Deadline:
        """`seconds` after `since` (a `time.monotonic()` instant; default now)."""
        return cls((time.monotonic() if since is None else since) + seconds)

    @property
    def at(self) -> float:
        return self._at

    @property
    def reason(self) -> Reason:
        """Why it ends: the reply deadline, or a shutdown that brought it forward."""
        return self._reason

    def remaining(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self._at - time.monotonic())

    @property
    def passed(self) -> bool:
        return time.monotonic() >= self._at

    def shorten(self, seconds: float) -> None:
        """End at most `seconds` from now (shutdown): running scopes end then too."""
        at = time.monotonic() + seconds
        if at >= self._at:
            return
        self._at, self._reason = at, "shutdown"
        loop_at = asyncio.get_running_loop().time() + seconds
        for scope in self._scopes:
            scope.reschedule(loop_at)

    @asynccontextmanager
    async def scope(self) -> AsyncIterator[None]:
        """Raise `TimeoutError` in the block when the deadline passes (or has passed)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(loop.time() + self.remaining()) as timeout:
            self._scopes.add(timeout)
            try:
                yield
            finally:
                self._scopes.discard(timeout)
