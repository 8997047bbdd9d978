"""The responder on its own, against a real loopback Ollama fake: hints in the character's language, the deadline."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bridge.llm.ollama import OllamaBackend
from bridge.npc.characters import load_roster
from bridge.npc.deadline import Deadline
from bridge.npc.responder import ReplyContext, Responder
from bridge.settings import load_settings
from bridge.speech import Emotion
from tests.fakes.llm_servers import Answer, FakeOllama, stall

REPO = Path(__file__).resolve().parents[2]

ENGLISH_BARISTA = {
    "id": "cafe-sam",
    "name": "Sam the Barista",
    "speaker_name": "Sam",
    "persona": "A friendly barista at the town cafe.",
    "staff": {"talk": "worker", "role": "Works behind the counter of the town cafe."},
    "speech": {"first_person": "I", "style": "friendly, short", "language": "en", "examples": []},
    "fallbacks": ["Sorry, one moment please.", "Could you say that again?"],
    "banned": [],
}


def _english_roster(tmp_path: Path) -> Path:
    folder = tmp_path / "characters"
    folder.mkdir()
    (folder / "cafe-sam.json").write_text(json.dumps(ENGLISH_BARISTA), encoding="utf-8")
    return folder


async def test_an_english_character_gets_its_regeneration_hint_in_english(tmp_path: Path) -> None:
    async with FakeOllama() as server:
        server.script(Answer.text("[happy]<smiles>"), Answer.text("Welcome in! What can I get you?"))
        settings = load_settings(llm_url=server.url, characters_dir=_english_roster(tmp_path), memory_dir=tmp_path)
        roster = load_roster(settings.characters_dir)
        backend = OllamaBackend(server.url)
        try:
            responder = Responder(backend=backend, settings=settings, roster=roster)
            context = ReplyContext(character=roster.characters["cafe-sam"], player_line="Hi there", player_name="Ann")
            reply = await responder.respond(context, deadline=Deadline.after(10))
        finally:
            await backend.aclose()
    assert (reply.text, reply.source, reply.failed_rules) == (
        "Welcome in! What can I get you?",
        "regenerated",
        ["empty"],
    )
    retry = server.requests[1].messages[-1]["content"]
    assert "Answer with a short spoken line only." in retry
    assert not any("\u3040" <= char <= "\u30ff" for char in retry)  # no kana: no Japanese hint


async def test_a_reply_gets_only_what_is_left_of_its_deadline(tmp_path: Path) -> None:
    async with FakeOllama() as server:
        server.default = stall("ええと")
        settings = load_settings(llm_url=server.url, characters_dir=REPO / "characters", memory_dir=tmp_path)
        roster = load_roster(settings.characters_dir)
        backend = OllamaBackend(server.url)
        parts: list[tuple[int, str, Emotion]] = []

        async def sink(index: int, text: str, emotion: Emotion) -> None:
            parts.append((index, text, emotion))

        try:
            responder = Responder(backend=backend, settings=settings, roster=roster)
            context = ReplyContext(
                character=roster.characters["cafe-minori"], player_line="こんにちは", player_name="旅人"
            )
            # The line arrived 0.7 s ago with a 1 s deadline: 0.3 s are left for the model.
            arrived = time.monotonic() - 0.7
            started = time.monotonic()
            reply = await responder.respond(context, deadline=Deadline.after(1.0, since=arrived), on_part=sink)
            took = time.monotonic() - started
        finally:
            await backend.aclose()
    assert reply.source == "fallback" and reply.error == "deadline" and parts == []
    assert 0.2 < took < 0.9


async def test_each_part_logs_when_its_chunk_was_read_and_how_long_the_bridge_held_it(tmp_path: Path) -> None:
    """The debug line the benchmark (part 7) splits part 0's delay with: one per part, read before handed."""
    from structlog.testing import capture_logs

    async with FakeOllama() as server:
        server.default = Answer(("[happy]いらっしゃいませ。", "今日は", "寒いですね。", "ほかに"), delay_seconds=0.05)
        settings = load_settings(llm_url=server.url, characters_dir=REPO / "characters", memory_dir=tmp_path)
        roster = load_roster(settings.characters_dir)
        backend = OllamaBackend(server.url)
        handed_at: list[float] = []

        async def sink(index: int, text: str, emotion: Emotion) -> None:
            handed_at.append(time.time())

        try:
            responder = Responder(backend=backend, settings=settings, roster=roster)
            context = ReplyContext(
                character=roster.characters["cafe-minori"], player_line="こんにちは", player_name="旅人"
            )
            with capture_logs() as logs:
                reply = await responder.respond(context, deadline=Deadline.after(10.0), on_part=sink)
        finally:
            await backend.aclose()
    assert reply.parts == ["いらっしゃいませ。", "今日は寒いですね。"]
    handed = [entry for entry in logs if entry["event"] == "reply_part_handed"]
    assert [entry["index"] for entry in handed] == [0, 1]
    for entry, at in zip(handed, handed_at, strict=True):
        assert entry["read_at"] <= at
        assert 0 <= entry["held_ms"] <= (at - entry["read_at"]) * 1000 + 0.01
    # Part 0 is final only with the chunk after its end mark, part 1 with the one after its own.
    assert handed[1]["read_at"] - handed[0]["read_at"] >= 0.04
