"""The product end to end with a real model: a real Colyseus world, `npc-bridge run` as a subprocess,
and Gemma 3 270M served by llama.cpp through the `openai` backend.

The 270M model is a fluent but unruly adversary: it echoes its prompt, writes labels and markdown and
never stops by itself. Whatever it writes, every `npc:say` must be clean and within the limits, and
whatever it "remembers" must pass every memory check or be rejected with a logged rule.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

import bridge.npc.responder as responder_module
from bridge.llm.openai import OpenAIBackend
from bridge.memory.checks import MemoryRules, check_candidates
from bridge.memory.extractor import extraction_instructions
from bridge.npc.characters import load_roster
from bridge.npc.cleaner import split_sentences
from bridge.npc.deadline import Deadline
from bridge.npc.prompt import build_reply_messages
from bridge.npc.responder import REPLY_MAX_TOKENS, ReplyContext, Responder
from bridge.settings import load_settings
from tests.conftest import LIVE_WORLD_TOKEN
from tests.daemon import REPO, bridge_env, log_events, start_bridge, stop_bridge
from tests.e2e.llama_server import LlamaServer, prefix_hits
from tests.world.harness import WorldServer

pytestmark = pytest.mark.e2e

STAFF = ("cafe-minori", "cinema-aoi", "ryokan-fumi")
PLAYER_LINES = {
    "cafe-minori": "こんにちは。ここの紅茶がすきなんだよ。",
    "cinema-aoi": "最近は昔のSF映画ばかり見てるんだ。",
    "ryokan-fumi": "来週の土曜に友だちとキャンプに行くんだ。",
}
DEADLINE_SECONDS = 60
CUT_TEST_LIMIT_SECONDS = 300
SILENCE_SECONDS = 2
MAX_SENTENCES = 2
MAX_CHARS = 90
# What a clean spoken line never holds: tags, markup, template tokens, speaker labels.
DIRTY = re.compile(r"[\[\]<>＜＞*#{}]|<\||end_of_turn|start_of_turn|(?:ユーザー|User|プレイヤー|旅人\d)\s*[:：]")


async def _wait_for_events(log_path: Path, done: Any, within: float) -> list[dict[str, Any]]:
    async with asyncio.timeout(within):
        while not done(events := log_events(log_path)):  # noqa: ASYNC110 - polling another process's log
            await asyncio.sleep(0.5)
    return events


async def _wait_for_log(server: LlamaServer, needle: str, since: int, within: float = 10.0) -> str:
    """The server's log after offset `since`, once it holds `needle` (or as it is after `within`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while needle not in server.log_text()[since:] and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    return server.log_text()[since:]


async def test_staff_answer_cleanly_and_memory_keeps_only_checked_facts(
    llama_server: LlamaServer, live_world: WorldServer, tmp_path: Path
) -> None:
    memory_dir = tmp_path / "memory"
    env = bridge_env(
        memory_dir,
        NPC_BRIDGE_WORLD_URL=live_world.url,
        NPC_BRIDGE_WORLD_TOKEN=LIVE_WORLD_TOKEN,
        NPC_BRIDGE_LLM_BACKEND="openai",
        NPC_BRIDGE_LLM_URL=llama_server.url,
        NPC_BRIDGE_LLM_MODEL=llama_server.model_alias,
        NPC_BRIDGE_LLM_CONTEXT_TOKENS="2048",
        NPC_BRIDGE_REPLY_DEADLINE_SECONDS=str(DEADLINE_SECONDS),
        NPC_BRIDGE_REPLY_MAX_SENTENCES=str(MAX_SENTENCES),
        NPC_BRIDGE_REPLY_MAX_CHARS=str(MAX_CHARS),
        NPC_BRIDGE_MEMORY_SILENCE_SECONDS=str(SILENCE_SECONDS),
        NPC_BRIDGE_LOG_CONTENT="true",
    )
    log_path = tmp_path / "bridge.log"
    proc = await start_bridge(env, log_path)
    try:
        await live_world.wait_for_worker(30)
        for npc in STAFF:
            loop = asyncio.get_running_loop()
            sent = loop.time()
            event_id = await live_world.inject_talk(npc, f"player-{npc}", PLAYER_LINES[npc], player_name="旅人1")
            say = await live_world.wait_for_say(lambda p, e=event_id: p["replyTo"] == e, timeout=DEADLINE_SECONDS + 15)
            took = loop.time() - sent
            text = say["text"]
            print(f"\n{npc}: {took:.1f} s {say['source']} {say['emotion']} {text!r}")
            assert took < DEADLINE_SECONDS + 5
            assert text.strip(), say
            assert not DIRTY.search(text), say
            sentences, rest = split_sentences(text)
            assert len(sentences) + (1 if rest.strip() else 0) <= MAX_SENTENCES, say
            assert len(text) <= MAX_CHARS, say
            assert say["emotion"] in ("neutral", "happy", "angry", "sad", "relaxed", "surprised")
            assert say["source"] in ("generated", "regenerated", "fallback")

        # After the silence, one extraction per NPC runs against the real model.
        def extracted(events: list[dict[str, Any]]) -> bool:
            finished = {e.get("npc") for e in events if e["event"] in ("memory_extracted", "memory_pending_dropped")}
            return set(STAFF) <= finished

        events = await _wait_for_events(log_path, extracted, within=240)
        assert proc.returncode is None, "the daemon died"
    finally:
        assert await stop_bridge(proc) == 0
    names = [e["event"] for e in events]
    assert "component_crashed" not in names and "reply_crashed" not in names
    for rejected in (e for e in events if e["event"] == "memory_rejected"):
        assert rejected["rule"], rejected
        print(f"rejected ({rejected['rule']}): {rejected.get('candidate', rejected.get('memory_text'))!r}")

    # Whatever was stored passes every check on its own: no junk reached the files.
    settings = load_settings()
    rules = MemoryRules.from_settings(settings, instructions=extraction_instructions(settings.memory_subject))
    for npc in STAFF:
        path = memory_dir / f"{npc}.json"
        stored = json.loads(path.read_text(encoding="utf-8"))["memories"] if path.exists() else []
        for item in stored:
            print(f"kept by {npc}: {item['text']!r}")
            kept, rejections = check_candidates([item["text"]], kept=[], rules=rules)
            assert kept == [item["text"]] and not rejections, item


def _render(messages: list[dict[str, str]]) -> str:
    """The Gemma 3 template's rendering of a system + user exchange (tests/e2e/gemma3_tokenizer_config)."""
    system, user = messages
    return f"<start_of_turn>user\n{system['content']}\n\n{user['content']}<end_of_turn>\n<start_of_turn>model\n"


async def test_reply_stream_is_cut_once_two_sentences_are_complete(
    llama_server: LlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server keeps the last generation in its KV cache and logs how much of a new prompt it
    reuses, so a probe whose prompt is the uncut continuation shows how far generation really went."""
    # Deterministic generation, so the reference run and the bridge's run write the same tokens.
    monkeypatch.setattr(responder_module, "REPLY_TEMPERATURE", 0.0)
    # This model mostly recites its prompt at temperature 0, which the checks rightly refuse; a
    # regeneration would replace the generation the probe looks at. Only the stream is under test.
    monkeypatch.setattr(responder_module, "check_reply", lambda *args, **kwargs: None)
    settings = load_settings(
        llm_backend="openai", llm_url=llama_server.url, llm_model=llama_server.model_alias, llm_context_tokens=2048
    )
    roster = load_roster(REPO / "characters")
    character = roster.characters["cafe-minori"]
    player_line = "おすすめのコーヒーについて、くわしく教えてください。"
    messages = [
        m.as_dict()
        for m in build_reply_messages(
            character, max_sentences=2, world_lines=(), memories=(), history=(), player_line=player_line
        )
    ]
    # Generous limits: this test is about where the stream is cut, not about speed; on a loaded 2-core
    # machine (a busy loop and another llama.cpp beside it) this reply once took over 60 s.
    async with httpx.AsyncClient(timeout=CUT_TEST_LIMIT_SECONDS) as client:
        reference = await client.post(
            f"{llama_server.url}/v1/chat/completions",
            json={
                "model": llama_server.model_alias,
                "messages": messages,
                "max_tokens": REPLY_MAX_TOKENS,
                "temperature": 0.0,
            },
        )
        reference.raise_for_status()
        answer = reference.json()
        prompt_tokens: int = answer["usage"]["prompt_tokens"]
        full_tokens: int = answer["usage"]["completion_tokens"]
        if answer["choices"][0]["finish_reason"] != "length":
            pytest.fail(f"the model stopped by itself after {full_tokens} tokens: nothing to cut")
        probe_prompt = _render(messages) + answer["choices"][0]["message"]["content"]

        backend = OpenAIBackend(llama_server.url)
        try:
            responder = Responder(backend=backend, settings=settings, roster=roster)
            context = ReplyContext(character=character, player_line=player_line, player_name="旅人1")
            since = len(llama_server.log_text())
            reply = await responder.respond(context, deadline=Deadline.after(CUT_TEST_LIMIT_SECONDS))
        finally:
            await backend.aclose()
        print(f"\nreply: {reply.source} stopped_early={reply.stopped_early} {reply.text!r}")
        assert reply.stopped_early, reply
        assert "Disconnected from client" in await _wait_for_log(llama_server, "Disconnected from client", since)

        since = len(llama_server.log_text())
        probe = await client.post(
            f"{llama_server.url}/v1/completions",
            json={"model": llama_server.model_alias, "prompt": probe_prompt, "max_tokens": 1, "temperature": 0},
        )
        probe.raise_for_status()
        hits = prefix_hits(await _wait_for_log(llama_server, "prefix-match hit", since))
    assert hits, "the probe found no prefix in the KV cache"
    generated = hits[-1][0] - prompt_tokens
    print(f"tokens generated: uncut {full_tokens}, bridge {generated} (max_tokens {REPLY_MAX_TOKENS})")
    assert generated < full_tokens // 2
