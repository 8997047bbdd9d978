"""A world link whose run() crashed can run again: it reconnects, claims again, and events keep flowing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from structlog.testing import capture_logs

from bridge.world.backoff import Backoff
from bridge.world.inbox import Inbox
from bridge.world.messages import Say, Talk
from tests.world.conftest import WORLD_TOKEN
from tests.world.harness import WorldServer
from tests.world.linkutil import LinkHarness, fast_backoff, running_link

pytestmark = pytest.mark.world


class _Boom(RuntimeError):
    pass


class _BackoffThatBreaks(Backoff):
    """A bug in the reconnect loop's own arithmetic, once: it escapes run() after a drop."""

    def __init__(self) -> None:
        super().__init__(base_seconds=0.05, cap_seconds=0.4)
        self.armed = False

    def next_delay(self) -> float:
        if self.armed:
            self.armed = False
            raise _Boom("backoff bug")
        return super().next_delay()


async def _crashed(run_task: asyncio.Task[None]) -> BaseException | None:
    await asyncio.wait({run_task}, timeout=10)
    assert run_task.done(), "run() did not end after the crash"
    return run_task.exception()


async def _talks_again(world: WorldServer, h: LinkHarness, pending: asyncio.Task[Any]) -> None:
    """The restarted link hears a talk through the events iterator that was open across the crash."""
    await h.joined(timeout=15)
    event_id = await world.inject_talk("cafe-minori", "player-1", "もどった？")
    talk = await asyncio.wait_for(pending, 10)
    assert isinstance(talk, Talk) and talk.id == event_id
    await h.link.say(Say(npc_id="cafe-minori", reply_to=event_id, text="はい、もどりました。"))
    said = await world.wait_for_say(lambda s: s["replyTo"] == event_id)
    assert said["text"] == "はい、もどりました。"


async def test_a_frame_handler_crash_escapes_run_and_a_second_run_joins_afresh_and_claims_again(
    world: WorldServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = Inbox.take

    def take(self: Inbox, conn: Any, read: Any) -> None:
        if isinstance(read, Talk) and read.text == "crash":
            raise _Boom("frame handler bug")
        original(self, conn, read)

    monkeypatch.setattr(Inbox, "take", take)
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        first_session = (await world.record())["workers"][0]
        run_task = next(t for t in asyncio.all_tasks() if t.get_name() == "test-world-link")
        # The daemon's event pump is waiting on events() when the link crashes; it must not end.
        pending = asyncio.create_task(h.next_event(timeout=60))
        with capture_logs() as logs:
            await world.inject_talk("cafe-minori", "player-1", "crash")
            assert isinstance(await _crashed(run_task), _Boom)
        assert not pending.done() and not h.link.connected
        assert any(e["event"] == "world_link_crashed" for e in logs)
        # The crashed link gave its seat back with consent, so a fresh join can have the NPCs at once.
        record = await world.wait_for(lambda r: bool(r["leaves"]), timeout=10)
        assert record["leaves"][0]["sessionId"] == first_session and record["leaves"][0]["consented"]

        second = asyncio.create_task(h.link.run(), name="test-world-link-again")
        try:
            await _talks_again(world, h, pending)
            record = await world.record()
            assert len(record["joins"]) == 2 and record["workers"] != [first_session]
            assert record["claims"][-1]["npcIds"] == ["cafe-minori", "cinema-aoi"]
        finally:
            await h.link.leave()
            await asyncio.wait_for(second, 10)


async def test_a_crash_after_the_socket_closed_reconnects_to_the_same_seat_on_the_next_run(
    world: WorldServer,
) -> None:
    backoff = _BackoffThatBreaks()
    async with running_link(world.url, WORLD_TOKEN, backoff=backoff) as h:
        await h.joined()
        session = (await world.record())["workers"][0]
        run_task = next(t for t in asyncio.all_tasks() if t.get_name() == "test-world-link")
        pending = asyncio.create_task(h.next_event(timeout=60))
        backoff.armed = True
        await world.drop_workers()
        assert isinstance(await _crashed(run_task), _Boom)
        assert not pending.done()

        second = asyncio.create_task(h.link.run(), name="test-world-link-again")
        try:
            await _talks_again(world, h, pending)
            record = await world.record()
            assert [r["sessionId"] for r in record["reconnects"]] == [session]  # the kept token was used
            assert len(record["claims"]) == 2
        finally:
            await h.link.leave()
            await asyncio.wait_for(second, 10)


async def test_run_while_running_is_refused_and_run_after_leave_returns_at_once(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN) as h:
        await h.joined()
        with pytest.raises(RuntimeError, match="already running"):
            await h.link.run()
    await asyncio.wait_for(h.link.run(), 1)
    assert not h.link.connected
    with pytest.raises(StopAsyncIteration):
        await h.next_event(timeout=1)


async def test_a_cancelled_run_keeps_events_open_and_runs_again(world: WorldServer) -> None:
    async with running_link(world.url, WORLD_TOKEN, backoff=fast_backoff()) as h:
        await h.joined()
        run_task = next(t for t in asyncio.all_tasks() if t.get_name() == "test-world-link")
        pending = asyncio.create_task(h.next_event(timeout=60))
        run_task.cancel()
        await asyncio.wait({run_task}, timeout=10)
        assert run_task.cancelled() and not pending.done()
        second = asyncio.create_task(h.link.run(), name="test-world-link-again")
        try:
            await _talks_again(world, h, pending)
        finally:
            await h.link.leave()
            await asyncio.wait_for(second, 10)
