"""OpenAIBackend against FakeOpenAI: SSE streaming, response_format fallback, stats, stops, retries."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest

from bridge.errors import LLMModelMissing, LLMUnavailable
from bridge.llm.base import TEMPLATE_STOP_STRINGS, TextChunk
from bridge.llm.openai import OpenAIBackend
from tests.fakes.llm_servers import Answer, Error, FakeOpenAI, busy, stall
from tests.llm.helpers import (
    FAST_RETRY,
    FOUR_SENTENCES,
    MEMORY_SCHEMA,
    MODEL,
    collect,
    extraction_request,
    read_until_sentences,
    refused_url,
    reply_request,
)

JSON_SCHEMA_FORM = {"type": "json_schema", "json_schema": {"name": "memories", "schema": MEMORY_SCHEMA}}
JSON_OBJECT_FORM = {"type": "json_object", "schema": MEMORY_SCHEMA}


async def test_reply_body_is_the_spec_body() -> None:
    async with FakeOpenAI() as server:
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert server.requests[0].path == "/v1/chat/completions"
    assert server.bodies == [
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "あなたは喫茶店の店員です。"},
                {"role": "user", "content": "こんにちは"},
            ],
            "stream": True,
            "max_tokens": 120,
            "temperature": 0.7,
            "stop": list(TEMPLATE_STOP_STRINGS),
        }
    ]


async def test_streamed_text_arrives_in_pieces_with_stats() -> None:
    async with FakeOpenAI() as server:
        server.script(
            Answer(("いらっしゃい", "ませ。"), delay_seconds=0.02, eval_count=9, prompt_eval_count=77)
        )
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert pieces == ["いらっしゃい", "ませ。"]
    assert (stats.backend, stats.model, stats.done_reason) == ("openai", MODEL, "stop")
    assert (stats.eval_count, stats.prompt_eval_count) == (9, 77)
    assert stats.total_duration_ms is not None and stats.total_duration_ms > 0
    assert stats.extra["timings"]["predicted_n"] == 9


@pytest.mark.parametrize(
    ("usage", "timings", "expected"),
    [(True, False, (9, 77)), (False, True, (9, 77)), (False, False, (None, None))],
)
async def test_stats_come_from_usage_or_timings(
    usage: bool, timings: bool, expected: tuple[int | None, int | None]
) -> None:
    async with FakeOpenAI(usage=usage, timings=timings) as server:
        server.script(Answer.text("はい。", eval_count=9, prompt_eval_count=77))
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        _, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert (stats.eval_count, stats.prompt_eval_count) == expected
    assert (stats.total_duration_ms is not None) == timings


async def test_a_whole_completion_from_a_server_that_did_not_stream_is_read() -> None:
    async with FakeOpenAI() as server:
        server.script(Answer.text("はい、どうぞ。", stream=False))
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert pieces == ["はい、どうぞ。"]
    assert stats.done_reason == "stop" and stats.eval_count == 2


async def test_extraction_asks_for_json_schema_first() -> None:
    async with FakeOpenAI() as server:
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        pieces, _ = await collect(backend.stream(extraction_request()))
        await collect(backend.stream(extraction_request()))
        await backend.aclose()
    assert "".join(pieces) == '{"memories": []}'
    assert [b["response_format"] for b in server.bodies] == [JSON_SCHEMA_FORM, JSON_SCHEMA_FORM]
    assert server.bodies[0]["temperature"] == 0.0 and server.bodies[0]["max_tokens"] == 256
    assert backend.response_format_form == "json_schema"


@pytest.mark.parametrize("refusal", [500, 400, 422])
async def test_refused_json_schema_falls_back_to_json_object_and_remembers(refusal: int) -> None:
    async with FakeOpenAI(refuse_json_schema=refusal) as server:
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        first, stats = await collect(backend.stream(extraction_request()))
        second, _ = await collect(backend.stream(extraction_request()))
        await backend.aclose()
    assert "".join(first) == "".join(second) == '{"memories": []}'
    assert [b["response_format"] for b in server.bodies] == [
        JSON_SCHEMA_FORM,
        JSON_OBJECT_FORM,
        JSON_OBJECT_FORM,  # the second extraction goes straight to the form the server takes
    ]
    assert [r.status for r in server.requests] == [refusal, 200, 200]
    assert backend.response_format_form == "json_object"
    assert stats.attempts == 2


async def test_replies_never_send_a_response_format() -> None:
    async with FakeOpenAI(refuse_json_schema=500) as server:
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        await collect(backend.stream(extraction_request()))
        await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert "response_format" not in server.bodies[-1]


async def test_a_server_error_after_json_schema_was_accepted_is_retried_not_a_refusal() -> None:
    async with FakeOpenAI() as server:
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        await collect(backend.stream(extraction_request()))
        server.script(Error(500))
        await collect(backend.stream(extraction_request()))
        await backend.aclose()
    assert [b["response_format"]["type"] for b in server.bodies] == ["json_schema"] * 3
    assert backend.response_format_form == "json_schema"


async def test_reader_stopping_after_two_sentences_closes_the_connection() -> None:
    async with FakeOpenAI() as server:
        server.script(Answer(FOUR_SENTENCES, delay_seconds=0.1))
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        text = await read_until_sentences(backend.stream(reply_request()), 2)
        record = await server.requests[0].wait_ended()
        await backend.aclose()
    assert text == "いらっしゃいませ。今日は暑いですね。"
    assert record.closed_early and not record.finished
    assert record.pieces_sent <= 5 < len(FOUR_SENTENCES)


async def test_extraction_closed_after_the_first_json_object_stops_the_server() -> None:
    endless = ('{"memories": ', '["a"]}', ' {"memories": ', '["a"]}', *([' {"m": 1}'] * 20))
    async with FakeOpenAI() as server:
        server.script(Answer(endless, delay_seconds=0.05))
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        text = ""
        async with aclosing(backend.stream(extraction_request())) as chunks:
            async for chunk in chunks:
                text += chunk.text if isinstance(chunk, TextChunk) else ""
                if text.endswith("}"):
                    break
        record = await server.requests[0].wait_ended()
        await backend.aclose()
    assert text == '{"memories": ["a"]}'
    assert record.closed_early
    assert record.pieces_sent <= 3


async def test_caller_deadline_on_a_stalled_stream_closes_the_connection() -> None:
    async with FakeOpenAI() as server:
        server.script(stall("いらっしゃい"))
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await collect(backend.stream(reply_request()))
        record = await server.requests[0].wait_ended()
        await backend.aclose()
    assert record.closed_early and record.pieces_sent == 1


async def test_busy_then_success() -> None:
    async with FakeOpenAI() as server:
        server.script(busy(retry_after="1"), "はい。")
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert "".join(pieces) == "はい。" and stats.attempts == 2
    assert server.requests[1].received_at - server.requests[0].received_at >= 0.95


async def test_missing_model_raises_model_missing_without_retrying() -> None:
    async with FakeOpenAI(models=("gemma-3-270m",)) as server:
        backend = OpenAIBackend(server.url, retry=FAST_RETRY)
        with pytest.raises(LLMModelMissing, match="does not exist"):
            await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert len(server.requests) == 1


async def test_refused_connection_gives_up_after_bounded_attempts() -> None:
    backend = OpenAIBackend(refused_url(), retry=FAST_RETRY)
    with pytest.raises(LLMUnavailable):
        await collect(backend.stream(reply_request()))
    await backend.aclose()


async def test_list_models_reads_v1_models() -> None:
    async with FakeOpenAI(models=("gemma-3-270m",)) as server:
        backend = OpenAIBackend(server.url)
        assert await backend.list_models() == ["gemma-3-270m"]
        await backend.aclose()
    assert server.other_requests == [("GET", "/v1/models")]
