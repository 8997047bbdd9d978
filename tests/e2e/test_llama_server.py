"""Pins what the bridge's `openai` backend relies on in llama-cpp-python's server, with a real model."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.e2e.llama_server import LlamaServer, prefix_hits

pytestmark = pytest.mark.e2e

REQUEST_TIMEOUT_SECONDS = 120.0
LOG_WAIT_SECONDS = 10.0
SYSTEM_SHORT = "You are Hana, who sells flowers. Answer in one short sentence."
SYSTEM_LONG = (
    SYSTEM_SHORT
    + " "
    + " ".join(f"Rule {i}: stay in character and never talk about item {i} unless asked." for i in range(12))
)
PLAYER_LINE = "Hello! What do you recommend today?"
# Japanese that the 270M model continues endlessly (it echoes the prompt instead of answering).
ENDLESS_MESSAGES = [
    {"role": "system", "content": "あなたは花屋の店員ハナです。短く答えてください。"},
    {
        "role": "user",
        "content": "こんにちは。今日のおすすめの花について、できるだけ詳しく長く教えてください。",
    },
]
MEMORIES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "memories": {"type": "array", "items": {"type": "string", "maxLength": 120}, "maxItems": 3},
    },
    "required": ["memories"],
    "additionalProperties": False,
}
EXTRACTION_MESSAGES = [
    {
        "role": "system",
        "content": 'List facts about the player worth remembering as JSON {"memories": [...]}.',
    },
    {"role": "user", "content": "Player: My name is Ken and I love strawberry cake.\nHana: Thank you, Ken!"},
]


def render_prompt(messages: list[dict[str, str]]) -> str:
    """What gemma3_tokenizer_config.json should render for a system + user exchange, without <bos>."""
    system, user = messages
    return f"<start_of_turn>user\n{system['content']}\n\n{user['content']}<end_of_turn>\n<start_of_turn>model\n"


def chat_body(server: LlamaServer, messages: list[dict[str, str]], **fields: Any) -> dict[str, Any]:
    return {"model": server.model_alias, "messages": messages, **fields}


async def sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The payloads of a server-sent event stream's `data:` lines."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


async def count_tokens(client: httpx.AsyncClient, server: LlamaServer, text: str) -> int:
    """Tokens the server's tokenizer makes of `text` (it adds <bos>, as the chat handler's prompt has)."""
    response = await client.post(f"{server.url}/extras/tokenize/count", json={"input": text})
    response.raise_for_status()
    count: int = response.json()["count"]
    return count


async def wait_for_log(server: LlamaServer, needle: str, since: int) -> str:
    """The log written after offset `since`, once it holds `needle` (or whatever it holds at the deadline)."""
    deadline = time.monotonic() + LOG_WAIT_SECONDS
    while True:
        text = server.log_text()[since:]
        if needle in text or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.1)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_SECONDS) as http:
        yield http


async def test_streamed_reply_sends_content_deltas_then_done(
    llama_server: LlamaServer, client: httpx.AsyncClient
) -> None:
    messages = [{"role": "system", "content": SYSTEM_SHORT}, {"role": "user", "content": PLAYER_LINE}]
    body = chat_body(llama_server, messages, stream=True, max_tokens=40, temperature=0.7, stop=["<start_of_turn>"])
    payloads: list[str] = []
    began = time.monotonic()
    first_content_seconds = None
    async with client.stream("POST", f"{llama_server.url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for payload in sse_events(response):
            payloads.append(payload)
            if first_content_seconds is None and '"content"' in payload:
                first_content_seconds = time.monotonic() - began
    total_seconds = time.monotonic() - began

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    text = "".join(delta.get("content") or "" for delta in deltas)
    assert text.strip(), "no delta.content in the stream"
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    print(
        f"\nstream: {len(chunks)} chunks, first content after {first_content_seconds or 0:.2f} s, "
        f"all in {total_seconds:.2f} s; text {text[:80]!r}"
    )


async def test_system_prompt_is_folded_into_the_first_user_turn(
    llama_server: LlamaServer, client: httpx.AsyncClient
) -> None:
    prompt_tokens: list[int] = []
    for system in (SYSTEM_SHORT, SYSTEM_LONG):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": PLAYER_LINE}]
        response = await client.post(
            f"{llama_server.url}/v1/chat/completions",
            json=chat_body(llama_server, messages, max_tokens=1, temperature=0),
        )
        response.raise_for_status()
        used = response.json()["usage"]["prompt_tokens"]
        # The prompt the server evaluated is exactly the Gemma 3 rendering: no <<SYS>>, no [INST].
        assert used == await count_tokens(client, llama_server, render_prompt(messages))
        prompt_tokens.append(used)
    extra_tokens = await count_tokens(client, llama_server, SYSTEM_LONG) - await count_tokens(
        client, llama_server, SYSTEM_SHORT
    )
    assert prompt_tokens[1] - prompt_tokens[0] == extra_tokens
    print(f"\nprompt_tokens with short/long system message: {prompt_tokens}")


async def test_json_object_with_schema_returns_memories(llama_server: LlamaServer, client: httpx.AsyncClient) -> None:
    began = time.monotonic()
    response = await client.post(
        f"{llama_server.url}/v1/chat/completions",
        json=chat_body(
            llama_server,
            EXTRACTION_MESSAGES,
            max_tokens=256,
            temperature=0,
            response_format={"type": "json_object", "schema": MEMORIES_SCHEMA},
        ),
    )
    elapsed_seconds = time.monotonic() - began
    response.raise_for_status()
    content = response.json()["choices"][0]["message"]["content"]
    parsed = json.loads(content)
    assert set(parsed) == {"memories"}
    assert isinstance(parsed["memories"], list) and len(parsed["memories"]) <= 3
    assert all(isinstance(memory, str) for memory in parsed["memories"])
    print(f"\njson_object+schema in {elapsed_seconds:.2f} s: {content!r}")


async def test_json_schema_response_format_is_refused_with_500(
    llama_server: LlamaServer, client: httpx.AsyncClient
) -> None:
    response = await client.post(
        f"{llama_server.url}/v1/chat/completions",
        json=chat_body(
            llama_server,
            EXTRACTION_MESSAGES,
            max_tokens=64,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "memories", "schema": MEMORIES_SCHEMA},
            },
        ),
    )
    # Request validation fails ('text' or 'json_object' only) and the server's error handler
    # turns it into a 500 with an OpenAI-style error body, not a 4xx.
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "internal_server_error"
    assert "json_object" in error["message"]


async def test_closing_a_stream_stops_generation(llama_server: LlamaServer, client: httpx.AsyncClient) -> None:
    """The server keeps the last generation's tokens in its KV cache and reports how many a prompt
    reuses ("N prefix-match hit"), so a probe whose prompt is the full 200-token continuation shows
    how far the last generation really went."""
    body = chat_body(llama_server, ENDLESS_MESSAGES, max_tokens=200, temperature=0)
    reference = await client.post(f"{llama_server.url}/v1/chat/completions", json=body)
    reference.raise_for_status()
    prompt_tokens: int = reference.json()["usage"]["prompt_tokens"]
    assert reference.json()["choices"][0]["finish_reason"] == "length", "the model stopped by itself"
    probe_prompt = render_prompt(ENDLESS_MESSAGES) + reference.json()["choices"][0]["message"]["content"]

    async def generated_tokens_seen_by_probe() -> int:
        since = len(llama_server.log_text())
        response = await client.post(
            f"{llama_server.url}/v1/completions",
            json={
                "model": llama_server.model_alias,
                "prompt": probe_prompt,
                "max_tokens": 1,
                "temperature": 0,
            },
        )
        response.raise_for_status()
        hits = prefix_hits(await wait_for_log(llama_server, "prefix-match hit", since))
        assert hits, "the probe found no prefix in the KV cache"
        reused_tokens: int = hits[-1][0]
        return reused_tokens - prompt_tokens

    # Control: after a generation that ran to max_tokens, the probe sees (nearly) all 200 tokens.
    full_run_tokens = await generated_tokens_seen_by_probe()
    assert full_run_tokens >= 150, "re-tokenizing the reference text diverged too early to prove anything"

    since = len(llama_server.log_text())
    events = 0
    began = time.monotonic()
    async with client.stream(
        "POST", f"{llama_server.url}/v1/chat/completions", json={**body, "stream": True}
    ) as response:
        async for _payload in sse_events(response):
            events += 1
            if events == 4:  # the role chunk and three content chunks
                break
    # Leaving the block closes the connection before the stream has ended.
    read_seconds = time.monotonic() - began
    lock_began = time.monotonic()
    (await client.get(f"{llama_server.url}/v1/models")).raise_for_status()  # waits for the model's lock
    lock_wait_seconds = time.monotonic() - lock_began
    log_after_close = await wait_for_log(llama_server, "Disconnected from client", since)
    assert "Disconnected from client (via refresh/close)" in log_after_close

    cut_run_tokens = await generated_tokens_seen_by_probe()
    assert cut_run_tokens < 50, f"generation went on after the client closed: {cut_run_tokens} tokens"
    print(
        f"\nearly stop: read {events} events in {read_seconds:.2f} s, closed; model lock free after "
        f"{lock_wait_seconds * 1000:.0f} ms; tokens decoded: full run {full_run_tokens}, "
        f"cut run {cut_run_tokens}"
    )


async def test_shared_system_prompt_is_reused_from_the_kv_cache(
    llama_server: LlamaServer, client: httpx.AsyncClient
) -> None:
    system = SYSTEM_LONG + " " + " ".join(f"Fact {i}: the shop opens at {i % 12 + 1} o'clock." for i in range(30))
    system_tokens = await count_tokens(client, llama_server, system)

    async def time_to_first_token(user: str) -> tuple[float, list[tuple[int, int]]]:
        since = len(llama_server.log_text())
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        body = chat_body(llama_server, messages, stream=True, max_tokens=4, temperature=0)
        began = time.monotonic()
        first = None
        async with client.stream("POST", f"{llama_server.url}/v1/chat/completions", json=body) as response:
            async for payload in sse_events(response):
                if first is None and '"content"' in payload:
                    first = time.monotonic() - began
        return first or time.monotonic() - began, prefix_hits(llama_server.log_text()[since:])

    cold_seconds, cold_hits = await time_to_first_token("Hello there!")
    warm_seconds, warm_hits = await time_to_first_token("Do you sell roses?")
    # Cold: at most <bos> and the turn marker matched the previous test's prompt.
    assert not cold_hits or cold_hits[-1][0] < 20
    assert warm_hits, "the second request re-evaluated the whole prompt"
    reused, remaining = warm_hits[-1]
    assert reused >= system_tokens
    assert remaining < 20
    print(
        f"\nprefix reuse: system {system_tokens} tokens; "
        f"time to first token cold {cold_seconds * 1000:.0f} ms, "
        f"warm {warm_seconds * 1000:.0f} ms (reused {reused}, evaluated {remaining})"
    )
