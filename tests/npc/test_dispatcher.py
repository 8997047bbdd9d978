"""The dispatcher's queueing rules (replies.md "Queueing") against a real loopback Ollama server.

The world side is a recorder of what the dispatcher says (the world link has its own tests against
real Colyseus servers); the LLM is a real HTTP server streaming NDJSON.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from bridge.llm.gate import Priority
from bridge.npc.characters import load_roster
from bridge.world.messages import NpcEvent, PlayerLeft
from tests.fakes.llm_servers import Answer, stall
from tests.memory.helpers import eventually, read_file
from tests.npc.rig import REPO, Rig, talk


async def test_each_line_gets_exactly_one_say_in_order(rig: Rig) -> None:
    rig.server.default = "いらっしゃいませ。ごゆっくりどうぞ。"
    lines = [talk("cafe-minori", f"p{n}", f"こんにちは{n}") for n in range(3)]
    for line in lines:
        rig.dispatcher.handle(line)
    says = await rig.world.wait_says(3)
    await asyncio.sleep(0.2)
    assert [s.reply_to for s in rig.world.says] == [line.id for line in lines]
    assert all(s.source == "generated" and s.text == "いらっしゃいませ。ごゆっくりどうぞ。" for s in says)
    assert [t.reply_to for t in rig.world.typings if t.on] == [line.id for line in lines]


async def test_newer_line_from_the_same_player_replaces_the_queued_one(rig: Rig) -> None:
    rig.server.script(Answer.text("少々お待ちください。", delay_seconds=0.05))
    first = talk("cafe-minori", "alice", "こんにちは")
    rig.dispatcher.handle(first)
    await rig.server.wait_for_requests(1)
    older = talk("cafe-minori", "bob", "コーヒーください")
    newer = talk("cafe-minori", "bob", "やっぱり紅茶で")
    rig.dispatcher.handle(older)
    rig.dispatcher.handle(newer)
    await rig.world.wait_says(2)
    await asyncio.sleep(0.3)
    assert [s.reply_to for s in rig.world.says] == [first.id, newer.id]
    assert older.id not in {t.reply_to for t in rig.world.typings}
    assert "紅茶" in rig.server.requests[-1].messages[-1]["content"]


async def test_player_who_left_has_queued_lines_dropped(rig: Rig) -> None:
    rig.server.script(Answer.text("少々お待ちください。", delay_seconds=0.05))
    first = talk("cafe-minori", "alice", "こんにちは")
    rig.dispatcher.handle(first)
    await rig.server.wait_for_requests(1)
    queued = talk("cafe-minori", "bob", "コーヒーください")
    rig.dispatcher.handle(queued)
    rig.dispatcher.handle(PlayerLeft(playerId="bob", at=time.time() * 1000))
    await rig.world.wait_says(1)
    await asyncio.sleep(0.5)
    assert [s.reply_to for s in rig.world.says] == [first.id]
    assert len(rig.server.requests) == 1


async def test_line_already_sent_to_the_llm_is_answered_even_if_the_player_leaves(rig: Rig) -> None:
    rig.server.script(Answer.text("ありがとうございます。", delay_seconds=0.05))
    line = talk("cafe-minori", "alice", "ありがとう")
    rig.dispatcher.handle(line)
    await rig.server.wait_for_requests(1)
    rig.dispatcher.handle(PlayerLeft(playerId="alice", at=time.time() * 1000))
    (say,) = await rig.world.wait_says(1)
    assert say.reply_to == line.id and say.source == "generated"


async def test_line_superseded_while_waiting_for_the_llm_slot_gets_typing_off(rig: Rig) -> None:
    await rig.gate.acquire(Priority.EXTRACTION)  # the LAN machine is busy with an extraction
    waiting = talk("cinema-aoi", "alice", "こんにちは")
    rig.dispatcher.handle(waiting)
    await asyncio.sleep(0.1)
    assert [(t.reply_to, t.on) for t in rig.world.typings] == [(waiting.id, True)]
    newer = talk("cinema-aoi", "alice", "ポップコーンください")
    rig.dispatcher.handle(newer)
    rig.gate.release()
    (say,) = await rig.world.wait_says(1)
    assert say.reply_to == newer.id
    assert (waiting.id, False) in [(t.reply_to, t.on) for t in rig.world.typings]
    assert len(rig.server.requests) == 1


@pytest.mark.parametrize("rig", [{"deadline": 0.8}], indirect=True)
async def test_deadline_passed_gives_a_fallback_line(rig: Rig) -> None:
    rig.server.script(stall("ええと"))
    started = time.monotonic()
    rig.dispatcher.handle(talk("ryokan-fumi", "alice", "温泉はどこ？"))
    (say,) = await rig.world.wait_says(1)
    assert say.source == "fallback"
    assert say.text in load_roster(REPO / "characters").characters["ryokan-fumi"].fallbacks
    assert time.monotonic() - started < 3.0
    record = await rig.server.requests[0].wait_ended()
    assert record.closed_early  # the stalled request was cancelled, not left hanging


@pytest.mark.parametrize("rig", [{"deadline": 2.0}], indirect=True)
async def test_dead_llm_gives_a_fallback_line(rig: Rig) -> None:
    await rig.server.close()  # connections are refused from now on
    rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
    (say,) = await rig.world.wait_says(1, within=6)
    assert say.source == "fallback"


async def test_repeated_line_is_regenerated_without_the_copied_line_in_history(rig: Rig) -> None:
    rig.server.script(
        Answer.text("いらっしゃいませ。"),
        Answer.text("いらっしゃいませ。"),
        Answer.text("またお会いできてうれしいです。"),
    )
    rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
    await rig.world.wait_says(1)
    rig.dispatcher.handle(talk("cafe-minori", "alice", "また来たよ"))
    says = await rig.world.wait_says(2)
    assert says[1].source == "regenerated" and says[1].text == "またお会いできてうれしいです。"
    retry = rig.server.requests[2].messages
    assert not any(m["role"] == "assistant" and m["content"] == "いらっしゃいませ。" for m in retry)


async def test_two_failed_tries_give_fallback_lines_never_twice_in_a_row(rig: Rig) -> None:
    rig.server.default = "[happy]<にっこり>"  # cleans to nothing every time
    for n in range(3):
        rig.dispatcher.handle(talk("cafe-minori", f"p{n}", "こんにちは"))
    says = await rig.world.wait_says(3)
    assert [s.source for s in says] == ["fallback"] * 3
    assert says[0].text != says[1].text != says[2].text
    assert len(rig.server.requests) == 6  # one try and one regeneration each


async def test_stream_is_closed_once_two_sentences_are_complete(rig: Rig) -> None:
    text = "はい、こちらです。温かいうちにどうぞ。今日は豆がいいんです。ごゆっくり。"
    rig.server.script(Answer.text(text, piece_chars=2, delay_seconds=0.03))
    rig.dispatcher.handle(talk("cafe-minori", "alice", "コーヒーください"))
    (say,) = await rig.world.wait_says(1)
    assert say.text == "はい、こちらです。温かいうちにどうぞ。"
    record = await rig.server.requests[0].wait_ended()
    assert record.closed_early and record.pieces_sent < record.pieces_planned


@pytest.mark.parametrize("rig", [{"concurrency": 1}], indirect=True)
async def test_requests_in_flight_never_exceed_the_concurrency(rig: Rig) -> None:
    rig.server.default = Answer.text("いらっしゃいませ。", delay_seconds=0.03)
    for npc in ("cafe-minori", "cinema-aoi", "ryokan-fumi"):
        rig.dispatcher.handle(talk(npc, "alice", "こんにちは"))
    await rig.world.wait_says(3)
    arrivals = sorted(r.received_at for r in rig.server.requests)
    # Each request reaches the server only after the previous reply was said.
    assert len(arrivals) == 3
    assert all(arrival >= said for arrival, said in zip(arrivals[1:], rig.world.said_at, strict=False))


async def test_world_event_reaches_the_next_prompt_and_the_pending_memory(rig: Rig) -> None:
    rig.server.default = "どうぞごゆっくり。"
    rig.dispatcher.handle(
        NpcEvent(
            npcId="cafe-minori",
            playerId="alice",
            kind="serve",
            text="お待たせしました、コーヒーです。",
            at=time.time() * 1000,
        )
    )
    rig.dispatcher.handle(talk("cafe-minori", "alice", "ありがとう"))
    await rig.world.wait_says(1)
    system = rig.server.requests[0].messages[0]
    assert system["role"] == "system" and "お待たせしました、コーヒーです。" in system["content"]
    await eventually(lambda: len(read_file(rig.memory_dir, "cafe-minori")["pending"]) == 2)
    pending = read_file(rig.memory_dir, "cafe-minori")["pending"]
    assert [(p["player"], p["npc"]) for p in pending] == [
        ("", "お待たせしました、コーヒーです。"),
        ("ありがとう", "どうぞごゆっくり。"),
    ]


async def test_a_slow_memory_write_for_a_world_event_does_not_hold_up_the_next_talk(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bridge.memory.store as store_module

    real_fsync_dir = store_module._fsync_dir

    def slow_disk(directory: Path) -> None:
        real_fsync_dir(directory)
        time.sleep(0.5)

    monkeypatch.setattr(store_module, "_fsync_dir", slow_disk)
    rig.server.default = "どうぞごゆっくり。"
    served = NpcEvent(
        npcId="cafe-minori", playerId="alice", kind="serve", text="お待たせしました。", at=time.time() * 1000
    )
    rig.dispatcher.handle(served)
    started = time.monotonic()
    rig.dispatcher.handle(talk("cafe-minori", "alice", "ありがとう"))
    await rig.server.wait_for_requests(1)
    assert time.monotonic() - started < 0.3  # not behind the event's 0.5 s write
    await rig.world.wait_says(1)
    await eventually(lambda: len(read_file(rig.memory_dir, "cafe-minori")["pending"]) == 2, timeout_seconds=5)
    assert [p["player"] for p in read_file(rig.memory_dir, "cafe-minori")["pending"]] == ["", "ありがとう"]


async def test_talk_to_an_npc_the_bridge_does_not_voice_is_ignored(rig: Rig) -> None:
    rig.dispatcher.handle(talk("mayor-tanaka", "alice", "こんにちは"))
    await asyncio.sleep(0.2)
    assert rig.world.says == [] and rig.server.requests == []


async def test_drain_answers_the_reply_in_flight_with_a_fallback_after_the_grace(rig: Rig) -> None:
    rig.server.script(stall("ええと"))
    line = talk("cafe-minori", "alice", "こんにちは")
    queued = talk("cafe-minori", "bob", "こんばんは")
    rig.dispatcher.handle(line)
    rig.dispatcher.handle(queued)
    await rig.server.wait_for_requests(1)
    started = time.monotonic()
    await rig.dispatcher.drain(0.3)
    assert time.monotonic() - started < 2.0
    assert [(s.reply_to, s.source) for s in rig.world.says] == [(line.id, "fallback")]


async def test_drain_right_after_a_say_while_memory_is_noted_is_quiet(rig: Rig) -> None:
    rig.server.default = "いらっしゃいませ。"
    rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
    await rig.world.wait_says(1)
    # The worker is still writing the exchange to the memory file: its reply's deadline scope has
    # ended and must not be rescheduled.
    await rig.dispatcher.drain(0.3)
    assert len(rig.world.says) == 1


async def test_inline_memory_is_cut_from_the_spoken_line_and_stored_after_the_checks(rig: Rig) -> None:
    rig.server.default = (
        "[happy]おかえり！今日はどうだった？\n<memory>\n- ユーザーは猫を飼っている\n- ユーザーは今日は眠い\n</memory>"
    )
    rig.dispatcher.handle(talk("haruno", "alice", "ただいま。うちの猫がかわいくてさ"))
    (say,) = await rig.world.wait_says(1)
    assert (say.text, say.emotion) == ("おかえり！今日はどうだった？", "happy")
    assert "<memory>" in rig.server.requests[0].messages[0]["content"]
    path = rig.memory_dir / "haruno.json"
    async with asyncio.timeout(5):
        while not path.exists():  # noqa: ASYNC110 - the memory is stored right after the say
            await asyncio.sleep(0.02)
    stored = json.loads(path.read_text(encoding="utf-8"))["memories"]
    assert [m["text"] for m in stored] == ["ユーザーは猫を飼っている"]  # the mood of the day was rejected


async def test_full_queue_drops_the_oldest_waiting_line_with_a_log(rig: Rig) -> None:
    from structlog.testing import capture_logs

    from bridge.npc.dispatcher import MAX_QUEUED_LINES_PER_NPC

    rig.server.script(stall("ええと"))  # the first line holds the NPC
    rig.dispatcher.handle(talk("ryokan-fumi", "first", "こんにちは"))
    await rig.server.wait_for_requests(1)
    waiting = [talk("ryokan-fumi", f"p{n}", "こんにちは") for n in range(MAX_QUEUED_LINES_PER_NPC + 1)]
    with capture_logs() as logs:
        for line in waiting:
            rig.dispatcher.handle(line)
    dropped = [e for e in logs if e["event"] == "talk_dropped"]
    assert [(e["event_id"], e["reason"]) for e in dropped] == [(waiting[0].id, "queue full")]
    await rig.dispatcher.drain(0.2)


async def test_the_next_line_does_not_wait_for_the_memory_write_of_the_last(rig: Rig) -> None:
    memory = rig.dispatcher._path.memory
    writes: list[tuple[str, float]] = []

    class SlowDisk:
        """The keeper behind a disk that takes 0.5 s per write."""

        def __getattr__(self, name: str) -> Any:
            return getattr(memory, name)

        async def note_exchange(self, npc_id: str, *, player: str, npc: str, at: Any) -> None:
            await asyncio.sleep(0.5)
            writes.append((player, time.monotonic()))
            await memory.note_exchange(npc_id, player=player, npc=npc, at=at)

    rig.dispatcher._path.memory = SlowDisk()
    rig.server.default = "いらっしゃいませ。"
    for text in ("一つ目", "二つ目"):
        rig.dispatcher.handle(talk("cafe-minori", f"p-{text}", text))
    await rig.world.wait_says(2)
    second_request = rig.server.requests[1].received_at
    await rig.dispatcher.drain(1.0)  # waits for the writes
    assert [player for player, _ in writes] == ["一つ目", "二つ目"]  # in order
    assert second_request < writes[0][1]  # the second reply did not wait for the first write
