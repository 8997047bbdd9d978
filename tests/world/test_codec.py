"""The Colyseus frame codec, with bytes: header numbers and strings, JOIN_ROOM, ERROR, ROOM_DATA."""

from __future__ import annotations

import struct

import msgpack
import pytest

from bridge.errors import WorldProtocolError
from bridge.world import codec


@pytest.mark.parametrize(
    ("text", "expected_head"),
    [
        ("", b"\xa0"),
        ("npc:talk", b"\xa8"),
        ("x" * 31, b"\xbf"),
        ("x" * 32, b"\xd9\x20"),
        ("x" * 255, b"\xd9\xff"),
        # From 256 bytes on, the length is little-endian (msgpack would be big-endian).
        ("x" * 256, b"\xda\x00\x01"),
        ("x" * 0x1234, b"\xda\x34\x12"),
        ("x" * 0x10000, b"\xdb\x00\x00\x01\x00"),
    ],
)
def test_header_strings_use_little_endian_lengths(text: str, expected_head: bytes) -> None:
    encoded = codec.encode_string(text)
    assert encoded == expected_head + text.encode()
    assert codec.decode_string(encoded, 0) == (text, len(encoded))


def test_header_string_of_300_bytes_differs_from_msgpack() -> None:
    text = "あ" * 100  # 300 UTF-8 bytes
    encoded = codec.encode_string(text)
    assert encoded[:3] == b"\xda\x2c\x01"
    assert msgpack.packb(text)[:3] == b"\xda\x01\x2c"
    assert codec.decode_string(encoded, 0)[0] == text


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, b"\x00"),
        (127, b"\x7f"),
        (128, b"\xcc\x80"),
        (255, b"\xcc\xff"),
        (256, b"\xcd\x00\x01"),
        (525, b"\xcd\x0d\x02"),
        (4215, b"\xcd\x77\x10"),
        (70000, b"\xce\x70\x11\x01\x00"),
        (-1, b"\xff"),
        (-32, b"\xe0"),
        (-33, b"\xd0\xdf"),
        (-300, b"\xd1\xd4\xfe"),
        (-70000, b"\xd2" + struct.pack("<i", -70000)),
        (1.5, b"\xcb" + struct.pack("<d", 1.5)),
        # Never a uint64: a JS server would read a BigInt.
        (2**40, b"\xcb" + struct.pack("<d", 2.0**40)),
    ],
)
def test_header_numbers_round_trip_little_endian(value: int | float, expected: bytes) -> None:
    assert codec.encode_number(value) == expected
    assert codec.decode_number(expected, 0) == (value, len(expected))


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (b"\xca" + struct.pack("<f", 0.5), 0.5),
        (b"\xcf" + struct.pack("<Q", 2**40), 2**40),
        (b"\xd3" + struct.pack("<q", -(2**40)), -(2**40)),
    ],
)
def test_header_numbers_decode_every_width_colyseus_writes(raw: bytes, value: float) -> None:
    assert codec.decode_number(raw, 0) == (value, len(raw))


def test_join_room_016_layout_is_token_serializer_then_state() -> None:
    frame = bytes.fromhex("0a") + b"\x09" + b"tok-12345" + b"\x06" + b"schema" + b"\x80\x01\x02\xff"
    assert frame == codec.encode_join_room_016("tok-12345", "schema", b"\x80\x01\x02\xff")
    decoded = codec.decode_frame(frame, "0.16")
    assert decoded == codec.JoinRoom(reconnection_token="tok-12345", serializer_id="schema")


def test_join_room_018_layout_has_state_length_and_sections() -> None:
    state = bytes(range(200))
    frame = codec.encode_join_room_018("abc", "schema", state, sections=b"\x02\x01\x07")
    assert frame[:12] == b"\x0a\x03abc\x06schema"
    assert frame[12:14] == b"\xcc\xc8"  # the state length (200), schema-encoded
    decoded = codec.decode_frame(frame, "0.18")
    assert decoded == codec.JoinRoom(reconnection_token="abc", serializer_id="schema")


def test_truncated_join_room_is_a_protocol_error() -> None:
    with pytest.raises(WorldProtocolError):
        codec.decode_frame(b"\x0a\x09tok", "0.18")


@pytest.mark.parametrize(
    ("frame", "code", "message"),
    [
        (bytes([11]) + b"\xcd\x0d\x02" + b"\xad" + b"onAuth failed", 525, "onAuth failed"),
        (bytes([11]) + b"\xcd\x77\x10" + b"\xad" + b"onAuth failed", 4215, "onAuth failed"),
        (codec.encode_error(524, "seat reservation expired."), 524, "seat reservation expired."),
    ],
)
def test_error_frames_carry_code_and_message(frame: bytes, code: int, message: str) -> None:
    assert codec.decode_frame(frame, "0.18") == codec.ErrorFrame(code=code, message=message)
    assert codec.decode_frame(frame, "0.16") == codec.ErrorFrame(code=code, message=message)


def test_room_data_round_trip_with_a_msgpack_payload() -> None:
    payload = {"npcId": "cafe-minori", "replyTo": "evt-1", "text": "紅茶、お好きなんですね。", "on": True}
    frame = codec.encode_room_data("npc:say", payload)
    assert frame[:9] == b"\x0d\xa7npc:say"
    decoded = codec.decode_frame(frame, "0.18")
    assert isinstance(decoded, codec.RoomData)
    assert decoded.type == "npc:say"
    assert decoded.frame_bytes == len(frame)
    assert codec.decode_payload(decoded.payload) == payload


def test_room_data_with_a_long_type_name_uses_a_little_endian_header() -> None:
    message_type = "t" * 300
    frame = codec.encode_room_data(message_type, {"a": 1})
    assert frame[1:4] == b"\xda\x2c\x01"
    decoded = codec.decode_frame(frame, "0.16")
    assert isinstance(decoded, codec.RoomData)
    assert decoded.type == message_type
    assert codec.decode_payload(decoded.payload) == {"a": 1}


def test_room_data_with_a_numeric_type() -> None:
    decoded = codec.decode_frame(b"\x0d\xcd\x00\x01" + msgpack.packb([1]), "0.18")
    assert isinstance(decoded, codec.RoomData)
    assert decoded.type == 256


def test_room_data_without_payload_decodes_to_none() -> None:
    decoded = codec.decode_frame(b"\x0d\xa4ping", "0.16")
    assert isinstance(decoded, codec.RoomData)
    assert codec.decode_payload(decoded.payload) is None


def test_server_payload_details_decode_map16_float_at_and_undefined() -> None:
    # map16 (as msgpackr writes maps), `at` as float64, `undefined` as ext type 0
    payload = b"\xde\x00\x02" + b"\xa2at" + b"\xcb" + struct.pack(">d", 1759132800000.0) + b"\xa4name\xd4\x00\x00"
    assert codec.decode_payload(payload) == {"at": 1759132800000.0, "name": None}


def test_bad_msgpack_payload_is_a_protocol_error() -> None:
    with pytest.raises(WorldProtocolError):
        codec.decode_payload(b"\xc1")
    with pytest.raises(WorldProtocolError):
        codec.decode_payload(b"\x92\x01")  # array of 2 with one item


@pytest.mark.parametrize("code", [14, 15, 17, 18])
def test_state_and_ping_frames_are_ignored(code: int) -> None:
    decoded = codec.decode_frame(bytes([code]) + b"\x01\x02\x03", "0.18")
    assert decoded == codec.Ignored(code=code, known=True)


def test_018_strips_modifier_bits_but_016_does_not() -> None:
    timed_state_patch = bytes([15 | 0x80]) + b"\x00" * 8
    assert codec.decode_frame(timed_state_patch, "0.18") == codec.Ignored(code=15, known=True)
    assert codec.decode_frame(timed_state_patch, "0.16") == codec.Ignored(code=0x8F, known=False)


@pytest.mark.parametrize("frame", [b"", b"\x0d", b"\x0d\xdb\xff\xff\xff\x7f", b"\x0d\xc1", b"\x0b\xc1", b"\x0d\xa4np"])
def test_broken_frames_are_protocol_errors(frame: bytes) -> None:
    with pytest.raises(WorldProtocolError):
        codec.decode_frame(frame, "0.18")


def test_client_frames_are_ack_and_leave_bytes() -> None:
    assert codec.JOIN_ACK == b"\x0a"
    assert codec.LEAVE == b"\x0c"


def test_large_integers_are_sent_as_floats_never_uint64() -> None:
    frame = codec.encode_room_data("npc:say", {"at": 1759132800000, "n": 5, "neg": -(2**40), "ok": True})
    decoded = codec.decode_frame(frame, "0.18")
    assert isinstance(decoded, codec.RoomData)
    assert b"\xcf" not in decoded.payload and b"\xd3" not in decoded.payload
    assert codec.decode_payload(decoded.payload) == {
        "at": 1759132800000.0,
        "n": 5,
        "neg": float(-(2**40)),
        "ok": True,
    }
    assert isinstance(codec.decode_payload(decoded.payload)["at"], float)
