"""Sentence by sentence (replies.md "Sentence by sentence") and the deadline from arrival (issue 10).

The dispatcher against a real loopback Ollama fake; the world is a recorder that wants parts.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from structlog.testing import capture_logs

from bridge.llm.gate import Priority
from bridge.npc.characters import load_roster
from bridge.world.messages import SayPart
from tests.fakes.llm_servers import Answer, stall
from tests.npc.rig import REPO, Rig, talk

PARTS = {"parts": True}
TWO = "[happy]いらっしゃいませ。今日は何にしますか？"


def _spoken(rig: Rig) -> list[tuple[str, str]]:
    return [(kind, message.text) for kind, message in rig.world.spoken]


def _joined(parts: list[SayPart]) -> str:
    return "".join(part.text for part in parts)


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_each_final_sentence_is_a_part_before_the_one_say_which_holds_them_joined(rig: Rig) -> None:
    rig.server.script(Answer.text(TWO + "ごゆっくり。", piece_chars=2, delay_seconds=0.05))
    line = talk("cafe-minori", "alice", "こんにちは")
    rig.dispatcher.handle(line)
    (say,) = await rig.world.wait_says(1)
    assert _spoken(rig) == [
        ("part", "いらっしゃいませ。"),
        ("part", "今日は何にしますか？"),
        ("say", "いらっしゃいませ。今日は何にしますか？"),
    ]
    assert [(p.index, p.emotion, p.reply_to) for p in rig.world.parts] == [(0, "happy", line.id), (1, "happy", line.id)]
    assert (say.emotion, say.source) == ("happy", "generated")
    # Part 0 went out while the model was still writing: well before the say.
    assert rig.world.part_at[0] < rig.world.said_at[0] - 0.2
    record = await rig.server.requests[0].wait_ended()
    assert record.closed_early  # the line was complete: the third sentence was never read


async def test_a_world_that_wants_no_parts_gets_only_the_say(rig: Rig) -> None:
    rig.server.script(Answer.text(TWO, piece_chars=2))
    rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
    (say,) = await rig.world.wait_says(1)
    assert rig.world.parts == [] and say.text == "いらっしゃいませ。今日は何にしますか？"


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_a_banned_word_in_part_1_ends_the_line_with_part_0(rig: Rig) -> None:
    rig.server.script(Answer.text("いらっしゃいませ。殺人事件の映画ですね。ごゆっくり。", delay_seconds=0.02))
    with capture_logs() as logs:
        rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
        (say,) = await rig.world.wait_says(1)
    assert _spoken(rig) == [("part", "いらっしゃいませ。"), ("say", "いらっしゃいませ。")]
    assert say.source == "generated"
    assert len(rig.server.requests) == 1  # no regeneration, no fallback
    cut = [e for e in logs if e["event"] == "reply_part_cut"]
    assert [(e["rule"], e["index"]) for e in cut] == [("banned_word", 1)]
    said = next(e for e in logs if e["event"] == "reply_said")
    assert (said["parts"], said["cut_rule"]) == (1, "banned_word")
    assert said["first_part_ms"] is not None and said["first_part_ms"] > 0


@pytest.mark.parametrize("rig", [{"parts": True, "deadline": 1.0}], indirect=True)
async def test_the_deadline_after_part_0_ends_the_line_with_part_0(rig: Rig) -> None:
    rig.server.script(stall("[relaxed]いらっしゃ", "いませ。", "今日", delay_seconds=0.02))
    started = time.monotonic()
    rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
    (say,) = await rig.world.wait_says(1, within=5)
    assert time.monotonic() - started < 1.0 + 0.5
    assert _spoken(rig) == [("part", "いらっしゃいませ。"), ("say", "いらっしゃいませ。")]
    assert (say.source, say.emotion) == ("generated", "relaxed")
    record = await rig.server.requests[0].wait_ended()
    assert record.closed_early


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_an_llm_error_after_part_0_ends_the_line_with_part_0(rig: Rig) -> None:
    rig.server.script(Answer.text("いらっしゃいませ。今日は何に", piece_chars=3, drop_after=4))
    rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
    (say,) = await rig.world.wait_says(1)
    assert _spoken(rig) == [("part", "いらっしゃいませ。"), ("say", "いらっしゃいませ。")]
    assert say.source == "generated"


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_an_llm_error_before_any_part_gives_a_fallback_never_in_parts(rig: Rig) -> None:
    rig.server.script(Answer.text("いらっしゃ", piece_chars=2, drop_after=2))
    rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
    (say,) = await rig.world.wait_says(1)
    assert say.source == "fallback" and rig.world.parts == []


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_a_failing_part_0_is_regenerated_and_the_second_try_streams_parts(rig: Rig) -> None:
    rig.server.script(
        Answer.text("殺人的な暑さですね。ごゆっくりどうぞ。", piece_chars=2, delay_seconds=0.03),
        Answer.text("暑いですね。冷たいお飲み物はいかがですか？", piece_chars=2),
    )
    rig.dispatcher.handle(talk("cafe-minori", "alice", "暑いね"))
    (say,) = await rig.world.wait_says(1)
    assert _spoken(rig) == [
        ("part", "暑いですね。"),
        ("part", "冷たいお飲み物はいかがですか？"),
        ("say", "暑いですね。冷たいお飲み物はいかがですか？"),
    ]
    assert [p.index for p in rig.world.parts] == [0, 1]
    assert say.source == "regenerated"
    first = await rig.server.requests[0].wait_ended()
    assert first.closed_early  # given up at its failing first sentence
    assert "使ってはいけない言葉" in rig.server.requests[1].messages[-1]["content"]


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_two_failing_first_parts_give_a_fallback_and_no_part(rig: Rig) -> None:
    rig.server.default = "殺人的な暑さですね。ごゆっくり。"
    rig.dispatcher.handle(talk("cafe-minori", "alice", "暑いね"))
    (say,) = await rig.world.wait_says(1)
    assert say.source == "fallback" and rig.world.parts == []


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_a_part_0_equal_to_the_last_line_waits_for_the_whole_line(rig: Rig) -> None:
    rig.server.script(
        Answer.text("いらっしゃいませ。"),
        Answer.text("いらっしゃいませ。今日は何にしますか？", piece_chars=2),
        Answer.text("いらっしゃいませ。今日は何にしますか？", piece_chars=2),
        Answer.text("またお会いできましたね。"),
    )
    lines = [talk("cafe-minori", "alice", text) for text in ("こんにちは", "また来たよ", "こんにちは")]
    rig.dispatcher.handle(lines[0])
    await rig.world.wait_says(1)
    rig.dispatcher.handle(lines[1])
    await rig.world.wait_says(2)
    # Not a repeat once the line went on: both sentences said, in order.
    assert _spoken(rig)[2:] == [
        ("part", "いらっしゃいませ。"),
        ("part", "今日は何にしますか？"),
        ("say", "いらっしゃいませ。今日は何にしますか？"),
    ]
    rig.dispatcher.handle(lines[2])
    says = await rig.world.wait_says(3)
    # The whole line repeated the last one: regenerated, and no sentence of the copy was said.
    assert (says[2].text, says[2].source) == ("またお会いできましたね。", "regenerated")
    assert [p.text for p in rig.world.parts if p.reply_to == lines[2].id] == ["またお会いできましたね。"]


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_inline_memory_characters_send_the_spoken_sentences_never_the_block(rig: Rig) -> None:
    rig.server.default = "[happy]おかえり！今日はどうだった？\n<memory>\n- ユーザーは猫を飼っている\n</memory>"
    rig.dispatcher.handle(talk("haruno", "alice", "ただいま。うちの猫がかわいくてさ"))
    (say,) = await rig.world.wait_says(1)
    assert [p.text for p in rig.world.parts] == ["おかえり！", "今日はどうだった？"]
    assert (say.text, say.emotion) == ("おかえり！今日はどうだった？", "happy")
    path = rig.memory_dir / "haruno.json"
    async with asyncio.timeout(5):
        while not path.exists():  # noqa: ASYNC110 - the memory is stored right after the say
            await asyncio.sleep(0.02)
    assert [m["text"] for m in json.loads(path.read_text(encoding="utf-8"))["memories"]] == ["ユーザーは猫を飼っている"]


@pytest.mark.parametrize("rig", [PARTS], indirect=True)
async def test_a_bug_after_part_0_still_ends_the_line_with_what_was_said(rig: Rig) -> None:
    recorded = rig.world.say_part

    async def breaks_at_part_1(message: SayPart) -> None:
        if message.index == 1:
            raise RuntimeError("a bug in the reply path")
        await recorded(message)

    rig.world.say_part = breaks_at_part_1  # type: ignore[method-assign]
    rig.server.script(Answer.text(TWO, piece_chars=2))
    rig.dispatcher.handle(talk("cafe-minori", "alice", "こんにちは"))
    (say,) = await rig.world.wait_says(1)
    assert _spoken(rig) == [("part", "いらっしゃいませ。"), ("say", "いらっしゃいませ。")]
    assert say.emotion == "happy"


# ---- the deadline counts from arrival (issue 10) ---------------------------------------------------


@pytest.mark.parametrize("rig", [{"deadline": 1.0}], indirect=True)
async def test_lines_queued_behind_a_stalled_model_are_each_answered_within_the_deadline_of_arrival(
    rig: Rig,
) -> None:
    rig.server.default = stall("ええと")
    arrived: dict[str, float] = {}
    for player in ("alice", "bob", "carol"):
        line = talk("ryokan-fumi", player, "温泉はどこ？")
        arrived[line.id] = time.monotonic()
        rig.dispatcher.handle(line)
        await asyncio.sleep(0.2)
    says = await rig.world.wait_says(3, within=6)
    late = {
        say.reply_to: round(said - arrived[say.reply_to], 2)
        for say, said in zip(says, rig.world.said_at, strict=True)
    }
    assert all(seconds <= 1.0 + 0.5 for seconds in late.values()), late
    assert [s.source for s in says] == ["fallback"] * 3
    fallbacks = load_roster(REPO / "characters").characters["ryokan-fumi"].fallbacks
    assert all(s.text in fallbacks for s in says)


@pytest.mark.parametrize("rig", [{"deadline": 0.6}], indirect=True)
async def test_a_line_whose_deadline_passed_waiting_for_the_llm_slot_is_never_sent(rig: Rig) -> None:
    await rig.gate.acquire(Priority.EXTRACTION)  # the LAN machine is busy with a long extraction
    started = time.monotonic()
    with capture_logs() as logs:
        rig.dispatcher.handle(talk("cinema-aoi", "alice", "こんにちは"))
        (say,) = await rig.world.wait_says(1, within=5)
    assert time.monotonic() - started < 0.6 + 0.5
    assert say.source == "fallback"
    rig.gate.release()
    await asyncio.sleep(0.2)
    assert rig.server.requests == []  # never sent to the LLM
    assert any(e["event"] == "reply_deadline_passed" and e["where"] == "llm slot" for e in logs)
