"""Colyseus HTTP matchmaking (0.16 and 0.18): seat reservations and the websocket URL for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import httpx

from bridge.errors import WorldAuthError, WorldProtocolError, WorldUnavailable
from bridge.world.codec import ColyseusVersion

HTTP_TIMEOUT_SECONDS = 10.0

# 0.18 answers errors with the code as HTTP status; 0.16 answers 200 with {"code", "error"}.
AUTH_FAILED_CODES = frozenset({525, 4215})


class MatchmakingRefused(WorldUnavailable):
    """The matchmaker answered with an error code (not an auth failure)."""

    def __init__(self, message: str, *, code: int | None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Seat:
    """A seat reservation: where to open the websocket and as whom."""

    version: ColyseusVersion
    room_id: str
    process_id: str
    session_id: str
    public_address: str | None = None


def http_base(url: str) -> str:
    """The world URL as http(s), without a trailing slash (ws→http, wss→https)."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    if scheme not in ("http", "https"):
        raise ValueError(f"world url must be http(s) or ws(s), not {parts.scheme!r}")
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def websocket_url(
    url: str,
    seat: Seat,
    *,
    reconnection_token: str | None = None,
    skip_handshake: bool = False,
) -> str:
    """`ws://host:port/{processId}/{roomId}?sessionId=…` (wss for https), plus reconnection parameters."""
    parts = urlsplit(http_base(url))
    scheme = "wss" if parts.scheme == "https" else "ws"
    netloc, path = parts.netloc, parts.path
    if seat.public_address:
        # A public address replaces host and port (and may carry a path prefix), as in the official SDK.
        public = urlsplit(f"//{seat.public_address}")
        netloc, path = public.netloc, public.path.rstrip("/")
    query: dict[str, str] = {"sessionId": seat.session_id}
    if reconnection_token is not None:
        query["reconnectionToken"] = reconnection_token
    if skip_handshake:
        query["skipHandshake"] = "1"
    return urlunsplit((scheme, netloc, f"{path}/{seat.process_id}/{seat.room_id}", urlencode(query), ""))


def parse_seat(status_code: int, body: Any) -> Seat:
    """Turn a matchmaking answer into a `Seat`, telling 0.16 and 0.18 apart; raise on error answers."""
    if not isinstance(body, dict):
        raise WorldProtocolError(f"matchmaking answered HTTP {status_code} without a JSON object")
    code = body.get("code")
    if "error" in body or status_code != 200:
        error_code = code if isinstance(code, int) else status_code
        if error_code in AUTH_FAILED_CODES:
            # The server's message is "onAuth failed"; nothing of ours (no token) goes into it.
            raise WorldAuthError(f"the world refused the worker token (code {error_code})")
        raise MatchmakingRefused(
            f"matchmaking refused: code {error_code}: {str(body.get('error', ''))[:200]}", code=error_code
        )
    room = body.get("room")
    session_id = body.get("sessionId")
    if isinstance(room, dict):  # 0.16: {"room": {...}, "sessionId"}
        version: ColyseusVersion = "0.16"
        source = room
    elif "roomId" in body:  # 0.18: {"name", "sessionId", "roomId", "processId", ...}
        version = "0.18"
        source = body
    else:
        raise WorldProtocolError("matchmaking answer has neither room nor roomId")
    room_id, process_id = source.get("roomId"), source.get("processId")
    if not all(isinstance(value, str) and value for value in (room_id, process_id, session_id)):
        raise WorldProtocolError("matchmaking answer lacks roomId, processId or sessionId")
    public_address = source.get("publicAddress")
    return Seat(
        version=version,
        room_id=str(room_id),
        process_id=str(process_id),
        session_id=str(session_id),
        public_address=public_address if isinstance(public_address, str) and public_address else None,
    )


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Seat:
    try:
        response = await client.post(url, json=body, timeout=HTTP_TIMEOUT_SECONDS)
    except httpx.HTTPError as exc:
        raise WorldUnavailable(f"matchmaking failed: {type(exc).__name__}") from exc
    try:
        answer = response.json()
    except ValueError:
        if response.status_code >= 500 and response.status_code not in AUTH_FAILED_CODES:
            raise WorldUnavailable(f"matchmaking answered HTTP {response.status_code}") from None
        answer = None
    return parse_seat(response.status_code, answer)


async def join_or_create(client: httpx.AsyncClient, url: str, room: str, options: dict[str, Any]) -> Seat:
    """`POST /matchmake/joinOrCreate/{room}` with the join options."""
    return await _post(client, f"{http_base(url)}/matchmake/joinOrCreate/{room}", options)


async def reconnect_016(client: httpx.AsyncClient, url: str, room_id: str, reconnection_token: str) -> Seat:
    """0.16 only: `POST /matchmake/reconnect/{roomId}` before reopening the websocket."""
    return await _post(
        client,
        f"{http_base(url)}/matchmake/reconnect/{room_id}",
        {"reconnectionToken": reconnection_token},
    )
