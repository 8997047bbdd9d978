"""The LLM slot: at most N requests in flight, and replies are served before memory extractions."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from enum import IntEnum


class Priority(IntEnum):
    REPLY = 0
    EXTRACTION = 1


class LLMGate:
    """A counting semaphore whose waiters are woken by priority, then in arrival order.

    The LAN machine runs one generation at a time: a reply must never queue behind an extraction
    that only arrived first.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("slots must be at least 1")
        self._free = slots
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self, priority: Priority) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (int(priority), next(self._order), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # We were handed the slot as we were cancelled: pass it on.
                self.release()
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1

    @asynccontextmanager
    async def slot(self, priority: Priority) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()
