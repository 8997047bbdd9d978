"""WorldLink against a misbehaving world: every bad message is logged and ignored, the connection stays."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from structlog.testing import capture_logs

from bridge.world import codec
from bridge.world.messages import Talk
from tests.world.conftest import WORLD_TOKEN
from tests.world.harness import WorldServer
from tests.world.linkutil import LinkHarness, running_link

pytestmark = pytest.mark.world


async def _still_up(world: WorldServer, h: LinkHarness) -> None:
    """The next valid talk arrives on the same connection (no drop, no second join)."""
    event_id = await world.inject_talk("cafe-minori", "player-1", "まだいる？")
    talk = await h.next_event()
    assert isinstance(talk, Talk) and talk.id == event_id
    assert h.link.connected
    record = await world.record()
    assert record["drops"] == [] and record["reconnects"] == [] and len(record["joins"]) == 1


async def test_bad_messages_are_logged_once_each_and_ignored(world: WorldServer) -> None:
    good = {
        "id": "evt-x",
        "npcId": "cafe-minori",
        "playerId": "p",
        "playerName": "旅人1",
        "text": "x",
        "at": 1,
    }
    cases: list[tuple[str, object, str]] = [
        ("npc:dance", {"npcId": "cafe-minori"}, "unknown_type"),
        ("npc:talk", {k: v for k, v in good.items() if k != "text"}, "invalid"),
        ("npc:talk", {**good, "at": "yesterday"}, "invalid"),
        ("npc:talk", "just a string", "invalid"),
        ("npc:event", {"npcId": "cafe-minori", "kind": "dance", "text": "x", "at": 1}, "invalid"),
        ("player:left", {"at": 1}, "invalid"),
        ("worker:claimed", {"npcIds": "cafe-minori"}, "invalid"),
        ("npc:talk", {**good, "npcId": "nobody-we-know"}, "npc_not_granted"),
        ("npc:talk", {**good, "text": "大" * 350_000}, "too_large"),  # about 1 MB
    ]
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        with capture_logs() as logs:
            for message_type, payload, _ in cases:
                assert await world.inject_message(message_type, payload) == 1
            await _still_up(world, h)
    ignored = [e for e in logs if e["event"] == "world_message_ignored"]
    assert [(e["type"], e["reason"]) for e in ignored] == [(t, reason) for t, _, reason in cases]
    assert "yesterday" not in repr(logs) and "大大" not in repr(logs)  # values are never logged
    assert ignored[1]["problems"] == ["text:missing"]


async def test_malformed_frames_are_logged_and_ignored(world: WorldServer) -> None:
    frames = [
        (b"\x0d", "bad_frame"),  # ROOM_DATA without a type
        (b"\x0d\xdb\xff\xff\xff\x7f", "bad_frame"),  # a type string longer than the frame
        (codec.encode_string("npc:talk").join([b"\x0d", b"\xc1\xc1"]), "not_msgpack"),
        (b"\x0d" + codec.encode_string("npc:talk") + msgpack.packb([1, 2]), "invalid"),
        (b"\x0d\xcd\x00\x01" + msgpack.packb({}), "unknown_type"),  # numeric type 256
        (b"\x1e\x00\x01", "unknown_frame"),
    ]
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        with capture_logs() as logs:
            for frame, _ in frames:
                assert await world.inject_frame(frame) == 1
            # state, raw bytes and ping frames are skipped silently
            for quiet in (b"\x0e\x00", b"\x0f\xff\x01", b"\x11\xa1x\x01\x02", b"\x12"):
                await world.inject_frame(quiet)
            await _still_up(world, h)
    ignored = [e["reason"] for e in logs if e["event"] == "world_message_ignored"]
    assert ignored == [reason for _, reason in frames]


async def test_large_room_state_does_not_close_the_connection(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        with capture_logs() as logs:
            await world.set_state_size(4_000_000)
            await h.until(lambda: any(e["event"] == "world_large_frame_skipped" for e in logs), timeout=10)
            await asyncio.sleep(0.2)
            await _still_up(world, h)
    skipped = [e for e in logs if e["event"] == "world_large_frame_skipped"]
    assert skipped[0]["code"] in (codec.ROOM_STATE, codec.ROOM_STATE_PATCH)
    assert skipped[0]["frame_bytes"] > 4_000_000
    assert not [e for e in logs if e["event"] == "world_message_ignored"]


async def test_talk_for_an_npc_the_bridge_did_not_claim_is_ignored(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN, npc_ids=("cafe-minori",)) as h:
        await h.joined()
        with capture_logs() as logs:
            await world.inject_talk("cinema-aoi", "player-1", "こんにちは")  # known to the world, not ours
            await h.no_event()
    assert [(e["reason"], e.get("npc")) for e in logs if e["event"] == "world_message_ignored"] == [
        ("npc_not_granted", "cinema-aoi")
    ]


async def test_event_queue_overflow_is_logged_and_later_events_still_flow(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN, event_queue_size=2) as h:
        await h.joined()
        with capture_logs() as logs:
            ids = [await world.inject_talk("cafe-minori", f"player-{n}", "やあ") for n in range(4)]
            await h.until(lambda: sum(e["event"] == "world_event_dropped" for e in logs) == 2)
        received = [await h.next_event(), await h.next_event()]
        assert [e.id for e in received if isinstance(e, Talk)] == ids[:2]
        await _still_up(world, h)


async def test_a_flood_of_bad_messages_is_logged_a_few_lines_at_a_time(world: WorldServer) -> None:
    from bridge.world.inbox import IGNORED_LOG_BURST

    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        with capture_logs() as logs:
            for _ in range(IGNORED_LOG_BURST * 5):
                assert await world.inject_message("npc:dance", {"npcId": "cafe-minori"}) == 1
            assert await world.inject_message("npc:sing", {"npcId": "cafe-minori"}) == 1
            await _still_up(world, h)
    ignored = [(e["type"], e["reason"]) for e in logs if e["event"] == "world_message_ignored"]
    assert ignored == [("npc:dance", "unknown_type")] * IGNORED_LOG_BURST + [("npc:sing", "unknown_type")]
