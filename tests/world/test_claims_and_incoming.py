"""Pure parts of the world link: claims split into frames that fit, merged answers, incoming validation."""

from __future__ import annotations

import itertools

import msgpack
import pytest

from bridge.world import codec
from bridge.world.claims import CLAIM_FRAME_BYTES, Claims, claim_chunks
from bridge.world.incoming import MAX_TALK_CHARS, Ignored, cut_talk, read_room_data
from bridge.world.messages import Claim, Claimed, Talk

SERVER_FRAME_LIMIT = 4096


@pytest.mark.parametrize("id_length", [1, 10, 40, 300])
@pytest.mark.parametrize("count", [1, 15, 16, 370, 1000])
def test_claims_fit_in_frames_and_keep_every_id_in_order(id_length: int, count: int) -> None:
    ids = [f"{n:0{id_length}d}"[-id_length:] + f"-{n}" for n in range(count)]
    claims, too_long = claim_chunks(ids)
    assert too_long == []
    assert [npc for claim in claims for npc in claim.npc_ids] == ids
    frames = [codec.encode_room_data(claim.type_name, claim.payload()) for claim in claims]
    assert all(len(frame) <= CLAIM_FRAME_BYTES < SERVER_FRAME_LIMIT for frame in frames)
    # Split only as far as needed: two neighbouring chunks would not have fitted in one frame.
    for left, right in itertools.pairwise(claims):
        joined = Claim(npc_ids=[*left.npc_ids, right.npc_ids[0]])
        assert len(codec.encode_room_data(joined.type_name, joined.payload())) > CLAIM_FRAME_BYTES - 2


def test_a_thousand_ten_character_ids_need_several_claims() -> None:
    claims, _ = claim_chunks([f"staff-{n:04d}" for n in range(1000)])
    assert 4 <= len(claims) <= 8


def test_an_id_too_long_for_any_frame_is_refused_and_the_rest_claimed() -> None:
    huge = "x" * 3000
    claims, too_long = claim_chunks(["cafe-minori", huge, "haruno"])
    assert too_long == [huge]
    assert [npc for claim in claims for npc in claim.npc_ids] == ["cafe-minori", "haruno"]


def test_claim_answers_on_one_connection_merge_and_ignore_unasked_ids() -> None:
    claims = Claims()
    first, second = claim_chunks(["a", "b"])[0][0], claim_chunks(["c"])[0][0]
    claims.sent(first)
    claims.sent(second)
    assert not claims.answered.is_set()
    answer = claims.answer(Claimed.model_validate({"npcIds": ["a", "b", "zz"], "denied": []}))
    assert (answer.granted, answer.unasked) == (["a", "b"], ["zz"])
    assert not claims.answered.is_set()
    claims.answer(Claimed.model_validate({"npcIds": ["c"], "features": ["say-parts"]}))
    assert claims.granted == {"a", "b", "c"}
    assert claims.features == {"say-parts"}
    assert claims.answered.is_set()
    assert claims.to_ask(["a", "d", "c", "d"]) == ["d"]


def _talk_payload(**changes: object) -> bytes:
    talk = {"id": "e1", "npcId": "cafe-minori", "playerId": "p1", "playerName": "旅人1", "text": "やあ", "at": 1.0}
    return bytes(msgpack.packb({**talk, **changes}))


def test_a_valid_talk_reads_as_a_typed_event() -> None:
    read = read_room_data("npc:talk", _talk_payload(), frame_bytes=100)
    assert isinstance(read, Talk) and (read.id, read.npc_id, read.text) == ("e1", "cafe-minori", "やあ")


@pytest.mark.parametrize(
    ("message_type", "payload", "frame_bytes", "reason"),
    [
        ("npc:dance", _talk_payload(), 100, "unknown_type"),
        (7, _talk_payload(), 100, "unknown_type"),
        ("npc:talk", _talk_payload(at="secret-yesterday"), 100, "invalid"),
        ("npc:talk", b"\xc1", 100, "not_msgpack"),
        ("npc:talk", _talk_payload(), 70_000, "too_large"),
    ],
)
def test_bad_messages_read_as_a_reason_without_their_values(
    message_type: str | int, payload: bytes, frame_bytes: int, reason: str
) -> None:
    read = read_room_data(message_type, payload, frame_bytes=frame_bytes)
    assert isinstance(read, Ignored) and read.reason == reason
    assert "secret-yesterday" not in repr(read)


def test_a_long_talk_is_cut_and_says_how_long_it_was() -> None:
    talk = Talk.model_validate(msgpack.unpackb(_talk_payload(text="あ" * 250)))
    cut, chars = cut_talk(talk)
    assert (len(cut.text), chars) == (MAX_TALK_CHARS, 250)
    assert cut_talk(cut) == (cut, None)
