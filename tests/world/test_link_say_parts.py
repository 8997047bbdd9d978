"""Say-parts on the world link against the reference worlds: only when offered, in order, never after the say."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from bridge.world.messages import Say, SayPart
from tests.world.conftest import WORLD_TOKEN, StartWorld
from tests.world.harness import WorldServer
from tests.world.linkutil import FAST_BACKOFF_CAP_SECONDS, LinkHarness, running_link

pytestmark = pytest.mark.world

RECONNECT_BOUND_SECONDS = 4 * FAST_BACKOFF_CAP_SECONDS + 10
SENTENCES = ("紅茶、お好きなんですね。", "今日は何にしましょうか？")


@pytest.fixture
async def parts_world(start_world: StartWorld) -> WorldServer:
    """A reference world (each version) that offers say-parts."""
    return await start_world(say_parts=True)


async def _reply_in_parts(h: LinkHarness, reply_to: str) -> None:
    for index, text in enumerate(SENTENCES):
        await h.link.say_part(SayPart(npc_id="cafe-minori", reply_to=reply_to, index=index, text=text, emotion="happy"))
    await h.link.say(Say(npc_id="cafe-minori", reply_to=reply_to, text="".join(SENTENCES), emotion="happy"))


async def test_a_world_that_offers_parts_gets_them_before_the_final_say(parts_world: WorldServer) -> None:
    async with running_link(parts_world.url, WORLD_TOKEN) as h:
        await h.joined()
        assert h.link.parts_wanted
        await _reply_in_parts(h, "evt-1")
        await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-1")
        record = await parts_world.record()
    assert [p["payload"]["text"] for p in record["parts"]] == list(SENTENCES)
    assert [p["payload"]["index"] for p in record["parts"]] == [0, 1]
    assert record["parts"][-1]["atHr"] <= record["said"][0]["atHr"]
    assert record["violations"] == []


async def test_a_world_that_does_not_offer_parts_gets_only_the_say(world: WorldServer) -> None:
    with capture_logs() as logs:
        async with running_link(world.url, WORLD_TOKEN) as h:
            await h.joined()
            assert not h.link.parts_wanted
            await _reply_in_parts(h, "evt-1")
            said = await world.wait_for_say(lambda s: s["replyTo"] == "evt-1")
    assert said["text"] == "".join(SENTENCES)
    record = await world.record()
    assert record["parts"] == [] and record["violations"] == []
    dropped = [e["reason"] for e in logs if e["event"] == "world_part_dropped"]
    assert dropped == ["not_offered", "not_offered"]


async def test_parts_switched_off_by_the_operator_are_never_sent(parts_world: WorldServer) -> None:
    async with running_link(parts_world.url, WORLD_TOKEN, say_parts=False) as h:
        await h.joined()
        assert not h.link.parts_wanted
        await _reply_in_parts(h, "evt-1")
        await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-1")
    assert (await parts_world.parts()) == []


async def test_a_part_given_after_its_say_is_dropped(parts_world: WorldServer) -> None:
    with capture_logs() as logs:
        async with running_link(parts_world.url, WORLD_TOKEN) as h:
            await h.joined()
            await h.link.say(Say(npc_id="cafe-minori", reply_to="evt-1", text="はい。"))
            await h.link.say_part(SayPart(npc_id="cafe-minori", reply_to="evt-1", index=0, text="はい。"))
            await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-1")
            await _reply_in_parts(h, "evt-2")  # the next reply still goes in parts
            await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-2")
    assert [p["replyTo"] for p in await parts_world.parts()] == ["evt-2", "evt-2"]
    assert await parts_world.violations() == []
    dropped = [(e["reason"], e["reply_to"]) for e in logs if e["event"] == "world_part_dropped"]
    assert dropped == [("after_say", "evt-1")]


async def test_parts_kept_while_disconnected_arrive_in_order_before_their_say(parts_world: WorldServer) -> None:
    async with running_link(parts_world.url, WORLD_TOKEN) as h:
        await h.joined()
        parts_world.kill()
        await h.until(lambda: not h.link.connected, timeout=10)
        assert h.link.parts_wanted  # remembered from the last connection until the next one answers
        await _reply_in_parts(h, "evt-kept")
        await parts_world.restart()
        await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-kept", RECONNECT_BOUND_SECONDS)
        record = await parts_world.record()
    assert [p["payload"]["text"] for p in record["parts"]] == list(SENTENCES)
    assert record["claimed"][0]["at"] <= record["parts"][0]["at"]  # the claim answer came first
    assert record["violations"] == []


async def test_parts_kept_for_a_world_that_no_longer_offers_them_are_dropped_and_the_say_sent(
    parts_world: WorldServer,
) -> None:
    with capture_logs() as logs:
        async with running_link(parts_world.url, WORLD_TOKEN) as h:
            await h.joined()
            parts_world.kill()
            await h.until(lambda: not h.link.connected, timeout=10)
            await _reply_in_parts(h, "evt-kept")
            await parts_world.restart(say_parts=False)
            said = await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-kept", RECONNECT_BOUND_SECONDS)
            await h.joined()
            assert not h.link.parts_wanted
    assert said["text"] == "".join(SENTENCES)
    record = await parts_world.record()
    assert record["parts"] == [] and record["violations"] == []
    assert [e["parts"] for e in logs if e["event"] == "world_parts_dropped"] == [2]


async def test_a_world_that_stops_offering_parts_after_a_reconnect_gets_none(parts_world: WorldServer) -> None:
    async with running_link(parts_world.url, WORLD_TOKEN) as h:
        await h.joined()
        await _reply_in_parts(h, "evt-1")
        await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-1")

        await parts_world.set_say_parts(False)
        await parts_world.drop_workers()
        await parts_world.wait_for(lambda r: len(r["claimed"]) >= 2, RECONNECT_BOUND_SECONDS)
        await h.until(lambda: h.link.connected and not h.link.parts_wanted)
        await _reply_in_parts(h, "evt-2")
        await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-2")

        await parts_world.set_say_parts(True)  # and back: parts again after the next reconnect
        await parts_world.drop_workers()
        await parts_world.wait_for(lambda r: len(r["claimed"]) >= 3, RECONNECT_BOUND_SECONDS)
        await h.until(lambda: h.link.connected and h.link.parts_wanted)
        await _reply_in_parts(h, "evt-3")
        await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-3")
    assert [p["replyTo"] for p in await parts_world.parts()] == ["evt-1", "evt-1", "evt-3", "evt-3"]
    assert await parts_world.violations() == []


async def test_the_reference_world_records_every_broken_parts_rule(parts_world: WorldServer) -> None:
    """The world's own check (what the tests above rely on) sees each rule broken, bypassing the link."""
    async with running_link(parts_world.url, WORLD_TOKEN) as h:
        await h.joined()
        conn = h.link._conn
        assert conn is not None

        def part(reply_to: str, index: int, text: str = "はい。") -> SayPart:
            return SayPart(npc_id="cafe-minori", reply_to=reply_to, index=index, text=text, emotion="happy")

        for message in (
            part("a", 1),  # out of order
            Say(npc_id="cafe-minori", reply_to="a", text="ちがう。", emotion="happy"),  # not the parts joined
            part("b", 0),
            Say(npc_id="cafe-minori", reply_to="b", text="はい。", emotion="sad"),  # not part 0's emotion
            part("b", 1),  # after its say
        ):
            assert await conn.send(message)
        await parts_world.wait_for(lambda r: len(r["violations"]) >= 4)

        await parts_world.set_say_parts(False)
        await parts_world.drop_workers()
        await parts_world.wait_for(lambda r: len(r["claimed"]) >= 2, RECONNECT_BOUND_SECONDS)
        await h.until(lambda: h.link.connected and not h.link.parts_wanted)
        conn = h.link._conn
        assert conn is not None
        assert await conn.send(part("c", 0))  # not offered on this connection
        await parts_world.wait_for(lambda r: len(r["violations"]) >= 5)
    rules = [(v["rule"], v["replyTo"]) for v in await parts_world.violations()]
    assert rules == [
        ("part_out_of_order", "a"),
        ("say_differs_from_parts", "a"),
        ("say_emotion_differs", "b"),
        ("part_after_say", "b"),
        ("part_not_offered", "c"),
    ]


async def test_a_part_too_big_for_a_frame_is_refused_with_a_log_line_and_the_connection_stays(
    parts_world: WorldServer,
) -> None:
    with capture_logs() as logs:
        async with running_link(parts_world.url, WORLD_TOKEN) as h:
            await h.joined()
            await h.link.say_part(SayPart(npc_id="cafe-minori", reply_to="evt-big", index=0, text="長" * 2000))
            await _reply_in_parts(h, "evt-next")
            await parts_world.wait_for_say(lambda s: s["replyTo"] == "evt-next")
            assert h.link.connected
    record = await parts_world.record()
    assert [p["payload"]["replyTo"] for p in record["parts"]] == ["evt-next", "evt-next"]
    assert record["drops"] == [] and len(record["joins"]) == 1
    refused = [e for e in logs if e["event"] == "world_frame_refused"]
    assert [(e["type"], e["npc"], e["log_level"]) for e in refused] == [("npc:say:part", "cafe-minori", "error")]
    assert refused[0]["frame_bytes"] > 4000
