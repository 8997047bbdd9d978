"""Pure parts: stream line parsers, Retry-After, backoff, error bodies, the factory."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest

from bridge.errors import LLMResponseError, LLMUnavailable
from bridge.llm._http import RetryPolicy, retry_after_seconds, server_message
from bridge.llm.base import Done, TextChunk
from bridge.llm.coordinator import CoordinatorBackend, parse_route_answer
from bridge.llm.factory import make_backend
from bridge.llm.ollama import OllamaBackend, OllamaParser
from bridge.llm.openai import OpenAIBackend, OpenAIParser, completion_body
from bridge.settings import load_settings
from tests.llm.helpers import extraction_request, reply_request


def test_ollama_parser_yields_text_then_done_with_stats() -> None:
    parser = OllamaParser(reply_request(), attempts=2)
    chunk = {"model": "m", "message": {"role": "assistant", "content": "はい"}, "done": False}
    final = {
        "model": "m", "message": {"role": "assistant", "content": ""}, "done": True,
        "done_reason": "stop", "eval_count": 3, "prompt_eval_count": 10,
        "total_duration": 2_500_000_000, "eval_duration": 1_000_000_000,
    }
    assert parser.feed(json.dumps(chunk)) == [TextChunk("はい")]
    assert parser.feed("") == []
    (done,) = parser.feed(json.dumps(final))
    assert isinstance(done, Done)
    stats = done.stats
    assert (stats.eval_count, stats.prompt_eval_count, stats.total_duration_ms) == (3, 10, 2500.0)
    assert (stats.done_reason, stats.attempts, stats.extra) == ("stop", 2, {"eval_duration_ms": 1000.0})


def test_ollama_parser_raises_on_errors_and_truncation() -> None:
    parser = OllamaParser(reply_request(), attempts=1)
    with pytest.raises(LLMUnavailable, match="boom"):
        parser.feed('{"error": "boom"}')
    with pytest.raises(LLMResponseError):
        parser.feed("not json")
    with pytest.raises(LLMResponseError):
        parser.finish()


def test_openai_parser_reads_events_and_ignores_comments() -> None:
    parser = OpenAIParser(reply_request(), attempts=1)
    lines = [
        ": keep-alive",
        'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}',
        "",
        'data: {"choices": [{"index": 0, "delta": {"content": "はい"}, "finish_reason": null}]}',
        "",
        'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}',
        'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}',
    ]
    chunks = [chunk for line in lines for chunk in parser.feed(line)]
    assert chunks == [TextChunk("はい")]
    (done,) = parser.feed("data: [DONE]")
    assert isinstance(done, Done)
    assert (done.stats.prompt_eval_count, done.stats.eval_count) == (5, 1)
    assert done.stats.done_reason == "length"


def test_openai_parser_ends_without_done_marker_after_a_finish_reason() -> None:
    parser = OpenAIParser(reply_request(), attempts=1)
    parser.feed('data: {"choices": [{"delta": {"content": "a"}, "finish_reason": "stop"}]}')
    (done,) = parser.finish()
    assert isinstance(done, Done) and done.stats.done_reason == "stop"
    truncated = OpenAIParser(reply_request(), attempts=1)
    truncated.feed('data: {"choices": [{"delta": {"content": "a"}}]}')
    with pytest.raises(LLMResponseError):
        truncated.finish()


def test_openai_parser_raises_on_an_error_event() -> None:
    parser = OpenAIParser(reply_request(), attempts=1)
    with pytest.raises(LLMUnavailable, match="context"):
        parser.feed('data: {"error": {"message": "context too long"}}')


def test_openai_completion_body_forms() -> None:
    request = extraction_request()
    schema_form = completion_body(request, "json_schema")["response_format"]
    object_form = completion_body(request, "json_object")["response_format"]
    schema = request.json_schema
    assert schema_form == {"type": "json_schema", "json_schema": {"name": "memories", "schema": schema}}
    assert object_form == {"type": "json_object", "schema": request.json_schema}
    assert "stop" not in completion_body(reply_request(stop=()))


def test_route_answer_without_text_is_a_response_error() -> None:
    with pytest.raises(LLMResponseError):
        parse_route_answer({"route": {}}, reply_request(), attempts=1)
    text, stats = parse_route_answer({"text": "はい"}, reply_request(), attempts=1)
    assert (text, stats.worker, stats.model) == ("はい", None, reply_request().model)


@pytest.mark.parametrize(
    ("header", "expected"),
    [("1", 1.0), ("0.25", 0.25), ("-3", 0.0), (None, None), ("", None), ("soon", None)],
)
def test_retry_after_seconds(header: str | None, expected: float | None) -> None:
    assert retry_after_seconds(header) == expected


def test_retry_after_as_an_http_date() -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    seconds = retry_after_seconds(when)
    assert seconds is not None and 28 <= seconds <= 31


def test_backoff_doubles_up_to_the_cap_with_bounded_jitter() -> None:
    exact = RetryPolicy(first_delay_seconds=0.5, max_delay_seconds=8.0, jitter=0.0)
    assert [exact.backoff_seconds(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    jittered = RetryPolicy(first_delay_seconds=1.0, jitter=0.2)
    delays = [jittered.backoff_seconds(1) for _ in range(200)]
    assert all(0.8 <= d <= 1.0 for d in delays)
    assert len(set(delays)) > 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": "model not found"}', "model not found"),
        (b'{"error": {"message": "bad schema", "type": "x"}}', "bad schema"),
        (b"plain text", "plain text"),
    ],
)
def test_server_message(body: bytes, message: str) -> None:
    assert server_message(body) == message


@pytest.mark.parametrize(
    ("name", "kind"),
    [("ollama", OllamaBackend), ("coordinator", CoordinatorBackend), ("openai", OpenAIBackend)],
)
async def test_factory_chooses_the_backend(name: str, kind: type) -> None:
    settings = load_settings(llm_backend=name, llm_url="http://127.0.0.1:9/", llm_worker="desktop")
    backend = make_backend(settings)
    assert isinstance(backend, kind)
    assert backend.name == name
    if isinstance(backend, CoordinatorBackend):
        assert backend.worker == "desktop"
    await backend.aclose()
