"""The running daemon on a memory disk that fails under it (a real tiny tmpfs): full (ENOSPC) or
read-only (EROFS). Replies still go out, one warning, and once the disk takes writes again every line
is in the file, in the order said, with no temporary file left."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LIVE_WORLD_TOKEN
from tests.daemon import bridge_env, log_events, start_bridge, stop_bridge
from tests.fakes.llm_servers import FakeOllama
from tests.memory.tinydisk import TinyDisk, tiny_disk
from tests.world.harness import WorldServer

pytestmark = pytest.mark.world


REPLIES = ("いらっしゃいませ。", "はい、どうぞ。", "ありがとうございます。", "またお越しください。")


@pytest.fixture
async def llm() -> AsyncIterator[FakeOllama]:
    turns = itertools.count()
    # A new reply each turn: the same one twice would be replaced by a fallback (the repeat rule).
    async with FakeOllama(default=lambda body: REPLIES[next(turns) % len(REPLIES)]) as server:
        yield server


def players(disk: TinyDisk) -> list[str]:
    path = disk.path / "cafe-minori.json"
    if not path.exists():
        return []
    return [line["player"] for line in json.loads(path.read_text(encoding="utf-8"))["pending"]]


async def wait_until(check: Callable[[], bool], within: float) -> None:
    async with asyncio.timeout(within):
        while not check():  # noqa: ASYNC110 - another process writes the file
            await asyncio.sleep(0.1)


async def talk(world: WorldServer, text: str) -> dict[str, Any]:
    event_id = await world.inject_talk("cafe-minori", "player-1", text)
    return await world.wait_for_say(lambda p: p["replyTo"] == event_id, timeout=15)


@pytest.mark.parametrize("fault", ["full", "read-only"])
async def test_a_failing_memory_disk_never_stops_a_reply_and_loses_no_line(
    live_world: WorldServer, llm: FakeOllama, tmp_path: Path, fault: str
) -> None:
    log_path = tmp_path / "bridge.log"
    with tiny_disk(tmp_path / "memory") as disk:
        env = bridge_env(
            disk.path,
            NPC_BRIDGE_WORLD_URL=live_world.url,
            NPC_BRIDGE_WORLD_TOKEN=LIVE_WORLD_TOKEN,
            NPC_BRIDGE_LLM_URL=llm.url,
            NPC_BRIDGE_MEMORY_SILENCE_SECONDS="3600",
        )
        proc = await start_bridge(env, log_path)
        try:
            await live_world.wait_for_worker(20)
            await talk(live_world, "一つ目")
            await wait_until(lambda: players(disk) == ["一つ目"], 10)
            disk.fill() if fault == "full" else disk.read_only()
            try:
                for text in ("二つ目", "三つ目", "四つ目"):
                    say = await talk(live_world, text)
                    assert say["source"] == "generated"
                await asyncio.sleep(1.0)
                assert players(disk) == ["一つ目"]  # the file as it was, whole
                assert disk.files() == ["cafe-minori.json"]  # no temporary file left by a failed write
            finally:
                disk.free() if fault == "full" else disk.writable()
            # Retried with backoff (capped at 30 s; a few seconds here, after a few failures).
            await wait_until(lambda: players(disk) == ["一つ目", "二つ目", "三つ目", "四つ目"], 40)
            assert disk.files() == ["cafe-minori.json"]
        finally:
            code = await stop_bridge(proc)
    assert code == 0
    events = log_events(log_path)
    failed = [e for e in events if e["event"] == "memory_write_failed"]
    assert len(failed) == 1, "one warning a minute, not one per line"
    assert failed[0]["error"] == ("ENOSPC" if fault == "full" else "EROFS")
    assert sum(e["event"] == "memory_write_recovered" for e in events) == 1
