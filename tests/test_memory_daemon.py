"""Memory as the running daemon keeps it: crash safety, corrupt files, recall in the prompt, isolation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from tests.conftest import LIVE_WORLD_TOKEN
from tests.daemon import bridge_env, log_events, start_bridge, stop_bridge
from tests.fakes.llm_servers import FakeOllama
from tests.world.harness import WorldServer

pytestmark = pytest.mark.world

TOKEN = LIVE_WORLD_TOKEN
TEA_MEMORY = "ユーザーは紅茶が好き"


def answer(body: dict[str, Any]) -> str:
    """Replies to replies; one memory to extractions (they ask for JSON)."""
    if "format" in body:
        return json.dumps({"memories": [TEA_MEMORY]}, ensure_ascii=False)
    return "紅茶、いいですよね。"


@pytest.fixture
async def llm() -> AsyncIterator[FakeOllama]:
    async with FakeOllama(default=answer) as server:
        yield server


def env_for(world: WorldServer, llm: FakeOllama, memory_dir: Path, **values: str) -> dict[str, str]:
    return bridge_env(
        memory_dir,
        NPC_BRIDGE_WORLD_URL=world.url,
        NPC_BRIDGE_WORLD_TOKEN=TOKEN,
        NPC_BRIDGE_LLM_URL=llm.url,
        NPC_BRIDGE_TIMEZONE="Asia/Tokyo",
        **values,
    )


async def stop(proc: asyncio.subprocess.Process) -> None:
    assert await stop_bridge(proc) == 0


def read(memory_dir: Path, npc: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((memory_dir / f"{npc}.json").read_text(encoding="utf-8"))
    return data


async def wait_until(check: Any, within: float = 15.0) -> None:
    async with asyncio.timeout(within):
        while not _holds(check):  # noqa: ASYNC110 - another process writes the file
            await asyncio.sleep(0.1)


def _holds(check: Any) -> bool:
    # The say can reach the world before the first write of the memory file does: not there yet is "not yet".
    try:
        return bool(check())
    except FileNotFoundError:
        return False


async def test_pending_conversation_survives_kill_9_and_is_extracted_after_restart(
    live_world: WorldServer, llm: FakeOllama, tmp_path: Path
) -> None:
    memory_dir = tmp_path / "memory"
    log_path = tmp_path / "bridge.log"
    # A silence far longer than the test: the only extraction can come from the restart.
    proc = await start_bridge(env_for(live_world, llm, memory_dir, NPC_BRIDGE_MEMORY_SILENCE_SECONDS="3600"), log_path)
    try:
        await live_world.wait_for_worker(20)
        event_id = await live_world.inject_talk("cafe-minori", "player-1", "ここの紅茶がすきなんだよ")
        await live_world.wait_for_say(lambda p: p["replyTo"] == event_id, timeout=15)
        path = memory_dir / "cafe-minori.json"
        await wait_until(lambda: path.exists() and read(memory_dir, "cafe-minori")["pending"])
        proc.kill()  # SIGKILL: no shutdown stage runs
        await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
    assert read(memory_dir, "cafe-minori")["pending"][0]["player"] == "ここの紅茶がすきなんだよ"
    assert not any("format" in r.body for r in llm.requests)

    proc = await start_bridge(env_for(live_world, llm, memory_dir, NPC_BRIDGE_MEMORY_SILENCE_SECONDS="3600"), log_path)
    try:
        await wait_until(lambda: read(memory_dir, "cafe-minori")["pending"] == [])
        extraction = [r for r in llm.requests if "format" in r.body]
        assert len(extraction) == 1
        assert "ここの紅茶がすきなんだよ" in json.dumps(extraction[0].messages, ensure_ascii=False)
        assert [m["text"] for m in read(memory_dir, "cafe-minori")["memories"]] == [TEA_MEMORY]
    finally:
        await stop(proc)


async def test_after_silence_the_memory_is_extracted_and_recalled_with_its_date_for_that_npc_only(
    live_world: WorldServer, llm: FakeOllama, tmp_path: Path
) -> None:
    memory_dir = tmp_path / "memory"
    env = env_for(live_world, llm, memory_dir, NPC_BRIDGE_MEMORY_SILENCE_SECONDS="1")
    proc = await start_bridge(env, tmp_path / "b.log")
    try:
        await live_world.wait_for_worker(20)
        first = await live_world.inject_talk("cafe-minori", "player-1", "ここの紅茶がすきなんだよ")
        await live_world.wait_for_say(lambda p: p["replyTo"] == first, timeout=15)
        await wait_until(lambda: bool(read(memory_dir, "cafe-minori")["memories"]))
        heard_at = read(memory_dir, "cafe-minori")["memories"][0]["heard_at"]
        # The next day, another visit: a new session id and name.
        second = await live_world.inject_talk("cafe-minori", "player-2", "また来たよ", player_name="旅人2")
        await live_world.wait_for_say(lambda p: p["replyTo"] == second, timeout=15)
        third = await live_world.inject_talk("cinema-aoi", "player-2", "こんにちは", player_name="旅人2")
        await live_world.wait_for_say(lambda p: p["replyTo"] == third, timeout=15)
    finally:
        await stop(proc)
    replies = [r for r in llm.requests if "format" not in r.body]
    cafe_prompt = json.dumps(replies[1].messages, ensure_ascii=False)
    cinema_prompt = json.dumps(replies[2].messages, ensure_ascii=False)
    # The date as seen in the configured zone (the file keeps the time with its own offset).
    local = datetime.fromisoformat(heard_at).astimezone(ZoneInfo("Asia/Tokyo"))
    month, day = local.month, local.day
    assert f"- ({month}/{day}) {TEA_MEMORY}" in cafe_prompt
    assert TEA_MEMORY not in json.dumps(replies[1].messages[0], ensure_ascii=False)  # never in the system message
    assert TEA_MEMORY not in cinema_prompt and "紅茶" not in cinema_prompt


async def test_corrupt_memory_file_is_moved_aside_and_the_npc_still_answers(
    live_world: WorldServer, llm: FakeOllama, tmp_path: Path
) -> None:
    memory_dir = tmp_path / "memory"
    memory_dir.mkdir()
    (memory_dir / "cafe-minori.json").write_text('{"version": 1, "npc_id": "cafe-minori", "memo', encoding="utf-8")
    log_path = tmp_path / "bridge.log"
    proc = await start_bridge(env_for(live_world, llm, memory_dir), log_path)
    try:
        await live_world.wait_for_worker(20)
        event_id = await live_world.inject_talk("cafe-minori", "player-1", "こんにちは")
        say = await live_world.wait_for_say(lambda p: p["replyTo"] == event_id, timeout=15)
        assert say["source"] == "generated"
        await wait_until(lambda: bool(list(memory_dir.glob("cafe-minori.json.corrupt-*"))))
    finally:
        await stop(proc)
    (aside,) = memory_dir.glob("cafe-minori.json.corrupt-*")
    assert aside.read_text(encoding="utf-8").endswith('"memo')
    assert read(memory_dir, "cafe-minori")["pending"][0]["player"] == "こんにちは"
    events = log_events(log_path)
    assert any(e["event"] == "memory_file_corrupt" and e["level"] == "error" for e in events)
