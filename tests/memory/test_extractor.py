"""The extraction call: its prompt, parsing what the model wrote, and the streaming early stop."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime

import pytest

from bridge.llm._http import RetryPolicy
from bridge.llm.ollama import OllamaBackend
from bridge.memory.checks import comparable
from bridge.memory.extractor import (
    EXTRACTION_DEADLINE_SECONDS,
    EXTRACTION_INSTRUCTIONS,
    MEMORIES_SCHEMA,
    extract,
    extraction_instructions,
    extraction_messages,
    first_json_object_complete,
    parse_memories,
)
from bridge.memory.models import PendingLine
from tests.fakes.llm_servers import Answer, FakeOllama, stall

FAST_RETRY = RetryPolicy(first_delay_seconds=0.01, max_delay_seconds=0.02, max_attempts=1)
AT = datetime(2026, 9, 29, 12, 0, tzinfo=UTC)
CONVERSATION = (
    PendingLine(player="ここの紅茶がすきなんだよ", npc="紅茶、お好きなんですね。", at=AT),
    PendingLine(player="", npc="お待たせしました、紅茶です。", at=AT),
)


# --- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ('{"memories": ["ユーザーは紅茶が好き"]}', ["ユーザーは紅茶が好き"]),
        ('```json\n{"memories": ["ユーザーは紅茶が好き"]}\n```', ["ユーザーは紅茶が好き"]),
        ('はい、こちらです: {"memories": ["ユーザーは紅茶が好き"]} 以上です。', ["ユーザーは紅茶が好き"]),
        ('{"memories": ["a"]}{"memories": ["b"]}', ["a"]),
        ('{"memories": ["a"]}<assistant {"memories": ["b"]}', ["a"]),
        ('{"memories": ["a"]}<|im_end|>', ["a"]),
        ('{"memories": ["括弧 } と { を含む", "引用 \\" も"]}', ["括弧 } と { を含む", '引用 " も']),
        ('{"memories": {"nested": {"x": 1}}}', []),
        ('{"other": 1}', []),
        ('{"memories": "ユーザーは紅茶が好き"}', []),
        ('{"memories": [1, null, "ユーザーは紅茶が好き"]}', [1, None, "ユーザーは紅茶が好き"]),
        ('{name} は不明です。{"memories": ["a"]}', ["a"]),  # prose braces that are not JSON are skipped
        ('{"memories": ["改行が\n入った"]}', ["改行が\n入った"]),  # a raw newline inside a string
    ],
)
def test_the_first_json_object_is_read(raw: str, expected: list[object]) -> None:
    assert parse_memories(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "覚えておくことはありません。",
        '{"memories": ["ユーザーは紅茶が好き", "ユーザーは',  # cut by the token limit
        '<|assistant|>{"memories": ["a"]}',  # everything after a template marker is discarded
        '<end_of_turn>{"memories": ["a"]}',
        "[1, 2, 3]",
    ],
)
def test_no_parseable_object_is_none(raw: str) -> None:
    assert parse_memories(raw) is None


def test_the_recorded_template_leak_keeps_only_the_first_answer() -> None:
    raw = (
        '{"memories": ["ユーザーは紅茶が好き"]}<assistant {"memories": '
        '["ユーザーは明日、10 月 4 日の来店を予定している"]}'
    )
    assert parse_memories(raw) == ["ユーザーは紅茶が好き"]


@pytest.mark.parametrize(
    ("text", "complete"),
    [
        ("", False),
        ('{"memories": ["ユーザーは', False),
        ('{"memories": ["}"', False),
        ('{"memories": []', False),
        ('{"memories": []}', True),
        ('```json\n{"memories": ["a", "b"]}', True),
        ('{"memories": ["a"]}, "more": [', True),
    ],
)
def test_first_json_object_complete_while_streaming(text: str, complete: bool) -> None:
    assert first_json_object_complete(text) is complete


# --- the prompt ----------------------------------------------------------------------------------


def test_the_prompt_gives_today_and_the_conversation_only() -> None:
    system, user = extraction_messages(CONVERSATION, today=date(2026, 9, 29), subject="ユーザー")
    assert system.role == "system" and user.role == "user"
    assert system.content == EXTRACTION_INSTRUCTIONS
    assert "2026年9月29日" in user.content
    assert "ユーザー: ここの紅茶がすきなんだよ" in user.content
    assert "紅茶、お好きなんですね。" in user.content
    assert "お待たせしました、紅茶です。" in user.content


def test_the_instructions_hold_no_example_facts_dates_or_names() -> None:
    # Small models copy whatever concrete thing the prompt shows into invented memories.
    for text in (EXTRACTION_INSTRUCTIONS, extraction_instructions("User")):
        assert not any(ch.isdigit() and ch not in "03" for ch in text)  # only "0 to 3 items"
        assert "「ユーザーは" not in text and "ユーザーは紅茶" not in text
        assert "memories" in text


def test_the_instructions_start_memories_with_the_configured_subject() -> None:
    english = extraction_instructions("User")
    assert 'starts with "User"' in english
    assert "「ユーザー」で始める" in EXTRACTION_INSTRUCTIONS


def test_the_instructions_share_no_eight_character_run_with_the_recorded_good_memories() -> None:
    # A real memory must never look like a copy of the prompt.
    instructions = comparable(EXTRACTION_INSTRUCTIONS)
    for memory in (
        "ユーザーは最近、昔のSF映画をよく見ている",
        "ユーザーは来週の土曜に友だちとキャンプに行く予定",
    ):
        probe = comparable(memory)
        assert not any(probe[i : i + 8] in instructions for i in range(len(probe) - 7))


# --- the call, against a loopback Ollama ------------------------------------------------------------


async def extract_from(
    server: FakeOllama, deadline_seconds: float = EXTRACTION_DEADLINE_SECONDS
) -> list[str] | None:
    """One extraction of CONVERSATION against `server`, as the keeper asks for it."""
    backend = OllamaBackend(server.url, retry=FAST_RETRY)
    try:
        return await extract(
            backend,
            CONVERSATION,
            model="elyza-jp-8b",
            lane=None,
            today=date(2026, 9, 29),
            subject="ユーザー",
            deadline_seconds=deadline_seconds,
        )
    finally:
        await backend.aclose()


async def test_extract_sends_a_json_schema_request_at_temperature_zero() -> None:
    async with FakeOllama() as server:
        server.script('{"memories": ["ユーザーは紅茶が好き"]}')
        found = await extract_from(server)
    assert found == ["ユーザーは紅茶が好き"]
    body = server.requests[0].body
    assert body["format"] == MEMORIES_SCHEMA
    assert body["options"]["temperature"] == 0
    assert body["options"]["num_predict"] == 256
    assert [m["role"] for m in body["messages"]] == ["system", "user"]


async def test_extract_closes_the_stream_once_the_first_object_is_complete() -> None:
    endless = '{"memories": ["ユーザーは紅茶が好き"]}' + json.dumps({"memories": ["x"] * 50})
    async with FakeOllama() as server:
        # The model keeps writing after the object: the stream must be closed without waiting.
        server.script(stall(*[endless[i : i + 6] for i in range(0, 60, 6)]))
        found = await extract_from(server, deadline_seconds=5)
        record = await server.requests[0].wait_ended()
    assert found == ["ユーザーは紅茶が好き"]
    assert record.closed_early


async def test_extract_stops_at_a_leaked_template_marker() -> None:
    async with FakeOllama() as server:
        server.script(stall("ごめんなさい", "<|im_end|>", '{"memories": ["a"]}'))
        found = await extract_from(server, deadline_seconds=5)
    assert found is None


async def test_extract_gives_up_at_its_deadline() -> None:
    async with FakeOllama() as server:
        server.script(stall('{"memories": ["ユーザーは'))
        with pytest.raises(TimeoutError):
            await extract_from(server, deadline_seconds=0.3)


async def test_an_answer_that_ends_without_an_object_is_none() -> None:
    async with FakeOllama() as server:
        server.script(Answer.text("覚えておくことはありません。"))
        found = await extract_from(server)
    assert found is None
