"""CoordinatorBackend against FakeCoordinator: pinned worker or lane, deadline_ms, busy, errors."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from bridge.errors import LLMModelMissing, LLMResponseError, LLMUnavailable
from bridge.llm.base import TEMPLATE_STOP_STRINGS
from bridge.llm.coordinator import CoordinatorBackend
from tests.fakes.llm_servers import Answer, Error, FakeCoordinator, Hang, busy
from tests.llm.helpers import (
    FAST_RETRY,
    MEMORY_SCHEMA,
    MODEL,
    collect,
    extraction_request,
    refused_url,
    reply_request,
)

WORKER = "macbookair"


async def test_reply_body_pins_worker_and_model() -> None:
    async with FakeCoordinator() as server:
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        await collect(backend.stream(reply_request(deadline_seconds=90.0)))
        await backend.aclose()
    body = dict(server.bodies[0])
    deadline_ms = body.pop("deadline_ms")
    assert body == {
        "messages": [
            {"role": "system", "content": "あなたは喫茶店の店員です。"},
            {"role": "user", "content": "こんにちは"},
        ],
        "worker": WORKER,
        "models": [MODEL],
        "options": {"temperature": 0.7, "num_predict": 120, "stop": list(TEMPLATE_STOP_STRINGS)},
    }
    assert isinstance(deadline_ms, int)
    assert 85_000 < deadline_ms <= 90_000


async def test_extraction_body_carries_the_format() -> None:
    async with FakeCoordinator() as server:
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        pieces, _ = await collect(backend.stream(extraction_request(deadline_seconds=60.0)))
        await backend.aclose()
    body = server.bodies[0]
    assert body["format"] == MEMORY_SCHEMA
    assert body["options"]["temperature"] == 0.0 and body["options"]["num_predict"] == 256
    assert body["deadline_ms"] <= 60_000
    assert pieces == ['{"memories": []}']


async def test_a_lane_replaces_worker_and_models() -> None:
    async with FakeCoordinator(lanes={"fast": ("desktop", "gemma3-4b")}) as server:
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        _, stats = await collect(backend.stream(reply_request(lane="fast")))
        await backend.aclose()
    body = server.bodies[0]
    assert body["lane"] == "fast"
    assert "worker" not in body and "models" not in body
    assert (stats.worker, stats.model) == ("desktop", "gemma3-4b")


async def test_the_whole_text_arrives_as_one_chunk_with_the_route() -> None:
    async with FakeCoordinator() as server:
        server.script(Answer.text("いらっしゃいませ。何にしますか？", delay_seconds=0.01))
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        pieces, stats = await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert pieces == ["いらっしゃいませ。何にしますか？"]
    assert (stats.backend, stats.worker, stats.model, stats.attempts) == ("coordinator", WORKER, MODEL, 1)
    assert len(stats.extra["task_id"]) == 32


async def test_busy_worker_is_retried_after_retry_after_with_a_smaller_deadline() -> None:
    async with FakeCoordinator() as server:
        server.script(busy(retry_after="1"), "はい。")
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        with capture_logs() as logs:
            pieces, stats = await collect(backend.stream(reply_request(deadline_seconds=30.0)))
        await backend.aclose()
    assert pieces == ["はい。"] and stats.attempts == 2
    first, second = server.requests
    assert second.received_at - first.received_at >= 0.95
    assert first.body["deadline_ms"] - second.body["deadline_ms"] >= 950
    assert [(e["backend"], e["status"]) for e in logs if e["event"] == "llm_retry"] == [("coordinator", 503)]


async def test_many_busy_answers_are_bounded_by_the_deadline() -> None:
    async with FakeCoordinator() as server:
        server.default = busy(retry_after="0.1")
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        with pytest.raises(LLMUnavailable, match="503"):
            await collect(backend.stream(reply_request(deadline_seconds=0.75)))
        await backend.aclose()
    # About one attempt per 0.1 s inside 0.75 s: paced by the server, bounded by the deadline.
    assert 3 <= len(server.requests) <= 8


async def test_unknown_model_is_model_missing() -> None:
    async with FakeCoordinator(models=("gemma3-4b",)) as server:
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        with pytest.raises(LLMModelMissing):
            await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert len(server.requests) == 1


async def test_server_error_is_retried_and_a_bad_request_is_not() -> None:
    async with FakeCoordinator() as server:
        server.script(Error(502, "worker unreachable"), "はい。", Error(400, "bad options"))
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        pieces, stats = await collect(backend.stream(reply_request()))
        with pytest.raises(LLMResponseError, match="bad options"):
            await collect(backend.stream(reply_request()))
        await backend.aclose()
    assert pieces == ["はい。"] and stats.attempts == 2
    assert len(server.requests) == 3


async def test_caller_deadline_cancels_the_request_and_closes_the_connection() -> None:
    async with FakeCoordinator() as server:
        server.script(Hang())
        backend = CoordinatorBackend(server.url, WORKER, retry=FAST_RETRY)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await collect(backend.stream(reply_request()))
        record = await server.requests[0].wait_ended()
        await backend.aclose()
    assert record.closed_early


async def test_refused_connection_retries_then_unavailable() -> None:
    backend = CoordinatorBackend(refused_url(), WORKER, retry=FAST_RETRY)
    with capture_logs() as logs, pytest.raises(LLMUnavailable):
        await collect(backend.stream(reply_request()))
    await backend.aclose()
    assert len([e for e in logs if e["event"] == "llm_retry"]) == 3


async def test_list_models_cannot_tell() -> None:
    backend = CoordinatorBackend(refused_url(), WORKER)
    assert await backend.list_models() is None
    await backend.aclose()
