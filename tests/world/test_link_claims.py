"""Large rosters and roster changes against the reference worlds: claims in several frames, merged answers."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from bridge.world.messages import Talk
from tests.world.conftest import WORLD_TOKEN, StartWorld
from tests.world.harness import KNOWN_NPCS, WorldServer
from tests.world.linkutil import FAST_BACKOFF_CAP_SECONDS, running_link

pytestmark = pytest.mark.world

RECONNECT_BOUND_SECONDS = 4 * FAST_BACKOFF_CAP_SECONDS + 10
STAFF = tuple(f"staff-{n:04d}" for n in range(1000))  # one claim of these would be ~12 KB, 3x the frame limit


@pytest.fixture
async def big_world(start_world: StartWorld) -> WorldServer:
    """A reference world (each version) that grants the 1,000 staff NPCs too."""
    return await start_world(extra_npcs=STAFF)


def _claimed_ids(record: dict[str, object], session: str) -> list[str]:
    claims = record["claims"]
    assert isinstance(claims, list)
    return [npc for claim in claims if claim["sessionId"] == session for npc in claim["npcIds"]]


async def test_a_thousand_npcs_are_claimed_in_several_messages_before_and_after_a_reconnect(
    big_world: WorldServer,
) -> None:
    roster = (*STAFF, "cafe-minori")
    with capture_logs() as logs:
        async with running_link(big_world.url, WORLD_TOKEN, npc_ids=roster) as h:
            await h.until(lambda: h.link.connected and h.link.granted == frozenset(roster), timeout=15)
            record = await big_world.record()
            session = record["workers"][0]
            assert len(record["claims"]) > 1  # several messages …
            assert sorted(_claimed_ids(record, session)) == sorted(roster)  # … that together ask for all
            assert record["drops"] == [] and len(record["joins"]) == 1  # nothing was over the frame limit

            await big_world.drop_workers()
            await big_world.wait_for(lambda r: bool(r["reconnects"]), RECONNECT_BOUND_SECONDS)
            await h.until(lambda: h.link.connected and h.link.granted == frozenset(roster), timeout=15)
            record = await big_world.record()
            assert len(_claimed_ids(record, session)) == 2 * len(roster)
            assert record["drops"][1:] == []  # only the drop the test made

            event_id = await big_world.inject_talk("staff-0999", "player-1", "いちばん最後のひと")
            talk = await h.next_event()
            assert isinstance(talk, Talk) and talk.id == event_id and talk.npc_id == "staff-0999"
    assert any(e["event"] == "world_claim_split" and e["npcs"] == len(roster) for e in logs)
    assert not [e for e in logs if e["event"] == "world_disconnected" and e["code"] == 1009]


async def test_voice_claims_new_npcs_at_once_and_removed_ones_stay_until_the_next_connection(
    world: WorldServer,
) -> None:
    async with running_link(world.url, WORLD_TOKEN, npc_ids=("cafe-minori",)) as h:
        await h.joined()
        h.link.voice(["cafe-minori", "cinema-aoi", "haruno"])
        await h.until(lambda: h.link.granted == {"cafe-minori", "cinema-aoi", "haruno"})
        record = await world.record()
        assert [c["npcIds"] for c in record["claims"]] == [["cafe-minori"], ["cinema-aoi", "haruno"]]
        assert len(record["joins"]) == 1 and record["drops"] == []

        # Removed: still claimed on this connection (the protocol cannot hand it back) …
        h.link.voice(["haruno", "cinema-aoi"])
        event_id = await world.inject_talk("cafe-minori", "player-1", "まだいる？")
        talk = await h.next_event()
        assert isinstance(talk, Talk) and talk.id == event_id
        assert len((await world.record())["claims"]) == 2  # nothing new to claim

        # … and no longer claimed after a reconnect.
        await world.drop_workers()
        record = await world.wait_for(lambda r: len(r["claims"]) >= 3, RECONNECT_BOUND_SECONDS)
        assert record["claims"][2]["npcIds"] == ["haruno", "cinema-aoi"]
        await h.until(lambda: h.link.connected and h.link.granted == {"haruno", "cinema-aoi"})


async def test_voice_while_disconnected_claims_everything_on_the_next_join(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN, npc_ids=("cafe-minori",)) as h:
        await h.joined()
        world.kill()
        await h.until(lambda: not h.link.connected, timeout=10)
        h.link.voice(["cafe-minori", "ryokan-fumi"])
        await world.restart()
        record = await world.wait_for(lambda r: bool(r["claims"]), RECONNECT_BOUND_SECONDS)
        await h.until(lambda: h.link.connected and h.link.granted == {"cafe-minori", "ryokan-fumi"})
        assert [c["npcIds"] for c in (await world.record())["claims"]] == [["cafe-minori", "ryokan-fumi"]]
        assert set(KNOWN_NPCS) >= set(record["claims"][0]["npcIds"])
