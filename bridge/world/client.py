"""The world link: one Colyseus worker connection that joins, claims NPCs, listens, speaks and reconnects.

The rest of the daemon sees only `WorldLink`: validated events in (`events()`), `say` / `say_part` /
`typing` out, `voice` to change who is claimed. The jobs behind it each have their own module:
`session` (join, handshake, reconnection token, sending), `claims` (claims in frames that fit, merged
answers), `incoming` + `inbox` (validation, the event queue), `outbox` (replies kept while
disconnected). This module holds the reconnect loop and the lifetime of one connection
(`_connection` → `_serve` → `_speak`), read top to bottom.

`run()` may be called again after it raised or was cancelled (the daemon restarts a crashed link):
the next run connects anew and claims again, and `events()` keeps going across restarts. Only
`leave()` ends the link for good. A crash with the socket still open leaves the room with consent, so
the next run's fresh join gets the NPCs at once (a held seat would keep them for the world's
reconnection window); a crash after the socket had closed keeps the reconnection token instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence

import httpx
import structlog

from bridge import __version__
from bridge.errors import WorldAuthError, WorldError
from bridge.world.backoff import Backoff
from bridge.world.claims import claim_chunks
from bridge.world.inbox import Inbox
from bridge.world.incoming import WorldInput
from bridge.world.matchmaking import HTTP_TIMEOUT_SECONDS
from bridge.world.messages import SAY_PARTS_FEATURE, Say, SayPart, Typing
from bridge.world.outbox import Outbox
from bridge.world.session import HANDSHAKE_TIMEOUT_SECONDS, Connection, Session, fit_say

__all__ = ["WorldInput", "WorldLink"]

log = structlog.get_logger(__name__)

EVENT_QUEUE_SIZE = 1000
SAY_BUFFER_SIZE = 100  # replies kept while disconnected
SAY_MAX_AGE_SECONDS = 60.0
CLAIM_ANSWER_TIMEOUT_SECONDS = 5.0  # kept replies wait this long at most for the claim answers
LEAVE_TIMEOUT_SECONDS = 5.0


class WorldLink:
    """The bridge's worker connection to the world room (world-protocol.md)."""

    def __init__(
        self,
        *,
        url: str,
        room: str,
        token: str,
        npc_ids: Sequence[str],
        on_status: Callable[[str], None] | None = None,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        say_max_age_seconds: float = SAY_MAX_AGE_SECONDS,
        say_buffer_size: int = SAY_BUFFER_SIZE,
        event_queue_size: int = EVENT_QUEUE_SIZE,
        handshake_timeout_seconds: float = HANDSHAKE_TIMEOUT_SECONDS,
        say_parts: bool = True,
    ) -> None:
        self._url = url
        self._room = room
        self._npc_ids = tuple(dict.fromkeys(npc_ids))
        self._status = _guarded(on_status)
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._say_parts = say_parts
        self._session = Session(url=url, room=room, token=token, handshake_timeout_seconds=handshake_timeout_seconds)
        self._inbox = Inbox(queue_size=event_queue_size, clock=clock)
        self._outbox = Outbox(clock=clock, max_age_seconds=say_max_age_seconds, max_replies=say_buffer_size)

        self.connected = False  # joined, claimed, kept replies sent: live says go straight out
        self._conn: Connection | None = None
        # Features of the latest connection whose claims were answered (kept while reconnecting).
        self._offered: Collection[str] = frozenset()
        self._voiced = asyncio.Event()  # voice() changed the roster: claim the new ids
        self._leaving = asyncio.Event()
        self._stopped = asyncio.Event()
        self._running = False

    def __repr__(self) -> str:  # never shows the token
        return f"WorldLink(url={self._url!r}, room={self._room!r}, connected={self.connected})"

    @property
    def granted(self) -> frozenset[str]:
        """The NPCs the current connection was granted (empty while disconnected)."""
        conn = self._conn
        return frozenset(conn.claims.granted) if conn is not None else frozenset()

    @property
    def parts_wanted(self) -> bool:
        """Whether to send `npc:say:part`: enabled, and offered by the world of the current connection."""
        return self._say_parts and SAY_PARTS_FEATURE in self._offered

    # ------------------------------------------------------------ public interface

    async def run(self) -> None:
        """Connect, serve and reconnect until `leave()`. Cancelling it closes the socket (not consented)."""
        if self._running:
            raise RuntimeError("WorldLink.run() is already running")
        if self._leaving.is_set():
            return
        self._running = True
        self._stopped.clear()
        try:
            async with httpx.AsyncClient(
                timeout=HTTP_TIMEOUT_SECONDS, headers={"user-agent": f"npc-bridge/{__version__}"}
            ) as http:
                while not self._leaving.is_set():
                    delay = await self._connection(http)
                    if self._leaving.is_set():
                        break
                    log.info("world_reconnecting", delay_s=round(delay, 3), attempt=self._backoff.attempt)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._leaving.wait(), delay)
        finally:
            self.connected = False
            self._conn = None
            self._running = False
            if self._leaving.is_set():
                self._inbox.close()
            self._stopped.set()

    def events(self) -> AsyncIterator[WorldInput]:
        """Validated world events for granted NPCs, in arrival order; ends after `leave()`."""
        return self._inbox.events()

    async def say(self, message: Say) -> None:
        """Send `npc:say`; while disconnected, keep it (bounded) and send it after the next join."""
        message = fit_say(message)
        self._outbox.mark_said(message.reply_to)
        await self._send_or_keep(message)

    async def say_part(self, message: SayPart) -> None:
        """Send `npc:say:part` when the world takes parts; kept like a say while disconnected.

        Dropped (logged) when the world does not take parts, or when the reply's `npc:say` was
        already given: a part must never arrive after its final line.
        """
        if self._outbox.said(message.reply_to) or not self.parts_wanted:
            reason = "after_say" if self._outbox.said(message.reply_to) else "not_offered"
            log.info("world_part_dropped", reason=reason, npc=message.npc_id, reply_to=message.reply_to)
            return
        await self._send_or_keep(message)

    async def typing(self, message: Typing) -> None:
        """Send `npc:typing`; dropped (debug log) while disconnected."""
        conn = self._conn
        if self.connected and conn is not None and await conn.send(message):
            return
        log.debug("world_typing_dropped", npc=message.npc_id, reason="disconnected")

    def voice(self, npc_ids: Collection[str]) -> None:
        """Claim these NPCs from now on: new ones at once, all after every reconnect.

        An id left out stays claimed on the open connection (the protocol cannot hand one back).
        """
        self._npc_ids = tuple(dict.fromkeys(npc_ids))
        self._voiced.set()

    async def leave(self) -> None:
        """Leave the room with consent (LEAVE_ROOM) and stop for good; `run()` then returns."""
        self._leaving.set()
        if self._running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), 2 * LEAVE_TIMEOUT_SECONDS)
        else:
            self._inbox.close()

    async def _send_or_keep(self, message: Say | SayPart) -> None:
        """Straight out when live and nothing older waits (order is kept); else into the outbox."""
        conn = self._conn
        if self.connected and conn is not None and not self._outbox and await conn.send(message):
            return
        self._outbox.keep(message)

    # ------------------------------------------------------------ one connection, top to bottom

    async def _connection(self, http: httpx.AsyncClient) -> float:
        """Join (or rejoin), serve until the socket closes, and return the delay before the next try."""
        try:
            conn = await _open_unless_leaving(self._session, http, self._leaving)
        except WorldAuthError:
            delay = self._backoff.slow_delay()
            log.error("world_auth_refused", room=self._room, retry_in_s=round(delay, 3))
            self._status(f"world refused the token, retrying in {_seconds(delay)} s")
            return delay
        except Exception as exc:
            delay = self._backoff.next_delay()
            if isinstance(exc, WorldError):
                log.warning("world_unreachable", error=str(exc), retry_in_s=round(delay, 3))
            else:  # unknown: keep the traceback, keep trying
                log.exception("world_connect_failed", retry_in_s=round(delay, 3))
            self._status(f"world unreachable, retrying in {_seconds(delay)} s")
            return delay
        if conn is None:
            return 0.0

        joined_at = self._clock()
        try:
            await self._serve(conn)
        except Exception as exc:
            # A bug, not the network: leave the seat with consent and let the caller (the daemon's
            # supervisor) restart us; the next run() joins afresh and claims again.
            self.connected = False
            log.error("world_link_crashed", room_id=conn.seat.room_id, error_type=type(exc).__name__)
            self._session.forget()
            await conn.send_leave()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(conn.ws.wait_closed(), LEAVE_TIMEOUT_SECONDS)
            raise
        finally:
            self.connected = False
            self._conn = None
            await conn.close()
        self._backoff.connection_ended(self._clock() - joined_at)
        delay = self._backoff.next_delay()
        if not self._leaving.is_set():
            self._status(f"world connection lost, reconnecting in {_seconds(delay)} s")
        return delay

    async def _serve(self, conn: Connection) -> None:
        """One joined connection: the reader and the speaker run until the socket closes or we leave."""
        self._conn = conn
        log.info("world_joined", version=conn.seat.version, room_id=conn.seat.room_id, session_id=conn.seat.session_id)
        self._status("joined world")
        reader = asyncio.create_task(self._inbox.read(conn, self._leaving), name="world-reader")
        speaker = asyncio.create_task(self._speak(conn), name="world-speaker")
        leave_watch = asyncio.create_task(self._leaving.wait(), name="world-leave-watch")
        try:
            pending = {reader, speaker, leave_watch}
            while reader in pending and leave_watch in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {leave_watch}:
                    if (error := task.exception()) is not None:
                        raise error
            if not reader.done():  # leave(): LEAVE_ROOM, then the server's close (4000)
                self.connected = False
                await conn.send_leave()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(reader), LEAVE_TIMEOUT_SECONDS)
                self._session.forget()
                log.info("world_left", code=conn.ws.close_code)
                self._status("left world")
        finally:
            for task in (reader, speaker, leave_watch):
                task.cancel()
            await asyncio.gather(reader, speaker, leave_watch, return_exceptions=True)

    async def _speak(self, conn: Connection) -> None:
        """Claim, wait for the answers, send the replies kept meanwhile, then go live.

        Kept replies wait for the answers so that the world knows who speaks, and so that kept
        parts go only to a world that offers them. Live, it claims whatever `voice()` adds.
        """
        await _claim(conn, self._npc_ids)
        if conn.claims.unanswered:
            try:
                async with asyncio.timeout(CLAIM_ANSWER_TIMEOUT_SECONDS):
                    await conn.claims.answered.wait()
            except TimeoutError:
                log.warning("world_claim_unanswered", unanswered=conn.claims.unanswered)
        self._offered = conn.claims.features  # later answers on this connection add to it
        if not self.parts_wanted and (dropped := self._outbox.drop_parts()):
            log.info("world_parts_dropped", reason="not_offered", parts=dropped)
        while (kept := self._outbox.next_fresh()) is not None:
            if not await conn.send(kept.message):
                return  # closed again: the rest waits for the next join
            self._outbox.sent(kept)
            if isinstance(kept.message, Say):
                log.info("world_say_sent_late", npc=kept.message.npc_id, reply_to=kept.message.reply_to)
        self.connected = True
        while True:
            await self._voiced.wait()
            self._voiced.clear()
            await _claim(conn, self._npc_ids)


async def _claim(conn: Connection, npc_ids: Sequence[str]) -> None:
    """`worker:claim` the NPCs not yet asked for on this connection, in frames that fit."""
    claims, too_long = claim_chunks(conn.claims.to_ask(npc_ids))
    for npc_id in too_long:
        log.error("world_claim_refused", npc=npc_id[:200], reason="id_too_long_for_a_frame")
    for claim in claims:
        conn.claims.sent(claim)
        if not await conn.send(claim):
            return
    if len(claims) > 1:
        log.info("world_claim_split", messages=len(claims), npcs=sum(len(c.npc_ids) for c in claims))


def _guarded(on_status: Callable[[str], None] | None) -> Callable[[str], None]:
    """The status callback; one that raises is logged, never allowed to break the link."""

    def status(line: str) -> None:
        if on_status is None:
            return
        try:
            on_status(line)
        except Exception:
            log.exception("world_status_callback_failed")

    return status


async def _open_unless_leaving(session: Session, http: httpx.AsyncClient, leaving: asyncio.Event) -> Connection | None:
    """`session.open`, abandoned (None) as soon as `leaving` is set, so shutdown never waits on it."""
    opener = asyncio.create_task(session.open(http), name="world-connect")
    leave_watch = asyncio.create_task(leaving.wait(), name="world-leave-watch")
    waited = False
    try:
        await asyncio.wait({opener, leave_watch}, return_when=asyncio.FIRST_COMPLETED)
        waited = True
    finally:
        leave_watch.cancel()
        opener.cancel()
        await asyncio.gather(opener, leave_watch, return_exceptions=True)
        if not waited and opener.done() and not opener.cancelled() and opener.exception() is None:
            # run() was cancelled just as the socket opened: close it rather than leak it.
            await opener.result().close()
    if opener.cancelled():
        return None
    return opener.result()


def _seconds(delay: float) -> str:
    """A delay for a human status line: whole seconds, or one decimal under ten."""
    return f"{delay:.0f}" if delay >= 10 else f"{delay:.1f}".rstrip("0").rstrip(".") or "0"
