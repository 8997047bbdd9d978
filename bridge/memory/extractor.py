"""The extraction call: a finished conversation → 0–3 candidate memories as JSON (memory.md, llm-backends.md).

The prompt is its own call, never folded into a reply. It holds no example facts, dates or names:
small models copy them into invented memories. It sees the conversation only, never recalled memories.
What the model writes is untrusted: `parse_memories` digs out the first JSON object and
`bridge.memory.checks` decides what is kept.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import date
from typing import Any

from bridge.llm.base import (
    ChatMessage,
    GenerationRequest,
    LLMBackend,
    TextChunk,
)
from bridge.markers import first_template_marker
from bridge.memory.models import PendingLine

EXTRACTION_MAX_TOKENS = 256
EXTRACTION_DEADLINE_SECONDS = 60.0
EXTRACTION_TEMPERATURE = 0.0
MAX_MEMORIES = 3

MEMORIES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"memories": {"type": "array", "items": {"type": "string"}, "maxItems": MAX_MEMORIES}},
    "required": ["memories"],
}

NPC_LABEL_JA = "相手"
NPC_LABEL_EN = "Other"

_INSTRUCTIONS_JA = "\n".join(
    (
        "あなたは会話の記録を読み、{subject}本人について、これから先も覚えておく価値のあることを書き出す係です。",
        "守ること:",
        "- {subject}が自分自身について話したことだけを書く。{npc}の発言、推測、会話に出ていないことは書かない。",
        "- 書くのは長く続くことだけ: 好みや苦手なもの、これからの予定、仕事や暮らしについての事実。",
        "- その日の気分や体の具合、その場でしている注文や選んでいる途中のものは書かない。",
        "- 話に出なかったこと、分からないこと、決まっていないことは書かない。",
        "- 一項目は短い一文にして、必ず「{subject}」で始める。",
        "- 時の言い方は言われたとおりに書き、日付に直さない。",
        "- 0個から3個まで。書くことがなければ空のリストにする。",
        '- 出力はJSONオブジェクト一つだけ: {{"memories": [文字列, ...]}}。ほかの文は書かない。',
    )
)

_INSTRUCTIONS_EN = "\n".join(
    (
        "You read a conversation record and write down what is worth remembering about the {subject} from now on.",
        "Rules:",
        "- Only what the {subject} said about themselves. Not what {npc} said, no guesses, nothing that was not said.",
        "- Only lasting things: likes and dislikes, plans, facts about their work or life.",
        "- Not the mood or how their body feels that day, not what they are ordering or choosing at the moment.",
        "- Nothing that was not mentioned, is unknown, or is undecided.",
        '- Each item is one short sentence and starts with "{subject}".',
        "- Keep time words as they were said; do not turn them into dates.",
        "- From 0 to 3 items. When there is nothing, give an empty list.",
        '- Answer with one JSON object only: {{"memories": [string, ...]}}. No other text.',
    )
)


def _english(subject: str) -> bool:
    # The subject word names the world's language: "ユーザー" in Japanese, "User" in English.
    return subject.isascii()


def extraction_instructions(subject: str) -> str:
    """The system prompt of the extraction call (also what the prompt_copy rule compares against)."""
    if _english(subject):
        return _INSTRUCTIONS_EN.format(subject=subject, npc=NPC_LABEL_EN)
    return _INSTRUCTIONS_JA.format(subject=subject, npc=NPC_LABEL_JA)


EXTRACTION_INSTRUCTIONS = extraction_instructions("ユーザー")


def conversation_text(conversation: Sequence[PendingLine | str], *, subject: str) -> str:
    """One line per turn, `subject: …` for the player and a neutral label for the NPC."""
    npc_label = NPC_LABEL_EN if _english(subject) else NPC_LABEL_JA
    lines: list[str] = []
    for item in conversation:
        if isinstance(item, str):
            lines.append(item)
            continue
        if item.player:
            lines.append(f"{subject}: {item.player}")
        if item.npc:
            lines.append(f"{npc_label}: {item.npc}")
    return "\n".join(lines)


def extraction_messages(
    conversation: Sequence[PendingLine | str], *, today: date, subject: str
) -> tuple[ChatMessage, ...]:
    """System (instructions) + user (today's date and the conversation) for one extraction."""
    body = conversation_text(conversation, subject=subject)
    if _english(subject):
        user = f"Today's date: {today.isoformat()}\nConversation:\n{body}"
    else:
        user = f"今日の日付: {today.year}年{today.month}月{today.day}日\n会話:\n{body}"
    return (ChatMessage("system", extraction_instructions(subject)), ChatMessage("user", user))


# --- parsing -------------------------------------------------------------------------------------


def cut_at_template_marker(text: str) -> str:
    """Everything before the first chat-template marker (memory.md "Parsing")."""
    cut = first_template_marker(text)
    return text if cut is None else text[:cut]


def _object_end(text: str, start: int) -> int | None:
    """Index after the `}` that balances the `{` at `start`; None while the object is unfinished."""
    depth = 0
    in_string = False
    escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def first_json_object(text: str) -> dict[str, Any] | None:
    """The first balanced `{…}` in `text` that is valid JSON; prose or fences around it are ignored.

    A balanced span that is not JSON (prose such as "{name}") is skipped as a whole, so an object
    nested inside a broken one is never taken for the answer.
    """
    start = text.find("{")
    while start != -1:
        end = _object_end(text, start)
        if end is None:
            return None
        try:
            value = json.loads(text[start:end], strict=False)  # strict=False: raw newlines in strings
        except ValueError:
            start = text.find("{", end)
            continue
        if isinstance(value, dict):
            return value
        start = text.find("{", end)
    return None


def parse_memories(raw: str) -> list[object] | None:
    """Candidates from what the model wrote; None when it holds no parseable JSON object.

    A parsed object whose `memories` is missing or not a list is zero candidates.
    """
    found = first_json_object(cut_at_template_marker(raw))
    if found is None:
        return None
    memories = found.get("memories")
    return list(memories) if isinstance(memories, list) else []


def first_json_object_complete(text_so_far: str) -> bool:
    """Whether a streamed answer already holds its first complete JSON object (stop reading then)."""
    return first_json_object(cut_at_template_marker(text_so_far)) is not None


def _leaked_template(text: str) -> bool:
    return first_template_marker(text) is not None


@asynccontextmanager
async def _closing(stream: AsyncIterator[Any]) -> AsyncIterator[AsyncIterator[Any]]:
    # contextlib.aclosing, for any async iterator: closing the stream closes the HTTP response, so the
    # server stops generating tokens nobody reads.
    try:
        yield stream
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def extract(
    backend: LLMBackend,
    conversation: Sequence[PendingLine | str],
    *,
    model: str,
    lane: str | None,
    today: date,
    subject: str,
    deadline_seconds: float = EXTRACTION_DEADLINE_SECONDS,
) -> list[object] | None:
    """One extraction call; None when the answer held no parseable object.

    Raises `bridge.errors.LLMError` when the call fails and `TimeoutError` past the deadline.
    """
    request = GenerationRequest(
        messages=extraction_messages(conversation, today=today, subject=subject),
        model=model,
        temperature=EXTRACTION_TEMPERATURE,
        max_tokens=EXTRACTION_MAX_TOKENS,
        deadline_seconds=deadline_seconds,
        json_schema=MEMORIES_SCHEMA,
        lane=lane,
        kind="extraction",
    )
    text = ""
    async with asyncio.timeout(deadline_seconds), _closing(backend.stream(request)) as stream:
        async for chunk in stream:
            if not isinstance(chunk, TextChunk):
                break  # Done: the server finished
            text += chunk.text
            # A small model asked for JSON may write an endless list: stop at the first object.
            if first_json_object_complete(text) or _leaked_template(text):
                break
    return parse_memories(text)
