"""What a server frame means to the bridge: a typed message, or the reason it is ignored (pure).

`read_frame` takes the bytes of one server frame (after the join) and returns what the world link acts
on; it keeps no state and logs nothing. Whether an NPC is granted is the link's business (it changes
per connection); everything that can be said from the frame alone is decided here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pydantic import ValidationError

from bridge.errors import WorldProtocolError
from bridge.world import codec
from bridge.world.messages import INCOMING_TYPES, Claimed, NpcEvent, PlayerLeft, Talk

__all__ = [
    "MAX_ROOM_DATA_BYTES",
    "MAX_TALK_CHARS",
    "Ignored",
    "Notice",
    "Read",
    "WorldInput",
    "cut_talk",
    "read_frame",
    "read_room_data",
]

MAX_ROOM_DATA_BYTES = 64 * 1024  # a ROOM_DATA message over this is ignored
MAX_TALK_CHARS = 200

WorldInput = Talk | NpcEvent | PlayerLeft


@dataclass(frozen=True, slots=True)
class Ignored:
    """A message or frame the bridge ignores: logged (rate-limited) with the reason, never its values."""

    reason: str
    type: str | int | None = None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Notice:
    """Not a message, but worth one log line (a server ERROR frame, a large state frame skipped)."""

    event: str
    level: Literal["info", "warning"]
    fields: dict[str, Any] = field(default_factory=dict)


Read = WorldInput | Claimed | Ignored | Notice | None  # None: a frame skipped silently (state, pings)


def read_frame(data: bytes, version: codec.ColyseusVersion) -> Read:
    """One server frame of a joined connection, decoded and validated."""
    try:
        frame = codec.decode_frame(data, version)
    except WorldProtocolError as exc:
        return Ignored("bad_frame", None, {"detail": str(exc), "frame_bytes": len(data)})
    if isinstance(frame, codec.RoomData):
        return read_room_data(frame.type, frame.payload, frame_bytes=frame.frame_bytes)
    if isinstance(frame, codec.ErrorFrame):
        return Notice("world_error", "warning", {"code": frame.code, "message": frame.message[:200]})
    if isinstance(frame, codec.JoinRoom):
        return Ignored("unexpected_join")
    if not frame.known:
        return Ignored("unknown_frame", None, {"code": frame.code})
    if len(data) > MAX_ROOM_DATA_BYTES:
        # Skipped unread like every state frame; said once per big frame so a size problem is visible.
        return Notice("world_large_frame_skipped", "info", {"code": frame.code, "frame_bytes": len(data)})
    return None


def read_room_data(message_type: str | int, payload: bytes, *, frame_bytes: int) -> WorldInput | Claimed | Ignored:
    """A ROOM_DATA message: its type must be one the protocol sends to the bridge, its payload valid."""
    if frame_bytes > MAX_ROOM_DATA_BYTES:
        return Ignored("too_large", message_type, {"frame_bytes": frame_bytes})
    if not isinstance(message_type, str) or message_type not in INCOMING_TYPES:
        return Ignored("unknown_type", message_type)
    try:
        message = INCOMING_TYPES[message_type].model_validate(codec.decode_payload(payload))
    except WorldProtocolError as exc:
        return Ignored("not_msgpack", message_type, {"detail": str(exc)})
    except ValidationError as exc:
        # Field paths and error kinds only: the values may be player text.
        problems = [_problem(err["loc"], err["type"]) for err in exc.errors()]
        return Ignored("invalid", message_type, {"problems": problems[:5]})
    return cast(WorldInput | Claimed, message)  # INCOMING_TYPES holds only these


def cut_talk(talk: Talk) -> tuple[Talk, int | None]:
    """A talk cut to `MAX_TALK_CHARS` (it is still answered), and its original length if it was cut."""
    if len(talk.text) <= MAX_TALK_CHARS:
        return talk, None
    return talk.model_copy(update={"text": talk.text[:MAX_TALK_CHARS]}), len(talk.text)


def _problem(loc: tuple[int | str, ...], kind: str) -> str:
    """A validation problem as `field:kind` (never the offending value)."""
    return f"{'.'.join(str(part) for part in loc) or '<root>'}:{kind}"
