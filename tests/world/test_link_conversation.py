"""WorldLink against the reference worlds (0.16 and 0.18): join, claim, hear, speak, leave."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from bridge.world.messages import NpcEvent, PlayerLeft, Say, Talk, Typing
from tests.world.conftest import WORLD_TOKEN
from tests.world.harness import WorldServer
from tests.world.linkutil import running_link

pytestmark = pytest.mark.world


async def test_round_trip_talk_then_typing_and_say_reach_the_world(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        assert "joined world" in h.statuses
        claims = (await world.record())["claims"]
        assert claims[0]["npcIds"] == ["cafe-minori", "cinema-aoi"]
        assert claims[0]["scope"] == "talk"

        event_id = await world.inject_talk("cafe-minori", "player-1", "ここの紅茶がすきなんだよ", player_name="旅人2")
        talk = await h.next_event()
        assert isinstance(talk, Talk)
        assert (talk.id, talk.npc_id, talk.player_id, talk.player_name) == (
            event_id,
            "cafe-minori",
            "player-1",
            "旅人2",
        )
        assert talk.text == "ここの紅茶がすきなんだよ"

        await h.link.typing(Typing(npc_id="cafe-minori", reply_to=talk.id, on=True))
        await h.link.say(Say(npc_id="cafe-minori", reply_to=talk.id, text="紅茶、お好きなんですね。", emotion="happy"))
        said = await world.wait_for_say(lambda s: s["replyTo"] == event_id)
        assert said == {
            "npcId": "cafe-minori",
            "replyTo": event_id,
            "text": "紅茶、お好きなんですね。",
            "emotion": "happy",
            "source": "generated",
        }
        assert await world.typed() == [{"npcId": "cafe-minori", "replyTo": event_id, "on": True}]


async def test_npc_event_and_player_left_arrive(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        await world.inject_event("cinema-aoi", "greet", "いらっしゃいませ。", player_id="player-9", at=1759132790000)
        event = await h.next_event()
        assert isinstance(event, NpcEvent)
        assert (event.npc_id, event.kind, event.player_id, event.at) == (
            "cinema-aoi",
            "greet",
            "player-9",
            1759132790000.0,
        )
        await world.inject_event("cinema-aoi", "serve", "どうぞ。")
        event = await h.next_event()
        assert isinstance(event, NpcEvent) and event.player_id is None

        await world.inject_left("player-9")
        left = await h.next_event()
        assert isinstance(left, PlayerLeft) and left.player_id == "player-9"


async def test_denied_npc_is_logged_and_its_talk_ignored(world: WorldServer) -> None:
    with capture_logs() as logs:
        async with running_link(world.url, WORLD_TOKEN, npc_ids=("cafe-minori", "ghost-npc")) as h:
            await h.joined()
            assert h.link.granted == frozenset({"cafe-minori"})
            await world.inject_talk("ghost-npc", "player-1", "こんにちは")
            await world.inject_talk("cafe-minori", "player-1", "こんばんは")
            talk = await h.next_event()
            assert isinstance(talk, Talk) and talk.npc_id == "cafe-minori"
    claimed = [e for e in logs if e["event"] == "world_claimed"]
    assert claimed[0]["granted"] == ["cafe-minori"]
    assert claimed[0]["denied"] == [{"npc_id": "ghost-npc", "reason": "unknown npc"}]
    ignored = [e for e in logs if e["event"] == "world_message_ignored"]
    assert [(e["reason"], e["type"], e["npc"]) for e in ignored] == [("npc_not_granted", "npc:talk", "ghost-npc")]


async def test_talk_of_250_characters_arrives_cut_to_200(world: WorldServer) -> None:
    text = "あいうえお" * 50
    with capture_logs() as logs:
        async with running_link(world.url, WORLD_TOKEN) as h:
            await h.joined()
            await world.inject_talk("cafe-minori", "player-1", text)
            talk = await h.next_event()
    assert isinstance(talk, Talk)
    assert talk.text == text[:200]
    truncated = [e for e in logs if e["event"] == "world_talk_truncated"]
    assert truncated == [{"event": "world_talk_truncated", "npc": "cafe-minori", "chars": 250, "log_level": "info"}]


async def test_graceful_leave_is_a_consented_leave_and_ends_run_and_events(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        session = (await world.record())["workers"][0]
        await h.link.leave()
        assert not h.link.connected
        with pytest.raises(StopAsyncIteration):
            await h.next_event(timeout=5)
    record = await world.wait_for(lambda r: bool(r["leaves"]), timeout=5)
    assert record["leaves"] == [{**record["leaves"][0], "sessionId": session, "worker": True, "consented": True}]
    assert record["drops"] == []
    assert "left world" in h.statuses


async def test_say_too_long_for_one_client_frame_is_cut_and_the_connection_stays(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        await h.link.say(Say(npc_id="cafe-minori", reply_to="evt-long", text="長" * 3000))
        said = await world.wait_for_say(lambda s: s["replyTo"] == "evt-long")
        assert 1000 < len(said["text"]) < 1400 and set(said["text"]) == {"長"}
        await asyncio.sleep(0.3)
        assert h.link.connected
        assert (await world.record())["drops"] == []


async def test_the_token_never_appears_in_logs(world: WorldServer) -> None:
    with capture_logs() as logs:
        async with running_link(world.url, WORLD_TOKEN) as h:
            await h.joined()
    assert logs
    assert WORLD_TOKEN not in repr(logs)
    assert WORLD_TOKEN not in repr(h.link)
