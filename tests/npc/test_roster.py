"""The roster's per-character speaker names: known once per character, swapped by `replace`, and a reply
costs the same whatever the size of the cast (measured by work done and memory kept, not by time)."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from bridge.llm.ollama import OllamaBackend
from bridge.npc.characters import Character, Roster, load_roster
from bridge.npc.cleaner import clean
from bridge.npc.deadline import Deadline
from bridge.npc.responder import CastSpeakers, Reply, ReplyContext, Responder
from bridge.npc.streaming import has_enough
from bridge.settings import load_settings
from tests.fakes.llm_servers import FakeOllama

REPO = Path(__file__).resolve().parents[2]
RAW = "[happy]いらっしゃいませ。ご注文はお決まりですか？\nゆき：こんにちは。"


def staff(npc_id: str, name: str, speaker_name: str | None = None) -> Character:
    return Character.model_validate(
        {
            "id": npc_id,
            "name": name,
            "speaker_name": speaker_name,
            "persona": "店員。",
            "staff": {"talk": "worker", "role": "店の前に立っている。"},
        }
    )


def generated_roster(count: int) -> Roster:
    characters = [staff(f"npc-{n}", f"店員{n}号", f"てん{n}") for n in range(count)]
    return Roster({c.id: c for c in characters})


class Rig:
    def __init__(self, server: FakeOllama, responder: Responder, roster: Roster) -> None:
        self.server, self.responder, self.roster = server, responder, roster

    async def reply(self, npc_id: str, raw: str, player_name: str = "旅人1") -> Reply:
        self.server.script(raw)
        character = self.roster.get(npc_id)
        assert character is not None
        context = ReplyContext(character=character, player_line="こんにちは", player_name=player_name)
        return await self.responder.respond(context, deadline=Deadline.after(10))


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with FakeOllama() as server:
        settings = load_settings(llm_url=server.url, characters_dir=REPO / "characters", memory_dir=tmp_path)
        roster = load_roster(settings.characters_dir)
        backend = OllamaBackend(server.url)
        try:
            yield Rig(server, Responder(backend=backend, settings=settings, roster=roster), roster)
        finally:
            await backend.aclose()


async def test_a_reply_stops_before_another_voiced_characters_label(rig: Rig) -> None:
    for other in ("あおい", "映画館のあおい", "ふみさん", "旅人1"):
        reply = await rig.reply("cafe-minori", f"いらっしゃいませ。\n{other}：映画はいかが？")
        assert (reply.text, reply.source) == ("いらっしゃいませ。", "generated"), other


async def test_a_replaced_roster_cuts_at_the_new_casts_names_and_no_longer_at_the_old(rig: Rig) -> None:
    minori = rig.roster.get("cafe-minori")
    assert minori is not None
    rig.roster.replace({"cafe-minori": minori, "yuki": staff("yuki", "雑貨屋のゆき", "ゆき")})
    assert sorted(rig.roster.voiced) == ["cafe-minori", "yuki"]
    # The responder holds the same roster: it sees the new cast without being rebuilt.
    cut = await rig.reply("cafe-minori", "いらっしゃいませ。\nゆき：こんにちは。")
    assert cut.text == "いらっしゃいませ。"
    kept = await rig.reply("cafe-minori", "はい。あおい：映画館の人ですね。")
    assert kept.text == "はい。あおい：映画館の人ですね。"


def test_a_character_is_never_another_speaker_to_itself() -> None:
    roster = Roster({"a": staff("a", "カフェのみのり", "みのり"), "b": staff("b", "映画館のあおい", "あおい")})
    a = roster.get("a")
    assert a is not None
    own = [a.name, a.short_name]
    # A player who named themselves after the NPC is not another speaker either.
    speakers = CastSpeakers(roster)
    others = speakers.of(a, "みのり")
    cleaned = clean("みのり：はい、どうぞ。", own_names=own, other_speakers=others, max_sentences=2, max_chars=90)
    assert cleaned.text == "はい、どうぞ。"
    assert "あおい" in others and "user" in others and "みのり" not in others
    # The few names a streamed label check must look at one by one are known without walking the cast.
    assert speakers.of(a, "Mr. Sato").spanning == ["mr. sato"]
    kato = Roster({"a": a, "k": staff("k", "Dr. Kato")})
    kato_self = kato.get("k")
    assert kato_self is not None
    assert CastSpeakers(kato).of(a).spanning == ["dr. kato"] and CastSpeakers(kato).of(kato_self).spanning == []
    # A character object from before a replace still gets the current cast's names.
    roster.replace({"b": staff("b", "映画館のゆき", "ゆき"), "c": staff("c", "旅館のふみ", "ふみ")})
    assert "ふみ" in speakers.of(a, "旅人") and "旅人" in speakers.of(a, "旅人")
    assert "あおい" not in speakers.of(a, "旅人")  # the name of no one in the new cast


def _reply_path(roster: Roster, speakers: CastSpeakers, player_name: str) -> None:
    """What a reply does with the roster and the cleaner: the per-reply names, streaming checks, clean."""
    character = roster.get("npc-1")
    assert character is not None
    own = [character.name, character.short_name]
    others = speakers.of(character, player_name)
    for end in range(4, len(RAW), 4):
        has_enough(RAW[:end], own_names=own, other_speakers=others, max_sentences=2)
    assert clean(RAW, own_names=own, other_speakers=others, max_sentences=2, max_chars=90).text == (
        "いらっしゃいませ。ご注文はお決まりですか？"
    )


def _lines_run(work: Callable[[], None]) -> int:
    count = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()  # a coverage tracer, say: put back afterwards
    sys.settrace(tracer)
    try:
        work()
    finally:
        sys.settrace(previous)
    return count


def test_the_reply_path_runs_the_same_lines_for_3_and_1000_characters() -> None:
    small, large = generated_roster(3), generated_roster(1000)
    at_3, at_1000 = CastSpeakers(small), CastSpeakers(large)
    _reply_path(small, at_3, "warm-up")
    _reply_path(large, at_1000, "warm-up")
    lines_at_1000 = _lines_run(lambda: _reply_path(large, at_1000, "新しい旅人"))
    assert lines_at_1000 == _lines_run(lambda: _reply_path(small, at_3, "新しい旅人"))


def test_new_players_leave_no_memory_behind_at_any_cast_size() -> None:
    for size in (3, 1000):
        roster = generated_roster(size)
        speakers = CastSpeakers(roster)
        _reply_path(roster, speakers, "warm-up")
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for n in range(300):
                _reply_path(roster, speakers, f"旅人{n}")
            kept = tracemalloc.take_snapshot().compare_to(before, "filename")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        grown = sum(stat.size_diff for stat in kept if "bridge" in stat.traceback[0].filename)
        # 300 new players: no cache of name sets per player (a set of 2N names each, before).
        assert grown < 64 * 1024, (size, grown)
        # One reply never builds anything the size of the cast (a set of 2N folded names: >100 KiB at 1,000).
        assert peak < 64 * 1024, (size, peak)
