"""OllamaBackend against FakeOllama: bodies, streaming, stops, stalls, retries, errors, stats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import aclosing

import pytest
from structlog.testing import capture_logs

from bridge.errors import LLMModelMissing, LLMResponseError, LLMUnavailable
from bridge.llm.base import TEMPLATE_STOP_STRINGS, Done, TextChunk
from bridge.llm.ollama import OllamaBackend
from tests.fakes.llm_servers import Answer, Drop, Error, FakeOllama, busy, model_missing, stall
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


async def test_reply_body_is_the_spec_body() -> None:
    async with FakeOllama() as server:
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert server.bodies == [
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "あなたは喫茶店の店員です。"},
                {"role": "user", "content": "こんにちは"},
            ],
            "stream": True,
            "keep_alive": "30m",
            "options": {"temperature": 0.7, "num_predict": 120, "stop": list(TEMPLATE_STOP_STRINGS)},
        }
    ]


async def test_extraction_body_sets_format_to_the_schema() -> None:
    async with FakeOllama() as server:
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        pieces, _ = await collect(backend.stream(extraction_request(stop=("</s>",))))
        await backend.aclose()
    body = server.bodies[0]
    assert body["format"] == MEMORY_SCHEMA
    assert body["options"] == {"temperature": 0.0, "num_predict": 256, "stop": ["</s>"]}
    assert body["stream"] is True
    assert "".join(pieces) == '{"memories": []}'


async def test_streamed_text_arrives_in_pieces() -> None:
    async with FakeOllama() as server:
        server.script(Answer(("いらっしゃい", "ませ。"), delay_seconds=0.02))
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert pieces == ["いらっしゃい", "ませ。"]
    assert stats.backend == "ollama" and stats.attempts == 1


async def test_stats_come_from_the_final_object() -> None:
    async with FakeOllama() as server:
        server.script(Answer.text("はい。", eval_count=42, prompt_eval_count=321, done_reason="length"))
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        _, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert (stats.eval_count, stats.prompt_eval_count, stats.done_reason) == (42, 321, "length")
    assert stats.model == MODEL
    assert stats.total_duration_ms is not None and stats.total_duration_ms > 0
    assert set(stats.extra) == {"load_duration_ms", "prompt_eval_duration_ms", "eval_duration_ms"}
    assert stats.extra["load_duration_ms"] == 1.0  # the fake's 1_000_000 ns


async def test_a_whole_answer_from_a_server_that_did_not_stream_is_read() -> None:
    async with FakeOllama() as server:
        server.script(Answer.text("はい、どうぞ。", stream=False))
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert pieces == ["はい、どうぞ。"]
    assert stats.eval_count == 2


async def test_slow_stream_is_read_to_the_end() -> None:
    async with FakeOllama() as server:
        server.script(
            Answer.text("ゆっくり話します。", piece_chars=2, delay_seconds=0.05, first_delay_seconds=0.2)
        )
        backend = OllamaBackend(server.url, retry=FAST_RETRY, stall_seconds=1.0)
        pieces, _ = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert "".join(pieces) == "ゆっくり話します。"
    assert len(pieces) == 5
    assert server.requests[0].finished


async def test_reader_stopping_after_two_sentences_closes_the_connection() -> None:
    async with FakeOllama() as server:
        server.script(Answer(FOUR_SENTENCES, delay_seconds=0.1))
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        text = await read_until_sentences(backend.stream(reply_request()), 2)
        record = await server.requests[0].wait_ended()
        await backend.aclose()
    assert text == "いらっしゃいませ。今日は暑いですね。"
    assert record.closed_early
    assert not record.finished
    assert record.pieces_sent <= 5 < len(FOUR_SENTENCES)


async def test_caller_deadline_on_a_stalled_stream_closes_the_connection() -> None:
    async with FakeOllama() as server:
        server.script(stall("いらっしゃい"))
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        received: list[str] = []
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                async for chunk in backend.stream(reply_request()):
                    assert isinstance(chunk, TextChunk)
                    received.append(chunk.text)
        record = await server.requests[0].wait_ended()
        await backend.aclose()
    assert received == ["いらっしゃい"]
    assert record.closed_early
    assert len(server.requests) == 1


async def test_a_stall_after_text_raises_unavailable_without_retrying() -> None:
    async with FakeOllama() as server:
        server.script(stall("いらっしゃい"))
        backend = OllamaBackend(server.url, retry=FAST_RETRY, stall_seconds=0.2)
        received: list[str] = []
        with pytest.raises(LLMUnavailable, match="stalled"):
            async for chunk in backend.stream(reply_request()):
                assert isinstance(chunk, TextChunk)
                received.append(chunk.text)
        record = await server.requests[0].wait_ended()
        await backend.aclose()
    assert received == ["いらっしゃい"]
    assert record.closed_early
    assert len(server.requests) == 1


async def test_a_stall_before_any_text_is_retried() -> None:
    async with FakeOllama() as server:
        server.script(stall(), "はい。")
        backend = OllamaBackend(server.url, retry=FAST_RETRY, stall_seconds=0.2)
        pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert "".join(pieces) == "はい。"
    assert stats.attempts == 2
    assert server.requests[0].closed_early


async def test_busy_with_retry_after_is_retried_after_that_long() -> None:
    async with FakeOllama() as server:
        server.script(busy(retry_after="1"), "はい。")
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        with capture_logs() as logs:
            pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert "".join(pieces) == "はい。"
    assert stats.attempts == 2
    first, second = server.requests
    assert second.received_at - first.received_at >= 0.95
    retries = [entry for entry in logs if entry["event"] == "llm_retry"]
    assert [(r["backend"], r["status"], r["delay_s"]) for r in retries] == [("ollama", 503, 1.0)]


async def test_retry_after_beyond_the_deadline_gives_up_at_once() -> None:
    async with FakeOllama() as server:
        server.script(busy(retry_after="30"))
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        with pytest.raises(LLMUnavailable) as failure:
            await collect(backend.stream(reply_request(deadline_seconds=5.0)))
        await backend.aclose()
    assert failure.value.retry_after_seconds == 30.0
    assert len(server.requests) == 1


async def test_server_errors_are_retried_with_backoff_then_succeed() -> None:
    async with FakeOllama() as server:
        server.script(Error(500), Drop(), "はい。")
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        with capture_logs() as logs:
            pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert "".join(pieces) == "はい。"
    assert stats.attempts == 3
    retries = [entry for entry in logs if entry["event"] == "llm_retry"]
    assert [(r["status"], r["delay_s"]) for r in retries] == [(500, 0.05), ("connection_lost", 0.1)]


async def test_missing_model_raises_model_missing_without_retrying() -> None:
    async with FakeOllama(models=("gemma3:4b",)) as server:
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        with pytest.raises(LLMModelMissing, match="not found"):
            await collect(backend.stream(reply_request()))
        server.script(model_missing())
        with pytest.raises(LLMModelMissing):
            await collect(backend.stream(reply_request(model="gemma3:4b")))
        await backend.aclose()
    assert len(server.requests) == 2


async def test_other_client_errors_are_not_retried() -> None:
    async with FakeOllama() as server:
        server.script(Error(400, "invalid options"))
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        with pytest.raises(LLMResponseError, match="invalid options"):
            await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert len(server.requests) == 1


async def test_refused_connection_is_retried_with_backoff_then_unavailable() -> None:
    backend = OllamaBackend(refused_url(), retry=FAST_RETRY)
    started = time.monotonic()
    with capture_logs() as logs, pytest.raises(LLMUnavailable, match="cannot connect"):
        await collect(backend.stream(reply_request()))
    elapsed = time.monotonic() - started
    await backend.aclose()
    retries = [entry for entry in logs if entry["event"] == "llm_retry"]
    # Four attempts, three waits that double: not a tight loop.
    assert [r["delay_s"] for r in retries] == [0.05, 0.1, 0.2]
    assert [r["attempt"] for r in retries] == [1, 2, 3]
    assert elapsed >= 0.35
    assert [e["attempts"] for e in logs if e["event"] == "llm_give_up"] == [4]


async def test_retries_never_sleep_past_the_deadline() -> None:
    slow_retry = FAST_RETRY.__class__(first_delay_seconds=1.0, max_attempts=10, jitter=0.0)
    backend = OllamaBackend(refused_url(), retry=slow_retry)
    with capture_logs() as logs, pytest.raises(LLMUnavailable):
        await collect(backend.stream(reply_request(deadline_seconds=0.5)))
    await backend.aclose()
    assert [e["event"] for e in logs if e["event"].startswith("llm_")] == ["llm_give_up"]


async def test_logs_never_carry_message_content() -> None:
    async with FakeOllama() as server:
        server.script(Error(500), "はい。")
        backend = OllamaBackend(server.url, retry=FAST_RETRY)
        with capture_logs() as logs:
            await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert logs
    assert "こんにちは" not in repr(logs) and "はい" not in repr(logs)


async def test_list_models_reads_the_tags() -> None:
    async with FakeOllama(models=("elyza-jp-8b", "gemma3:4b")) as server:
        backend = OllamaBackend(server.url)
        assert await backend.list_models() == ["elyza-jp-8b:latest", "gemma3:4b"]
        await backend.aclose()
    assert server.other_requests == [("GET", "/api/tags")]


async def test_list_models_on_a_dead_server_raises_unavailable() -> None:
    backend = OllamaBackend(refused_url())
    with pytest.raises(LLMUnavailable):
        await backend.list_models()
    await backend.aclose()


async def read_answers(url: str, count: int, *, between: Callable[[], None] = lambda: None) -> None:
    """`count` replies one after the other on one backend, each read to its `Done`."""
    backend = OllamaBackend(url)
    try:
        for _ in range(count):
            async with aclosing(backend.stream(reply_request())) as chunks:
                async for chunk in chunks:
                    if isinstance(chunk, Done):
                        break
            between()
    finally:
        await backend.aclose()


async def test_finished_answers_leave_the_connection_for_the_next_request() -> None:
    async with FakeOllama() as server:
        await read_answers(server.url, 3)
    ports = {record.client_port for record in server.requests}
    assert len(server.requests) == 3 and len(ports) == 1


async def test_a_connection_idle_between_players_lines_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    import httpcore._async.http11 as http11

    clock = [time.monotonic()]
    monkeypatch.setattr(http11.time, "monotonic", lambda: clock[0])

    def quiet() -> None:
        clock[0] += 30.0  # half a minute of quiet before the next line (httpx's default keeps 5 s)

    async with FakeOllama() as server:
        await read_answers(server.url, 2, between=quiet)
    assert len({record.client_port for record in server.requests}) == 1
