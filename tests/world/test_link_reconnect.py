"""WorldLink reconnection against the reference worlds: refused tokens, drops, a killed world, kept says."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from bridge.world.messages import Say, Talk, Typing
from tests.world.conftest import WORLD_TOKEN
from tests.world.harness import WorldServer
from tests.world.linkutil import FAST_BACKOFF_CAP_SECONDS, running_link

pytestmark = pytest.mark.world

# A reconnection must happen within a few backoff caps (plus process start-up slack on a slow machine).
RECONNECT_BOUND_SECONDS = 4 * FAST_BACKOFF_CAP_SECONDS + 10


@pytest.mark.parametrize("room", ["world", "world_static"], ids=["instance-onAuth", "static-onAuth"])
async def test_wrong_token_is_a_configuration_error_retried_slowly(world: WorldServer, room: str) -> None:
    window_seconds = 2.0
    with capture_logs() as logs:
        async with running_link(world.url, "wrong-token-xyz", room=room) as h:
            await asyncio.sleep(window_seconds)
            assert not h.link.connected
    refused = [e for e in logs if e["event"] == "world_auth_refused"]
    # slow_delay() waits at least 3/4 of the cap: over the window at most window / (0.75 * cap) + 1 tries.
    most = int(window_seconds / (0.75 * FAST_BACKOFF_CAP_SECONDS)) + 1
    assert 2 <= len(refused) <= most
    assert refused[0]["log_level"] == "error"
    record = await world.record()
    assert 2 <= record["authFailures"] <= most
    assert record["joins"] == []
    assert any(s.startswith("world refused the token, retrying in") for s in h.statuses)
    assert "wrong-token-xyz" not in repr(logs)


async def test_dropped_socket_reconnects_with_the_token_and_claims_again(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        session = (await world.record())["workers"][0]
        with capture_logs() as logs:
            assert await world.drop_workers() == 1
            record = await world.wait_for(
                lambda r: bool(r["reconnects"]) and len(r["claims"]) >= 2, RECONNECT_BOUND_SECONDS
            )
            await h.joined()
        assert record["reconnects"][0]["sessionId"] == session  # same seat: the token was used
        assert [j["sessionId"] for j in record["joins"]] == [session]
        assert any(e["event"] == "world_disconnected" and e["code"] == 1006 for e in logs)

        event_id = await world.inject_talk("cafe-minori", "player-1", "もどったよ")
        talk = await h.next_event()
        assert isinstance(talk, Talk) and talk.id == event_id


async def test_killed_world_restarted_on_the_same_port_gets_a_fresh_join(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        await world.inject_talk("cafe-minori", "player-1", "こんにちは")
        first = await h.next_event()
        assert isinstance(first, Talk)

        world.kill()
        await h.until(lambda: not h.link.connected, timeout=10)
        await asyncio.sleep(0.5)  # a few refused connection attempts
        assert any(s.startswith("world unreachable, retrying in") for s in h.statuses)
        with capture_logs() as logs:
            await world.restart()
            await world.wait_for(lambda r: bool(r["claims"]), RECONNECT_BOUND_SECONDS)
            await h.joined()
        # The old token is refused by the new process; the link falls back to joinOrCreate.
        assert any(e["event"] == "world_reconnect_refused" for e in logs)
        assert any(e["event"] == "world_joined" for e in logs)

        event_id = await world.inject_talk("cafe-minori", "player-2", "また来たよ")
        talk = await h.next_event()
        assert isinstance(talk, Talk) and talk.id == event_id
        await h.link.say(Say(npc_id="cafe-minori", reply_to=talk.id, text="おかえりなさい。"))
        said = await world.wait_for_say(lambda s: s["replyTo"] == event_id)
        assert said["text"] == "おかえりなさい。"


async def test_say_while_disconnected_is_delivered_after_reconnection(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        world.kill()
        await h.until(lambda: not h.link.connected, timeout=10)
        await h.link.say(Say(npc_id="cafe-minori", reply_to="evt-kept", text="お待たせしました。"))
        await h.link.typing(Typing(npc_id="cafe-minori", reply_to="evt-kept", on=False))
        await world.restart()
        said = await world.wait_for_say(lambda s: s["replyTo"] == "evt-kept", RECONNECT_BOUND_SECONDS)
        assert said["text"] == "お待たせしました。"
        record = await world.record()
        assert record["typed"] == []  # typing is not kept
        # The claim comes before the kept reply, so the world knows who speaks.
        assert record["claims"][0]["at"] <= record["said"][0]["at"]


async def test_stale_say_is_dropped_with_a_log_line(world: WorldServer) -> None:
    now = [1000.0]
    async with running_link(world.url, WORLD_TOKEN, clock=lambda: now[0], say_max_age_seconds=60.0) as h:
        await h.joined()
        world.kill()
        await h.until(lambda: not h.link.connected, timeout=10)
        await h.link.say(Say(npc_id="cafe-minori", reply_to="evt-stale", text="遅すぎました。"))
        now[0] += 30.0
        await h.link.say(Say(npc_id="cafe-minori", reply_to="evt-fresh", text="まだ間に合います。"))
        now[0] += 31.0  # the first is now 61 s old, the second 31 s
        with capture_logs() as logs:
            await world.restart()
            await world.wait_for_say(lambda s: s["replyTo"] == "evt-fresh", RECONNECT_BOUND_SECONDS)
            await h.joined()
    assert [s["replyTo"] for s in await world.said()] == ["evt-fresh"]
    dropped = [e for e in logs if e["event"] == "world_say_dropped"]
    assert [(e["reason"], e["reply_to"], e["age_s"]) for e in dropped] == [("stale", "evt-stale", 61.0)]


async def test_kept_replies_are_bounded(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN, say_buffer_size=3) as h:
        await h.joined()
        world.kill()
        await h.until(lambda: not h.link.connected, timeout=10)
        with capture_logs() as logs:
            for n in range(5):
                await h.link.say(Say(npc_id="cafe-minori", reply_to=f"evt-{n}", text="はい。"))
        await world.restart()
        await world.wait_for_say(lambda s: s["replyTo"] == "evt-4", RECONNECT_BOUND_SECONDS)
        assert [s["replyTo"] for s in await world.said()] == ["evt-2", "evt-3", "evt-4"]
    dropped = [(e["reason"], e["reply_to"]) for e in logs if e["event"] == "world_say_dropped"]
    assert dropped == [("buffer_full", "evt-0"), ("buffer_full", "evt-1")]


async def test_run_is_cancellation_safe(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        before = {t.get_name() for t in asyncio.all_tasks()}
        assert {"world-reader", "world-speaker", "world-leave-watch"} <= before
        run_task = next(t for t in asyncio.all_tasks() if t.get_name() == "test-world-link")
        run_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run_task
        after = {t.get_name() for t in asyncio.all_tasks()}
        assert not after & {"world-reader", "world-speaker", "world-leave-watch", "world-connect"}
        assert not h.link.connected
        # A cancelled link closed its socket without consent: the room holds the seat for a reconnection.
        record = await world.wait_for(lambda r: bool(r["drops"]), timeout=5)
        assert record["leaves"] == []
