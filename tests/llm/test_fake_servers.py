"""The fakes speak the real wire formats: the official ollama client parses FakeOllama, raw bytes match."""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.fakes.llm_servers import (
    Answer,
    Error,
    FakeCoordinator,
    FakeOllama,
    FakeOpenAI,
    busy,
    model_missing,
    stall,
)
from tests.llm.helpers import MODEL

MESSAGES = [{"role": "user", "content": "こんにちは"}]


async def test_official_ollama_client_parses_a_streamed_chat() -> None:
    async with FakeOllama() as server:
        server.script(Answer.text("いらっしゃいませ。", piece_chars=3, eval_count=7, prompt_eval_count=12))
        client = ollama.AsyncClient(host=server.url)
        parts = [part async for part in await client.chat(model=MODEL, messages=MESSAGES, stream=True)]
    assert "".join(part.message.content or "" for part in parts) == "いらっしゃいませ。"
    assert [part.done for part in parts] == [False, False, False, True]
    last = parts[-1]
    assert last.done_reason == "stop"
    assert last.eval_count == 7
    assert last.prompt_eval_count == 12
    assert last.total_duration is not None and last.total_duration > 0
    assert last.eval_duration is not None and last.load_duration is not None


async def test_official_ollama_client_parses_a_whole_chat() -> None:
    async with FakeOllama() as server:
        server.script(Answer.text("はい、どうぞ。"))
        client = ollama.AsyncClient(host=server.url)
        reply = await client.chat(model=MODEL, messages=MESSAGES, stream=False)
    assert reply.message.role == "assistant"
    assert reply.message.content == "はい、どうぞ。"
    assert reply.done is True
    assert reply.eval_count == 2  # two pieces of four characters


async def test_official_ollama_client_lists_the_models_and_sees_a_missing_one() -> None:
    async with FakeOllama(models=("elyza-jp-8b", "gemma3:4b")) as server:
        client = ollama.AsyncClient(host=server.url)
        listing = await client.list()
        with pytest.raises(ollama.ResponseError) as missing:
            await client.chat(model="nope", messages=MESSAGES)
    assert [m.model for m in listing.models] == ["elyza-jp-8b:latest", "gemma3:4b"]
    assert missing.value.status_code == 404
    assert "not found" in missing.value.error


async def test_fake_ollama_streams_chunked_ndjson() -> None:
    async with FakeOllama() as server, httpx.AsyncClient(base_url=server.url) as client:
        server.script(Answer.text("ab", piece_chars=1))
        body = {"model": MODEL, "messages": MESSAGES}  # Ollama streams when "stream" is absent
        async with client.stream("POST", "/api/chat", json=body) as response:
            lines = [line async for line in response.aiter_lines()]
            assert response.headers["content-type"].startswith("application/x-ndjson")
            assert response.headers["transfer-encoding"] == "chunked"
    objects = [json.loads(line) for line in lines]
    assert [o["message"]["content"] for o in objects] == ["a", "b", ""]
    for chunk in objects[:-1]:
        assert set(chunk) == {"model", "created_at", "message", "done"}
        assert chunk["done"] is False and chunk["message"]["role"] == "assistant"
    assert set(objects[-1]) >= {
        "done", "done_reason", "eval_count", "prompt_eval_count", "total_duration",
        "load_duration", "prompt_eval_duration", "eval_duration",
    }


async def test_fake_openai_streams_server_sent_events_ending_with_done() -> None:
    async with FakeOpenAI() as server, httpx.AsyncClient(base_url=server.url) as client:
        server.script(Answer.text("ab", piece_chars=1))
        body = {"model": MODEL, "messages": MESSAGES, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            raw = (await response.aread()).decode()
            assert response.headers["content-type"].startswith("text/event-stream")
    events = [block for block in raw.split("\n\n") if block]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["a", "b", None]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert set(chunk) >= {"id", "object", "created", "model", "choices"}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-1]["timings"]["predicted_n"] == 2


async def test_fake_openai_answers_a_whole_completion_when_not_streaming() -> None:
    async with FakeOpenAI() as server, httpx.AsyncClient(base_url=server.url) as client:
        server.script("はい。")
        response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "はい。"}
    assert data["choices"][0]["finish_reason"] == "stop"


async def test_fake_openai_refuses_json_schema_like_llama_cpp_python() -> None:
    schema_form = {"type": "json_schema", "json_schema": {"name": "memories", "schema": {}}}
    async with FakeOpenAI(refuse_json_schema=500) as server, httpx.AsyncClient(base_url=server.url) as client:
        server.script('{"memories": []}')
        body = {"model": MODEL, "messages": MESSAGES, "response_format": schema_form}
        refused = await client.post("/v1/chat/completions", json=body)
        body["response_format"] = {"type": "json_object", "schema": {}}
        accepted = await client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 500
    assert "message" in refused.json()["error"]
    assert accepted.json()["choices"][0]["message"]["content"] == '{"memories": []}'
    assert [r.status for r in server.requests] == [500, 200]


async def test_errors_carry_the_api_bodies_and_retry_after() -> None:
    async with FakeOllama() as server, httpx.AsyncClient(base_url=server.url) as client:
        server.script(busy("1"), model_missing(), Error(500, "boom"))
        body = {"model": MODEL, "messages": MESSAGES}
        first, second, third = [await client.post("/api/chat", json=body) for _ in range(3)]
    assert (first.status_code, first.headers["retry-after"]) == (503, "1")
    assert second.status_code == 404 and "not found" in second.json()["error"]
    assert third.json() == {"error": "boom"}


async def test_fake_coordinator_answers_with_text_and_route() -> None:
    async with FakeCoordinator(lanes={"fast": ("desktop", "gemma3-4b")}) as server:
        async with httpx.AsyncClient(base_url=server.url) as client:
            pinned = await client.post(
                "/route", json={"messages": MESSAGES, "worker": "macbookair", "models": [MODEL]}
            )
            laned = await client.post("/route", json={"messages": MESSAGES, "lane": "fast"})
    assert pinned.json()["text"] == "いらっしゃいませ。今日は何にしますか？"
    assert pinned.json()["route"]["worker"] == "macbookair"
    assert pinned.json()["route"]["model"] == MODEL
    assert laned.json()["route"]["worker"] == "desktop"
    assert len(server.requests) == 2


async def test_a_client_leaving_a_stalled_stream_is_recorded() -> None:
    async with FakeOllama() as server:
        server.script(stall("はい"))
        async with httpx.AsyncClient(base_url=server.url) as client:
            async with client.stream("POST", "/api/chat", json={"model": MODEL, "messages": MESSAGES}) as r:
                lines = r.aiter_lines()
                assert json.loads(await anext(lines))["message"]["content"] == "はい"
        record = await server.requests[0].wait_ended()
    assert record.closed_early
    assert not record.finished
    assert record.pieces_sent == 1


async def test_default_answers_json_to_extractions() -> None:
    async with FakeOllama() as server, httpx.AsyncClient(base_url=server.url) as client:
        body = {"model": MODEL, "messages": MESSAGES, "stream": False, "format": {"type": "object"}}
        response = await client.post("/api/chat", json=body)
    assert json.loads(response.json()["message"]["content"]) == {"memories": []}
