"""Shared pieces of the backend tests: requests, a fast retry policy, a stream collector."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from bridge.llm._http import RetryPolicy
from bridge.llm.base import (
    TEMPLATE_STOP_STRINGS,
    ChatMessage,
    Chunk,
    Done,
    GenerationRequest,
    GenerationStats,
    TextChunk,
)

MODEL = "elyza-jp-8b"
# Short, jitter-free delays: the tests count attempts and read the logged delays.
FAST_RETRY = RetryPolicy(first_delay_seconds=0.05, max_delay_seconds=0.2, max_attempts=4, jitter=0.0)
MEMORY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"memories": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["memories"],
}
MESSAGES = (
    ChatMessage("system", "あなたは喫茶店の店員です。"),
    ChatMessage("user", "こんにちは"),
)
# Four sentences, two pieces each.
FOUR_SENTENCES = (
    "いらっしゃい", "ませ。",
    "今日は", "暑いですね。",
    "冷たいお茶", "はいかが？",
    "ケーキも", "ありますよ。",
)


def reply_request(**changes: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "messages": MESSAGES,
        "model": MODEL,
        "temperature": 0.7,
        "max_tokens": 120,
        "deadline_seconds": 10.0,
        "stop": TEMPLATE_STOP_STRINGS,
    }
    fields.update(changes)
    return GenerationRequest(**fields)


def extraction_request(**changes: Any) -> GenerationRequest:
    fields: dict[str, Any] = {
        "temperature": 0.0,
        "max_tokens": 256,
        "deadline_seconds": 10.0,
        "json_schema": MEMORY_SCHEMA,
        "kind": "extraction",
    }
    fields.update(changes)
    return reply_request(**fields)


async def collect(stream: AsyncIterator[Chunk]) -> tuple[list[str], GenerationStats]:
    """All text pieces and the stats of the one `Done`, checking that `Done` comes last, once."""
    pieces: list[str] = []
    done: list[Done] = []
    async with aclosing(stream) as chunks:
        async for chunk in chunks:
            assert not done, "nothing may follow Done"
            if isinstance(chunk, TextChunk):
                pieces.append(chunk.text)
            else:
                done.append(chunk)
    assert len(done) == 1
    return pieces, done[0].stats


async def read_until_sentences(stream: AsyncIterator[Chunk], sentences: int) -> str:
    """Read like the reply pipeline: stop (and close the stream) once `sentences` have ended."""
    text = ""
    async with aclosing(stream) as chunks:
        async for chunk in chunks:
            if isinstance(chunk, TextChunk):
                text += chunk.text
                if sum(text.count(mark) for mark in "。？！") >= sentences:
                    break
    return text


def refused_url() -> str:
    """A loopback URL where nothing listens: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
