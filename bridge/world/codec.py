"""Colyseus frames as bytes, both ways: pure functions, no I/O (world-protocol.md, "Colyseus transport").

Frame headers (the ROOM_DATA type, the ERROR code and message) use Colyseus' schema encoding: it looks
like msgpack, but multi-byte lengths and integers are little-endian. The tiny encoder/decoder for them
lives here; `msgpack` is used for message payloads only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

from bridge.errors import WorldProtocolError

ColyseusVersion = Literal["0.16", "0.18"]

JOIN_ROOM = 10
ERROR = 11
LEAVE_ROOM = 12
ROOM_DATA = 13
ROOM_STATE = 14
ROOM_STATE_PATCH = 15
ROOM_DATA_SCHEMA = 16
ROOM_DATA_BYTES = 17
PING = 18

# 0.18 keeps the protocol code in the low 5 bits of byte 0; the high bits are modifiers.
PROTOCOL_CODE_MASK_018 = 0x1F

# Frames the bridge reads past without looking inside (state, raw bytes, pings).
IGNORED_CODES = frozenset({ROOM_STATE, ROOM_STATE_PATCH, ROOM_DATA_SCHEMA, ROOM_DATA_BYTES, PING})

JOIN_ACK = bytes([JOIN_ROOM])
LEAVE = bytes([LEAVE_ROOM])

# Integers outside this range become a uint64/int64 in msgpack, which the JS server decodes as a
# BigInt (a careless room crashes on it): they are sent as floats instead.
_JS_SAFE_INT_MIN = -(2**31)
_JS_SAFE_INT_MAX = 2**32 - 1


# ---------------------------------------------------------------- frames


@dataclass(frozen=True, slots=True)
class JoinRoom:
    """JOIN_ROOM: the server accepted us; answer with `JOIN_ACK`."""

    reconnection_token: str
    serializer_id: str


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    """ERROR: an error code and a message from the server."""

    code: int
    message: str


@dataclass(frozen=True, slots=True)
class RoomData:
    """ROOM_DATA: a message type (string, or a number for numeric types) and its raw msgpack payload."""

    type: str | int
    payload: bytes
    frame_bytes: int


@dataclass(frozen=True, slots=True)
class Ignored:
    """A frame the bridge skips unread: state, state patches, raw bytes, pings, unknown codes."""

    code: int
    known: bool


Frame = JoinRoom | ErrorFrame | RoomData | Ignored


# ---------------------------------------------------------------- schema-encoded header values


def encode_string(value: str) -> bytes:
    """A string as Colyseus encodes it in frame headers (msgpack-like, little-endian lengths)."""
    data = value.encode("utf-8")
    length = len(data)
    if length < 0x20:
        head = bytes([0xA0 | length])
    elif length < 0x100:
        head = bytes([0xD9, length])
    elif length < 0x10000:
        head = b"\xda" + struct.pack("<H", length)
    elif length < 0x1_0000_0000:
        head = b"\xdb" + struct.pack("<I", length)
    else:
        raise ValueError("string too long for a frame header")
    return head + data


def encode_number(value: int | float) -> bytes:
    """A number as Colyseus encodes it in frame headers (msgpack-like, little-endian)."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            value = int(value)
        else:
            return b"\xcb" + struct.pack("<d", value)
    if value >= 0:
        if value < 0x80:
            return bytes([value])
        if value < 0x100:
            return bytes([0xCC, value])
        if value < 0x10000:
            return b"\xcd" + struct.pack("<H", value)
        if value < 0x1_0000_0000:
            return b"\xce" + struct.pack("<I", value)
        return b"\xcb" + struct.pack("<d", float(value))
    if value >= -0x20:
        return bytes([0xE0 | (value + 0x20)])
    if value >= -0x80:
        return b"\xd0" + struct.pack("<b", value)
    if value >= -0x8000:
        return b"\xd1" + struct.pack("<h", value)
    if value >= -0x8000_0000:
        return b"\xd2" + struct.pack("<i", value)
    return b"\xcb" + struct.pack("<d", float(value))


def _take(data: bytes, offset: int, size: int) -> tuple[bytes, int]:
    end = offset + size
    if size < 0 or end > len(data):
        raise WorldProtocolError("frame ends inside a header value")
    return data[offset:end], end


def is_string_at(data: bytes, offset: int) -> bool:
    """Whether a schema-encoded string starts at `offset` (Colyseus' own check)."""
    if offset >= len(data):
        return False
    prefix = data[offset]
    return (0xA0 <= prefix < 0xC0) or prefix in (0xD9, 0xDA, 0xDB)


def decode_string(data: bytes, offset: int) -> tuple[str, int]:
    """Read a schema-encoded string at `offset`; return it and the offset after it."""
    if offset >= len(data):
        raise WorldProtocolError("frame ends before a string")
    prefix = data[offset]
    offset += 1
    if 0xA0 <= prefix < 0xC0:
        length = prefix & 0x1F
    elif prefix == 0xD9:
        raw, offset = _take(data, offset, 1)
        length = raw[0]
    elif prefix == 0xDA:
        raw, offset = _take(data, offset, 2)
        length = struct.unpack("<H", raw)[0]
    elif prefix == 0xDB:
        raw, offset = _take(data, offset, 4)
        length = struct.unpack("<I", raw)[0]
    else:
        raise WorldProtocolError(f"not a string (prefix 0x{prefix:02x})")
    raw, offset = _take(data, offset, length)
    try:
        return raw.decode("utf-8"), offset
    except UnicodeDecodeError as exc:
        raise WorldProtocolError("string is not UTF-8") from exc


_NUMBER_FORMATS: dict[int, str] = {
    0xCA: "<f",
    0xCB: "<d",
    0xCC: "<B",
    0xCD: "<H",
    0xCE: "<I",
    0xCF: "<Q",
    0xD0: "<b",
    0xD1: "<h",
    0xD2: "<i",
    0xD3: "<q",
}


def decode_number(data: bytes, offset: int) -> tuple[int | float, int]:
    """Read a schema-encoded number at `offset`; return it and the offset after it."""
    if offset >= len(data):
        raise WorldProtocolError("frame ends before a number")
    prefix = data[offset]
    offset += 1
    if prefix < 0x80:
        return prefix, offset
    if prefix >= 0xE0:
        return prefix - 0x100, offset
    fmt = _NUMBER_FORMATS.get(prefix)
    if fmt is None:
        raise WorldProtocolError(f"not a number (prefix 0x{prefix:02x})")
    raw, offset = _take(data, offset, struct.calcsize(fmt))
    value: int | float = struct.unpack(fmt, raw)[0]
    return value, offset


# ---------------------------------------------------------------- decoding frames


def protocol_code(data: bytes, version: ColyseusVersion) -> int:
    """The protocol code of a frame (0.18 strips its modifier bits)."""
    if not data:
        raise WorldProtocolError("empty frame")
    return data[0] & PROTOCOL_CODE_MASK_018 if version == "0.18" else data[0]


def decode_frame(data: bytes, version: ColyseusVersion) -> Frame:
    """Decode the header of one server frame. ROOM_DATA payloads stay raw (see `decode_payload`)."""
    code = protocol_code(data, version)
    if code == JOIN_ROOM:
        return _decode_join_room(data)
    if code == ERROR:
        error_code, offset = decode_number(data, 1)
        message, _ = decode_string(data, offset) if offset < len(data) else ("", offset)
        return ErrorFrame(code=int(error_code), message=message)
    if code == ROOM_DATA:
        message_type: str | int
        if is_string_at(data, 1):
            message_type, offset = decode_string(data, 1)
        else:
            number, offset = decode_number(data, 1)
            message_type = int(number)
        return RoomData(type=message_type, payload=data[offset:], frame_bytes=len(data))
    return Ignored(code=code, known=code in IGNORED_CODES or code == LEAVE_ROOM)


def _decode_join_room(data: bytes) -> JoinRoom:
    # Both versions: u8 length + reconnection token, u8 length + serializer id. The state description
    # after it (0.18: varint length first, then tagged sections; 0.16: the rest) is not needed.
    offset = 1
    raw, offset = _take(data, offset, 1)
    token_raw, offset = _take(data, offset, raw[0])
    raw, offset = _take(data, offset, 1)
    serializer_raw, offset = _take(data, offset, raw[0])
    try:
        return JoinRoom(reconnection_token=token_raw.decode("utf-8"), serializer_id=serializer_raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise WorldProtocolError("JOIN_ROOM token is not UTF-8") from exc


def _ext_hook(code: int, data: bytes) -> Any:
    # msgpackr writes `undefined` as ext type 0; anything else unknown is kept opaque.
    if code == 0:
        return None
    return msgpack.ExtType(code, data)


def decode_payload(payload: bytes) -> Any:
    """Decode a ROOM_DATA payload (standard msgpack). An empty payload is `None` (a message without one)."""
    if not payload:
        return None
    try:
        return msgpack.unpackb(payload, raw=False, ext_hook=_ext_hook, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WorldProtocolError(f"payload is not msgpack: {type(exc).__name__}") from exc


# ---------------------------------------------------------------- encoding client frames


def js_safe(value: Any) -> Any:
    """`value` with every integer a JS server would read as a BigInt turned into a float."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if _JS_SAFE_INT_MIN <= value <= _JS_SAFE_INT_MAX else float(value)
    if isinstance(value, dict):
        return {key: js_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [js_safe(item) for item in value]
    return value


def encode_room_data(message_type: str, payload: Any) -> bytes:
    """A ROOM_DATA frame from the bridge: the type as a header string, then the msgpack payload."""
    body = b"" if payload is None else msgpack.packb(js_safe(payload), use_bin_type=True)
    return bytes([ROOM_DATA]) + encode_string(message_type) + body


def encode_join_room_016(reconnection_token: str, serializer_id: str, state: bytes = b"") -> bytes:
    """A 0.16 JOIN_ROOM frame as the server writes it (for tests and fakes)."""
    return _join_head(reconnection_token, serializer_id) + state


def encode_join_room_018(
    reconnection_token: str, serializer_id: str, state: bytes = b"", sections: bytes = b""
) -> bytes:
    """A 0.18 JOIN_ROOM frame as the server writes it (for tests and fakes)."""
    return _join_head(reconnection_token, serializer_id) + encode_number(len(state)) + state + sections


def _join_head(reconnection_token: str, serializer_id: str) -> bytes:
    token = reconnection_token.encode("utf-8")
    serializer = serializer_id.encode("utf-8")
    if len(token) > 255 or len(serializer) > 255:
        raise ValueError("JOIN_ROOM lengths are one byte")
    return bytes([JOIN_ROOM, len(token)]) + token + bytes([len(serializer)]) + serializer


def encode_error(code: int, message: str) -> bytes:
    """An ERROR frame as the server writes it (for tests and fakes)."""
    return bytes([ERROR]) + encode_number(code) + encode_string(message)
