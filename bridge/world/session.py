"""The worker's seat in the room: join or reconnect, the JOIN_ROOM handshake, the reconnection token.

`Session.open` returns a joined `Connection` (JOIN_ROOM acknowledged). It reconnects with the latest
token when it has one and falls back to a fresh `joinOrCreate` when that is refused
(world-protocol.md, "Reconnection"). A `Connection` sends ROOM_DATA frames, never one over the
server's client frame limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import httpx
import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from bridge import __version__
from bridge.errors import WorldAuthError, WorldError, WorldProtocolError, WorldUnavailable
from bridge.world import codec
from bridge.world.claims import Claims
from bridge.world.matchmaking import (
    AUTH_FAILED_CODES,
    MatchmakingRefused,
    Seat,
    join_or_create,
    reconnect_016,
    websocket_url,
)
from bridge.world.messages import Claim, Say, SayPart, Typing

__all__ = ["MAX_CLIENT_FRAME_BYTES", "Connection", "Session", "fit_say"]

log = structlog.get_logger(__name__)

MAX_WS_FRAME_BYTES = 16 * 1024 * 1024  # a large room state must never close the connection
MAX_CLIENT_FRAME_BYTES = 4000  # the server refuses client frames over 4096 bytes (close 1009)
HANDSHAKE_TIMEOUT_SECONDS = 15.0
SEND_TIMEOUT_SECONDS = 10.0
CLOSE_TIMEOUT_SECONDS = 5.0
PING_INTERVAL_SECONDS = 20.0

Outgoing = Claim | Say | SayPart | Typing


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


@dataclass(eq=False, slots=True)
class Connection:
    """One joined websocket and what this connection was granted."""

    ws: ClientConnection
    seat: Seat
    claims: Claims = field(default_factory=Claims)

    async def send(self, message: Outgoing) -> bool:
        """Send one message; False if the socket closed. A frame over the limit is refused (logged)."""
        frame = codec.encode_room_data(message.type_name, message.payload())
        if len(frame) > MAX_CLIENT_FRAME_BYTES:
            # The server would close the connection (1009) and the bridge would reconnect forever.
            npc = {} if isinstance(message, Claim) else {"npc": message.npc_id}
            log.error("world_frame_refused", type=message.type_name, frame_bytes=len(frame), **npc)
            return True  # not sendable on any connection: do not keep it for the next one
        try:
            # timeout(), not wait_for(): 3.11's wait_for wraps the send in a task, one more trip through
            # the event loop on the reply path (the frame is normally written at once, without waiting).
            async with asyncio.timeout(SEND_TIMEOUT_SECONDS):
                await self.ws.send(frame)
        except ConnectionClosed:
            return False
        except TimeoutError:
            # The frame sits in the transport buffer already; count it as sent rather than send it twice.
            log.warning("world_send_slow", timeout_s=SEND_TIMEOUT_SECONDS)
        return True

    async def send_leave(self) -> None:
        """LEAVE_ROOM: the server closes with 4000 (a consented leave)."""
        with contextlib.suppress(ConnectionClosed, TimeoutError):
            await asyncio.wait_for(self.ws.send(codec.LEAVE), SEND_TIMEOUT_SECONDS)

    async def close(self) -> None:
        await _close(self.ws)


class Session:
    """Joins the room as a worker and keeps the latest reconnection token (never logged)."""

    def __init__(self, *, url: str, room: str, token: str, handshake_timeout_seconds: float) -> None:
        self._url = url
        self._room = room
        self._token = token
        self._handshake_timeout_seconds = handshake_timeout_seconds
        self._resume: _Resume | None = None

    def __repr__(self) -> str:  # never shows the token
        return f"Session(url={self._url!r}, room={self._room!r})"

    def forget(self) -> None:
        """Drop the reconnection token (after a consented leave): the next open joins afresh."""
        self._resume = None

    async def open(self, http: httpx.AsyncClient) -> Connection:
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
            return await self._handshake(seat, websocket_url(self._url, seat))
        except _Refused as exc:
            if exc.code in AUTH_FAILED_CODES:
                raise WorldAuthError(f"the world refused the worker token (code {exc.code})") from None
            raise WorldUnavailable(str(exc)) from None

    async def _reconnect(self, http: httpx.AsyncClient, resume: _Resume) -> Connection:
        seat = resume.seat
        if seat.version == "0.16":
            seat = await reconnect_016(http, self._url, seat.room_id, resume.token)
            url = websocket_url(self._url, seat, reconnection_token=resume.token)
        else:
            url = websocket_url(self._url, seat, reconnection_token=resume.token, skip_handshake=True)
        return await self._handshake(seat, url, reconnecting=True)

    async def _handshake(self, seat: Seat, url: str, *, reconnecting: bool = False) -> Connection:
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
                join = await _await_join(ws, seat.version)
            await ws.send(codec.JOIN_ACK)
        except BaseException:
            await _close(ws)
            raise
        self._resume = _Resume(seat=seat, token=join.reconnection_token)
        return Connection(ws=ws, seat=seat)


async def _await_join(ws: ClientConnection, version: codec.ColyseusVersion) -> codec.JoinRoom:
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


def fit_say(message: Say) -> Say:
    """Cut the text so the frame stays under the server's client frame limit (it would close us)."""
    frame_bytes = len(codec.encode_room_data(message.type_name, message.payload()))
    if frame_bytes <= MAX_CLIENT_FRAME_BYTES:
        return message
    excess = frame_bytes - MAX_CLIENT_FRAME_BYTES
    # Drop whole characters from the end until the UTF-8 size fits.
    encoded = message.text.encode("utf-8")
    cut = encoded[: max(1, len(encoded) - excess)].decode("utf-8", errors="ignore") or message.text[:1]
    log.warning("world_say_truncated", npc=message.npc_id, frame_bytes=frame_bytes)
    return message.model_copy(update={"text": cut})


async def _close(ws: ClientConnection) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(), CLOSE_TIMEOUT_SECONDS)
