"""What the world says, read off a connection and handed to the daemon as validated events.

Frames are judged by the pure `incoming.read_frame`; this module adds what depends on the connection
(which NPCs it was granted) and on time (the event queue, rate-limited warnings). The queue outlives
connections and restarts of `WorldLink.run()`: it ends only when the link leaves for good.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import structlog
from websockets.exceptions import ConnectionClosed

from bridge.logs import Throttle
from bridge.world.incoming import Ignored, Notice, Read, WorldInput, cut_talk, read_frame
from bridge.world.messages import Claimed, NpcEvent, Talk
from bridge.world.session import Connection

__all__ = ["CONSENTED_CLOSE_CODE", "Inbox"]

log = structlog.get_logger(__name__)

CONSENTED_CLOSE_CODE = 4000
ABNORMAL_CLOSE_CODE = 1006  # no close frame (the server vanished)
# Log lines per kind of ignored message per window; past that, a count comes with the next line.
IGNORED_LOG_BURST = 10
IGNORED_LOG_WINDOW_SECONDS = 60.0


class Inbox:
    """The event queue the daemon reads, fed by the reader of whichever connection is open."""

    def __init__(self, *, queue_size: int, clock: Callable[[], float]) -> None:
        self._queue: asyncio.Queue[WorldInput | None] = asyncio.Queue(maxsize=queue_size)
        # What the world sends is the world's choice: a flood of bad frames is logged, not journaled whole.
        self._throttle = Throttle(burst=IGNORED_LOG_BURST, window_seconds=IGNORED_LOG_WINDOW_SECONDS, clock=clock)
        self._closed = False

    async def events(self) -> AsyncIterator[WorldInput]:
        """Validated world events for granted NPCs, in arrival order; ends after `close()`."""
        while True:
            item = await self._queue.get()
            if item is None:
                self._queue.put_nowait(None)  # let any other reader end too
                return
            yield item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._queue.full():
            self._queue.get_nowait()
            log.warning("world_event_dropped", reason="queue_full_at_close")
        self._queue.put_nowait(None)

    async def read(self, conn: Connection, leaving: asyncio.Event) -> None:
        """Take frames off `conn` until it closes (the server's close after our leave is expected)."""
        while True:
            try:
                data = await conn.ws.recv()
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd else ABNORMAL_CLOSE_CODE
                reason = exc.rcvd.reason if exc.rcvd else ""
                expected = code == CONSENTED_CLOSE_CODE and leaving.is_set()
                (log.info if expected else log.warning)("world_disconnected", code=code, reason=reason[:200])
                return
            if isinstance(data, bytes):
                self.take(conn, read_frame(data, conn.seat.version))

    def take(self, conn: Connection, read: Read) -> None:
        """Act on one read frame of `conn`: merge a claim answer, queue an event, or log why not."""
        if isinstance(read, Claimed):
            self._on_claimed(conn, read)
        elif isinstance(read, Ignored):
            self._ignored(read.reason, read.type, **read.fields)
        elif isinstance(read, Notice):
            (log.info if read.level == "info" else log.warning)(read.event, **read.fields)
        elif isinstance(read, Talk | NpcEvent):
            if read.npc_id not in conn.claims.granted:
                self._ignored("npc_not_granted", "npc:talk" if isinstance(read, Talk) else "npc:event", npc=read.npc_id)
                return
            if isinstance(read, Talk):
                read, chars = cut_talk(read)
                if chars is not None:
                    log.info("world_talk_truncated", npc=read.npc_id, chars=chars)
            self._deliver(read)
        elif read is not None:
            self._deliver(read)

    def _on_claimed(self, conn: Connection, claimed: Claimed) -> None:
        answer = conn.claims.answer(claimed)
        log.info(
            "world_claimed",
            granted=sorted(answer.granted),
            denied=[{"npc_id": d.npc_id, "reason": d.reason[:200]} for d in claimed.denied],
            granted_total=len(conn.claims.granted),
            **({"features": sorted(claimed.features)} if claimed.features else {}),
            **({"unasked": answer.unasked} if answer.unasked else {}),
        )
        for denied in claimed.denied:
            log.warning("world_npc_denied", npc=denied.npc_id, reason=denied.reason[:200])

    def _deliver(self, message: WorldInput) -> None:
        try:
            self._queue.put_nowait(message)
        except asyncio.QueueFull:
            kind = type(message).__name__
            self._warn_limited(("event_dropped", kind), "world_event_dropped", reason="queue_full", type=kind)

    def _ignored(self, reason: str, message_type: str | int | None, **fields: Any) -> None:
        self._warn_limited(
            ("ignored", reason, message_type), "world_message_ignored", reason=reason, type=message_type, **fields
        )

    def _warn_limited(self, key: Hashable, event: str, **fields: Any) -> None:
        """A warning the world can cause at will: a few a minute per key, then a count of those left out."""
        dropped = self._throttle.admit(key)
        if dropped is None:
            return
        if dropped:
            fields["not_logged_before"] = dropped
        log.warning(event, **fields)
