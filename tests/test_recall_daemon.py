"""Recall and said-again as the running daemon does them: a real world, the daemon process, a fake LLM."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from tests.daemon import log_events, start_bridge
from tests.fakes.llm_servers import FakeOllama
from tests.test_memory_daemon import env_for, read, stop, wait_until
from tests.world.harness import WorldServer

pytestmark = pytest.mark.world

CASES = Path(__file__).parent / "memory" / "recall.jsonl"  # the shared examples' recall.jsonl
CAMP = "ユーザーは来週の土曜にキャンプに行く"


def _case(case_id: str) -> dict[str, Any]:
    for line in CASES.read_text(encoding="utf-8").splitlines():
        case: dict[str, Any] = json.loads(line)
        if case["id"] == case_id:
            return case
    raise LookupError(case_id)


def _write_memories(memory_dir: Path, npc_id: str, memories: list[dict[str, Any]]) -> None:
    memory_dir.mkdir(parents=True, exist_ok=True)
    content = {"version": 1, "npc_id": npc_id, "memories": memories, "pending": []}
    (memory_dir / f"{npc_id}.json").write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")


def _memory_message(messages: list[dict[str, str]]) -> str:
    return messages[1]["content"] if len(messages) > 2 and "メモ" in messages[1]["content"] else ""


def _echoing(body: dict[str, Any]) -> str:
    """A different reply to each line (the same reply twice would be regenerated)."""
    return f"「{body['messages'][-1]['content'][:6]}」、そうなんですね。"


async def test_a_line_about_the_oldest_memory_of_sixty_brings_it_into_the_reply_request(
    live_world: WorldServer, tmp_path: Path
) -> None:
    case = _case("k10-引っ越し")  # the expected memory is number 1 of 60: the oldest
    assert case["memories"][0]["text"] == case["expect"]
    memory_dir = tmp_path / "memory"
    _write_memories(memory_dir, "cinema-aoi", case["memories"])
    async with FakeOllama(default=_echoing) as llm:
        proc = await start_bridge(env_for(live_world, llm, memory_dir), tmp_path / "b.log")
        try:
            await live_world.wait_for_worker(20)
            first = await live_world.inject_talk("cinema-aoi", "player-1", "こんにちは")
            await live_world.wait_for_say(lambda p: p["replyTo"] == first, timeout=15)
            second = await live_world.inject_talk("cinema-aoi", "player-1", case["line"])
            await live_world.wait_for_say(lambda p: p["replyTo"] == second, timeout=15)
        finally:
            await stop(proc)
    greeting, about_it = [request.messages for request in llm.requests]
    shown = _memory_message(about_it)
    heard = datetime.fromisoformat(case["memories"][0]["heard_at"]).astimezone(ZoneInfo("Asia/Tokyo"))
    assert f"- ({heard.month}/{heard.day}) {case['expect']}" in shown
    assert case["expect"] not in _memory_message(greeting)  # "こんにちは" is about nothing: the newest 10
    for newest in case["newest"]:
        assert newest in shown
    assert shown.count("\n- (") == 10
    # The memories change from one line to the next; the system message does not.
    assert greeting[0] == about_it[0] and "引っ越し" not in about_it[0]["content"]
    said = [e for e in log_events(tmp_path / "b.log") if e["event"] == "reply_said"]
    counts = [(e["recalled_recent"], e["recalled_relevant"]) for e in said]
    assert sum(counts[0]) == sum(counts[1]) == 10
    assert counts[1][0] >= 3 and counts[1][1] >= 1
    assert all("recalled" not in e for e in said)  # no texts without content logging


async def test_a_plan_heard_again_is_one_memory_with_the_new_date_in_the_file_and_the_next_prompt(
    live_world: WorldServer, tmp_path: Path
) -> None:
    memory_dir = tmp_path / "memory"
    heard_first = "2026-09-29T21:14:03+09:00"
    _write_memories(
        memory_dir,
        "cafe-minori",
        [
            {"text": CAMP, "heard_at": heard_first, "source": "extraction"},
            {"text": "ユーザーは紅茶が好き", "heard_at": "2026-09-30T20:00:00+09:00", "source": "extraction"},
        ],
    )

    def answer(body: dict[str, Any]) -> str:
        if "format" in body:  # the extraction: the model hears the plan again
            return json.dumps({"memories": [CAMP + "。"]}, ensure_ascii=False)
        return "いいですね、楽しんできてください。"

    log_path = tmp_path / "b.log"
    async with FakeOllama(default=answer) as llm:
        env = env_for(live_world, llm, memory_dir, NPC_BRIDGE_MEMORY_SILENCE_SECONDS="1", NPC_BRIDGE_LOG_CONTENT="1")
        proc = await start_bridge(env, log_path)
        try:
            await live_world.wait_for_worker(20)
            first = await live_world.inject_talk("cafe-minori", "player-1", "来週の土曜はキャンプに行くんだ")
            await live_world.wait_for_say(lambda p: p["replyTo"] == first, timeout=15)
            await wait_until(lambda: read(memory_dir, "cafe-minori")["memories"][-1]["text"] == CAMP)
            second = await live_world.inject_talk("cafe-minori", "player-2", "キャンプの準備してるよ")
            await live_world.wait_for_say(lambda p: p["replyTo"] == second, timeout=15)
        finally:
            await stop(proc)
    memories = read(memory_dir, "cafe-minori")["memories"]
    assert [m["text"] for m in memories] == ["ユーザーは紅茶が好き", CAMP]
    assert memories[-1]["heard_at"] != heard_first
    again = datetime.fromisoformat(memories[-1]["heard_at"]).astimezone(ZoneInfo("Asia/Tokyo"))
    replies = [r.messages for r in llm.requests if "format" not in r.body]
    assert f"- (9/29) {CAMP}" in _memory_message(replies[0])
    assert f"- ({again.month}/{again.day}) {CAMP}" in _memory_message(replies[-1])
    assert f"(9/29) {CAMP}" not in _memory_message(replies[-1])
    events = log_events(log_path)
    refreshed = [e for e in events if e["event"] == "memory_refreshed"]
    assert len(refreshed) == 1 and refreshed[0]["text"] == CAMP
    assert not any(e["event"] == "memory_rejected" for e in events)
    said = [e for e in events if e["event"] == "reply_said"]
    assert CAMP in said[-1]["recalled"]  # with content logging, the recalled texts
