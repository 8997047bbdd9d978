"""The world link: one Colyseus worker connection that joins, claims NPCs, listens, speaks and reconnects.

The rest of the daemon sees only `WorldLink`: validated events in (`events()`), `say` / `typing` out.
Frames and msgpack stay in `codec`; HTTP matchmaking in `matchmaking`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import structlog
from pydantic import ValidationError
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from bridge import __version__
from bridge.errors import WorldAuthError, WorldError, WorldProtocolError, WorldUnavailable
from bridge.logs import Throttle
from bridge.world import codec
from bridge.world.backoff import Backoff
from bridge.world.matchmaking import (
    AUTH_FAILED_CODES,
    HTTP_TIMEOUT_SECONDS,
    MatchmakingRefused,
    Seat,
    join_or_create,
    reconnect_016,
    websocket_url,
)
from bridge.world.messages import (
    INCOMING_TYPES,
    Claim,
    Claimed,
    NpcEvent,
    PlayerLeft,
    Say,
    Talk,
    Typing,
)

__all__ = ["WorldInput", "WorldLink"]

log = structlog.get_logger(__name__)

WorldInput = Talk | NpcEvent | PlayerLeft

MAX_ROOM_DATA_BYTES = 64 * 1024  # a ROOM_DATA message over this is ignored
MAX_WS_FRAME_BYTES = 16 * 1024 * 1024  # a large room state must never close the connection
MAX_CLIENT_FRAME_BYTES = 4000  # the server refuses client frames over 4096 bytes (close 1009)
MAX_TALK_CHARS = 200
EVENT_QUEUE_SIZE = 1000
# Log lines per kind of ignored message per window; past that, a count comes with the next line.
IGNORED_LOG_BURST = 10
IGNORED_LOG_WINDOW_SECONDS = 60.0
SAY_BUFFER_SIZE = 100
SAY_MAX_AGE_SECONDS = 60.0
HANDSHAKE_TIMEOUT_SECONDS = 15.0
SEND_TIMEOUT_SECONDS = 10.0
LEAVE_TIMEOUT_SECONDS = 5.0
CLOSE_TIMEOUT_SECONDS = 5.0
PING_INTERVAL_SECONDS = 20.0

CONSENTED_CLOSE_CODE = 4000
ABNORMAL_CLOSE_CODE = 1006  # no close frame (the server vanished)


class _Refused(WorldError):
    """The server refused a join or reconnection (ERROR frame, close before JOIN_ROOM, HTTP status)."""

    def __init__(self, message: str, *, code: int | None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class _Resume:
    """What a reconnection needs: the seat we held and the latest reconnection token."""

    seat: Seat
    token: str


@dataclass(slots=True)
class _Buffered:
    message: Say
    since: float


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
    ) -> None:
        self._url = url
        self._room = room
        self._token = token
        self._npc_ids = tuple(dict.fromkeys(npc_ids))
        # What the world sends is the world's choice: a flood of bad frames is logged, not journaled whole.
        self._throttle = Throttle(burst=IGNORED_LOG_BURST, window_seconds=IGNORED_LOG_WINDOW_SECONDS, clock=clock)
        self._on_status = on_status
        self._backoff = backoff or Backoff()
        self._clock = clock
        self._say_max_age_seconds = say_max_age_seconds
        self._handshake_timeout_seconds = handshake_timeout_seconds

        self.granted: frozenset[str] = frozenset()
        self.connected = False
        self.version: codec.ColyseusVersion | None = None

        self._queue: asyncio.Queue[WorldInput | None] = asyncio.Queue(maxsize=event_queue_size)
        self._says: deque[_Buffered] = deque()
        self._say_buffer_size = say_buffer_size
        self._ws: ClientConnection | None = None
        self._resume: _Resume | None = None
        self._leave_requested = asyncio.Event()
        self._done = asyncio.Event()
        self._running = False
        self._closed = False

    # ------------------------------------------------------------ public interface

    def __repr__(self) -> str:  # never shows the token
        return f"WorldLink(url={self._url!r}, room={self._room!r}, connected={self.connected})"

    async def run(self) -> None:
        """Connect, read and reconnect until `leave()`. Cancelling it closes the socket (not consented)."""
        if self._running or self._closed:
            raise RuntimeError("WorldLink.run() runs once")
        self._running = True
        try:
            async with httpx.AsyncClient(
                timeout=HTTP_TIMEOUT_SECONDS, headers={"user-agent": f"npc-bridge/{__version__}"}
            ) as http:
                while not self._leave_requested.is_set():
                    delay = await self._one_connection(http)
                    if self._leave_requested.is_set():
                        break
                    log.info("world_reconnecting", delay_s=round(delay, 3), attempt=self._backoff.attempt)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._leave_requested.wait(), delay)
        finally:
            self.connected = False
            self._ws = None
            self._running = False
            self._close_events()
            self._done.set()

    async def events(self) -> AsyncIterator[WorldInput]:
        """Validated world events for granted NPCs, in arrival order; ends when the link has stopped."""
        while True:
            item = await self._queue.get()
            if item is None:
                self._queue.put_nowait(None)  # let any other reader end too
                return
            yield item

    async def say(self, message: Say) -> None:
        """Send `npc:say`; while disconnected, keep it (bounded) and send it after the next join."""
        message = self._fit_say(message)
        if self.connected and await self._send(message.type_name, message.payload()):
            return
        self._buffer_say(message)

    async def typing(self, message: Typing) -> None:
        """Send `npc:typing`; dropped (debug log) while disconnected."""
        if self.connected and await self._send(message.type_name, message.payload()):
            return
        log.debug("world_typing_dropped", npc=message.npc_id, reason="disconnected")

    async def leave(self) -> None:
        """Leave the room with consent (LEAVE_ROOM) and stop; `run()` then returns."""
        self._leave_requested.set()
        if self._running:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), LEAVE_TIMEOUT_SECONDS + CLOSE_TIMEOUT_SECONDS)
        else:
            self._close_events()

    # ------------------------------------------------------------ one connection

    async def _one_connection(self, http: httpx.AsyncClient) -> float:
        """Join (or rejoin), serve until the socket closes, and return the delay before the next try."""
        try:
            opened = await self._open_unless_leaving(http)
        except WorldAuthError:
            delay = self._backoff.slow_delay()
            log.error("world_auth_refused", room=self._room, retry_in_s=round(delay, 3))
            self._status(f"world refused the token, retrying in {_seconds(delay)} s")
            return delay
        except WorldError as exc:
            delay = self._backoff.next_delay()
            log.warning("world_unreachable", error=str(exc), retry_in_s=round(delay, 3))
            self._status(f"world unreachable, retrying in {_seconds(delay)} s")
            return delay
        except Exception:  # unknown: keep the traceback, keep the daemon alive
            delay = self._backoff.next_delay()
            log.exception("world_connect_failed", retry_in_s=round(delay, 3))
            self._status(f"world unreachable, retrying in {_seconds(delay)} s")
            return delay
        if opened is None:
            return 0.0
        ws, seat = opened

        joined_at = self._clock()
        try:
            await self._serve(ws, seat)
        except Exception:
            log.exception("world_connection_failed")
        finally:
            self.connected = False
            self._ws = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), CLOSE_TIMEOUT_SECONDS)
        self._backoff.connection_ended(self._clock() - joined_at)
        delay = self._backoff.next_delay()
        if not self._leave_requested.is_set():
            self._status(f"world connection lost, reconnecting in {_seconds(delay)} s")
        return delay

    async def _open_unless_leaving(self, http: httpx.AsyncClient) -> tuple[ClientConnection, Seat] | None:
        """`_open`, abandoned (None) as soon as `leave()` is called, so shutdown never waits on it."""
        opener = asyncio.create_task(self._open(http), name="world-connect")
        leave_watch = asyncio.create_task(self._leave_requested.wait(), name="world-leave-watch")
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
                ws, _ = opener.result()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ws.close(), CLOSE_TIMEOUT_SECONDS)
        if opener.cancelled():
            return None
        return opener.result()

    async def _open(self, http: httpx.AsyncClient) -> tuple[ClientConnection, Seat]:
        """Reconnect with the token if we have one, else (or if refused) joinOrCreate; JOIN_ROOM acked."""
        if self._resume is not None:
            resume = self._resume
            try:
                return await self._reconnect(http, resume)
            except (_Refused, MatchmakingRefused, WorldProtocolError) as exc:
                log.info("world_reconnect_refused", code=getattr(exc, "code", None), error=str(exc))
                self._resume = None
        options = {"worker": True, "token": self._token, "client": f"npc-bridge/{__version__}"}
        seat = await join_or_create(http, self._url, self._room, options)
        try:
            return await self._handshake(seat, websocket_url(self._url, seat)), seat
        except _Refused as exc:
            if exc.code in AUTH_FAILED_CODES:
                raise WorldAuthError(f"the world refused the worker token (code {exc.code})") from None
            raise WorldUnavailable(str(exc)) from None

    async def _reconnect(self, http: httpx.AsyncClient, resume: _Resume) -> tuple[ClientConnection, Seat]:
        seat = resume.seat
        if seat.version == "0.16":
            seat = await reconnect_016(http, self._url, seat.room_id, resume.token)
            url = websocket_url(self._url, seat, reconnection_token=resume.token)
        else:
            url = websocket_url(self._url, seat, reconnection_token=resume.token, skip_handshake=True)
        return await self._handshake(seat, url, reconnecting=True), seat

    async def _handshake(self, seat: Seat, url: str, *, reconnecting: bool = False) -> ClientConnection:
        """Open the websocket and wait for JOIN_ROOM; answer it with the one-byte ack."""
        try:
            ws = await connect(
                url,
                max_size=MAX_WS_FRAME_BYTES,
                open_timeout=self._handshake_timeout_seconds,
                close_timeout=CLOSE_TIMEOUT_SECONDS,
                ping_interval=PING_INTERVAL_SECONDS,
                ping_timeout=PING_INTERVAL_SECONDS,
                compression=None,
                user_agent_header=f"npc-bridge/{__version__}",
            )
        except InvalidStatus as exc:
            if reconnecting:
                raise _Refused(f"websocket refused: HTTP {exc.response.status_code}", code=None) from None
            raise WorldUnavailable(f"websocket refused: HTTP {exc.response.status_code}") from None
        except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as exc:
            raise WorldUnavailable(f"websocket failed: {type(exc).__name__}") from None
        try:
            async with asyncio.timeout(self._handshake_timeout_seconds):
                join = await self._await_join(ws, seat.version)
            await ws.send(codec.JOIN_ACK)
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), CLOSE_TIMEOUT_SECONDS)
            raise
        self.version = seat.version
        self._resume = _Resume(seat=seat, token=join.reconnection_token)
        return ws

    async def _await_join(self, ws: ClientConnection, version: codec.ColyseusVersion) -> codec.JoinRoom:
        error: codec.ErrorFrame | None = None
        while True:
            try:
                data = await ws.recv()
            except ConnectionClosed as exc:
                code = error.code if error is not None else (exc.rcvd.code if exc.rcvd else None)
                detail = error.message if error is not None else (exc.rcvd.reason if exc.rcvd else "")
                raise _Refused(f"join refused: code {code} {detail[:200]}".strip(), code=code) from None
            if isinstance(data, str):
                continue
            frame = codec.decode_frame(data, version)
            if isinstance(frame, codec.JoinRoom):
                return frame
            if isinstance(frame, codec.ErrorFrame):
                error = frame  # the close follows; decide on both

    async def _serve(self, ws: ClientConnection, seat: Seat) -> None:
        """One joined connection: claim, flush kept replies, read until closed or leaving."""
        self._ws = ws
        await self._send_on(ws, Claim(npc_ids=list(self._npc_ids)))
        log.info("world_joined", version=seat.version, room_id=seat.room_id, session_id=seat.session_id)
        self._status("joined world")
        await self._flush_says(ws)
        self.connected = True

        reader = asyncio.create_task(self._read(ws, seat.version), name="world-reader")
        leave_watch = asyncio.create_task(self._leave_requested.wait(), name="world-leave-watch")
        try:
            await asyncio.wait({reader, leave_watch}, return_when=asyncio.FIRST_COMPLETED)
            if leave_watch.done() and not reader.done():
                self.connected = False
                await self._leave(ws, reader)
            elif reader.done() and not reader.cancelled():
                error = reader.exception()
                if error is not None:
                    raise error
        finally:
            for task in (reader, leave_watch):
                task.cancel()
            await asyncio.gather(reader, leave_watch, return_exceptions=True)

    async def _leave(self, ws: ClientConnection, reader: asyncio.Task[None]) -> None:
        """Consented leave: LEAVE_ROOM, then wait for the server's close (4000)."""
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            await asyncio.wait_for(ws.send(codec.LEAVE), SEND_TIMEOUT_SECONDS)
            await asyncio.wait_for(asyncio.shield(reader), LEAVE_TIMEOUT_SECONDS)
        self._resume = None
        log.info("world_left", code=ws.close_code)
        self._status("left world")

    async def _read(self, ws: ClientConnection, version: codec.ColyseusVersion) -> None:
        while True:
            try:
                data = await ws.recv()
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd else ABNORMAL_CLOSE_CODE
                reason = exc.rcvd.reason if exc.rcvd else ""
                if code == CONSENTED_CLOSE_CODE and self._leave_requested.is_set():
                    log.info("world_disconnected", code=code, reason=reason[:200])
                else:
                    log.warning("world_disconnected", code=code, reason=reason[:200])
                return
            if isinstance(data, bytes):
                self._on_frame(data, version)

    # ------------------------------------------------------------ incoming

    def _on_frame(self, data: bytes, version: codec.ColyseusVersion) -> None:
        try:
            frame = codec.decode_frame(data, version)
        except WorldProtocolError as exc:
            self._ignored("bad_frame", None, detail=str(exc), frame_bytes=len(data))
            return
        if isinstance(frame, codec.RoomData):
            self._on_room_data(frame)
        elif isinstance(frame, codec.ErrorFrame):
            log.warning("world_error", code=frame.code, message=frame.message[:200])
        elif isinstance(frame, codec.JoinRoom):
            self._ignored("unexpected_join", None)
        elif not frame.known:
            self._ignored("unknown_frame", None, code=frame.code)
        elif len(data) > MAX_ROOM_DATA_BYTES:
            # Skipped unread like every state frame; said once per big frame so a size problem is visible.
            log.info("world_large_frame_skipped", code=frame.code, frame_bytes=len(data))

    def _on_room_data(self, frame: codec.RoomData) -> None:
        message_type = frame.type
        if frame.frame_bytes > MAX_ROOM_DATA_BYTES:
            self._ignored("too_large", message_type, frame_bytes=frame.frame_bytes)
            return
        if not isinstance(message_type, str) or message_type not in INCOMING_TYPES:
            self._ignored("unknown_type", message_type)
            return
        try:
            payload = codec.decode_payload(frame.payload)
            message = INCOMING_TYPES[message_type].model_validate(payload)
        except WorldProtocolError as exc:
            self._ignored("not_msgpack", message_type, detail=str(exc))
            return
        except ValidationError as exc:
            # Field paths and error kinds only: the values may be player text.
            problems = [_problem(err["loc"], err["type"]) for err in exc.errors()]
            self._ignored("invalid", message_type, problems=problems[:5])
            return

        if isinstance(message, Claimed):
            self._on_claimed(message)
        elif isinstance(message, Talk | NpcEvent):
            if message.npc_id not in self.granted:
                self._ignored("npc_not_granted", message_type, npc=message.npc_id)
                return
            if isinstance(message, Talk) and len(message.text) > MAX_TALK_CHARS:
                log.info("world_talk_truncated", npc=message.npc_id, chars=len(message.text))
                message = message.model_copy(update={"text": message.text[:MAX_TALK_CHARS]})
            self._deliver(message)
        elif isinstance(message, PlayerLeft):
            self._deliver(message)

    def _on_claimed(self, claimed: Claimed) -> None:
        wanted = set(self._npc_ids)
        granted = frozenset(npc for npc in claimed.npc_ids if npc in wanted)
        unasked = sorted(set(claimed.npc_ids) - wanted)
        self.granted = granted
        log.info(
            "world_claimed",
            granted=sorted(granted),
            denied=[{"npc_id": d.npc_id, "reason": d.reason[:200]} for d in claimed.denied],
            **({"unasked": unasked} if unasked else {}),
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

    # ------------------------------------------------------------ outgoing

    async def _send(self, message_type: str, payload: dict[str, Any]) -> bool:
        """Send one ROOM_DATA on the current socket; False if there is none or it closed."""
        ws = self._ws
        if ws is None:
            return False
        return await self._send_frame(ws, codec.encode_room_data(message_type, payload))

    async def _send_on(self, ws: ClientConnection, message: Claim | Say | Typing) -> bool:
        return await self._send_frame(ws, codec.encode_room_data(message.type_name, message.payload()))

    async def _send_frame(self, ws: ClientConnection, frame: bytes) -> bool:
        try:
            # timeout(), not wait_for(): 3.11's wait_for wraps the send in a task, one more trip through
            # the event loop on the reply path (the frame is normally written at once, without waiting).
            async with asyncio.timeout(SEND_TIMEOUT_SECONDS):
                await ws.send(frame)
        except ConnectionClosed:
            return False
        except TimeoutError:
            # The frame sits in the transport buffer already; count it as sent rather than send it twice.
            log.warning("world_send_slow", timeout_s=SEND_TIMEOUT_SECONDS)
        return True

    def _fit_say(self, message: Say) -> Say:
        """Cut the text so the frame stays under the server's client frame limit (it would close us)."""
        frame_bytes = len(codec.encode_room_data(message.type_name, message.payload()))
        if frame_bytes <= MAX_CLIENT_FRAME_BYTES:
            return message
        text = message.text
        excess = frame_bytes - MAX_CLIENT_FRAME_BYTES
        # Drop whole characters from the end until the UTF-8 size fits.
        encoded = text.encode("utf-8")
        cut = encoded[: max(1, len(encoded) - excess)].decode("utf-8", errors="ignore") or text[:1]
        log.warning("world_say_truncated", npc=message.npc_id, frame_bytes=frame_bytes)
        return message.model_copy(update={"text": cut})

    def _buffer_say(self, message: Say) -> None:
        if len(self._says) >= self._say_buffer_size:
            oldest = self._says.popleft()
            log.warning(
                "world_say_dropped",
                reason="buffer_full",
                npc=oldest.message.npc_id,
                reply_to=oldest.message.reply_to,
            )
        self._says.append(_Buffered(message=message, since=self._clock()))
        log.info("world_say_kept", npc=message.npc_id, reply_to=message.reply_to, kept=len(self._says))

    async def _flush_says(self, ws: ClientConnection) -> None:
        """Send the replies kept while disconnected, oldest first; drop the stale ones."""
        while self._says:
            kept = self._says[0]
            age = self._clock() - kept.since
            if age > self._say_max_age_seconds:
                self._says.popleft()
                log.warning(
                    "world_say_dropped",
                    reason="stale",
                    npc=kept.message.npc_id,
                    reply_to=kept.message.reply_to,
                    age_s=round(age, 3),
                )
                continue
            if not await self._send_on(ws, kept.message):
                return  # closed again: keep the rest for the next join
            self._says.popleft()
            log.info("world_say_sent_late", npc=kept.message.npc_id, reply_to=kept.message.reply_to)

    # ------------------------------------------------------------ helpers

    def _status(self, line: str) -> None:
        if self._on_status is None:
            return
        try:
            self._on_status(line)
        except Exception:
            log.exception("world_status_callback_failed")

    def _close_events(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._queue.full():
            self._queue.get_nowait()
            log.warning("world_event_dropped", reason="queue_full_at_close")
        self._queue.put_nowait(None)


def _seconds(delay: float) -> str:
    """A delay for a human status line: whole seconds, or one decimal under ten."""
    return f"{delay:.0f}" if delay >= 10 else f"{delay:.1f}".rstrip("0").rstrip(".") or "0"


def _problem(loc: tuple[int | str, ...], kind: str) -> str:
    """A validation problem as `field:kind` (never the offending value)."""
    return f"{'.'.join(str(part) for part in loc) or '<root>'}:{kind}"
