"""Helpers for tests that drive a `WorldLink` against a reference world."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from bridge.backoff import Backoff
from bridge.world.client import WorldInput, WorldLink

FAST_BACKOFF_CAP_SECONDS = 0.4


def fast_backoff() -> Backoff:
    """Short delays for tests (the production defaults are 0.5 s to 30 s)."""
    return Backoff(base_seconds=0.05, cap_seconds=FAST_BACKOFF_CAP_SECONDS, healthy_after_seconds=60.0)


class LinkHarness:
    """A running `WorldLink` plus what it reported: status lines and a reader over its events."""

    def __init__(self, link: WorldLink) -> None:
        self.link = link
        self.statuses: list[str] = []
        self._events = link.events().__aiter__()

    async def next_event(self, timeout: float = 10.0) -> WorldInput:  # noqa: ASYNC109
        return await asyncio.wait_for(self._events.__anext__(), timeout)

    async def no_event(self, wait: float = 0.3) -> None:
        """Assert that nothing arrives within `wait` seconds."""
        try:
            event = await asyncio.wait_for(self._events.__anext__(), wait)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected event {event!r}")

    async def until(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:  # noqa: ASYNC109
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() >= deadline:
                raise TimeoutError("condition not met")
            await asyncio.sleep(0.02)

    async def joined(self, npc_id: str = "cafe-minori", timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until the link is connected and `npc_id` is granted."""
        await self.until(lambda: self.link.connected and npc_id in self.link.granted, timeout)


@contextlib.asynccontextmanager
async def running_link(
    url: str,
    token: str,
    *,
    npc_ids: tuple[str, ...] = ("cafe-minori", "cinema-aoi"),
    room: str = "world",
    **options: Any,
) -> AsyncIterator[LinkHarness]:
    """A `WorldLink` whose `run()` is a task for the duration; left (consented) on exit."""
    options.setdefault("backoff", fast_backoff())
    statuses: list[str] = []
    link = WorldLink(url=url, room=room, token=token, npc_ids=npc_ids, on_status=statuses.append, **options)
    harness = LinkHarness(link)
    harness.statuses = statuses
    task = asyncio.create_task(link.run(), name="test-world-link")
    try:
        yield harness
    finally:
        await link.leave()
        if not task.done():
            try:
                await asyncio.wait_for(task, 10)
            finally:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
