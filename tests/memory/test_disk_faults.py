"""A memory disk that fails at run time, for real (a tiny tmpfs): full, then read-only. Nothing said is
lost, nothing waits on the disk, no write is left half-done, and one warning a minute, not one a line."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from bridge.llm.gate import LLMGate
from bridge.llm.ollama import OllamaBackend
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.store import MemoryStore
from tests.fakes.llm_servers import FakeOllama
from tests.memory.helpers import FAST_RETRY, eventually, recalled_lines, roster, running, settings
from tests.memory.tinydisk import TinyDisk, tiny_disk

JST = timezone(timedelta(hours=9))
AT = datetime(2026, 9, 29, 21, 12, 40, tzinfo=JST)
NOTE_SECONDS = 1.0  # a note on a failing disk returns at once; this only catches one that waits on it


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[TinyDisk]:
    with tiny_disk(tmp_path / "memory") as mounted:
        yield mounted


@pytest.fixture
async def backend() -> AsyncIterator[OllamaBackend]:
    async with FakeOllama(default='{"memories": ["ユーザーは紅茶が好き"]}') as server:
        client = OllamaBackend(server.url, retry=FAST_RETRY)
        yield client
        await client.aclose()


def make_keeper(directory: Path, backend: OllamaBackend, **overrides: Any) -> MemoryKeeper:
    config = settings(directory, **{"memory_silence_seconds": 3600, **overrides})
    return MemoryKeeper(
        store=MemoryStore(directory, limit=config.memory_limit, retry_base_seconds=0.05),
        backend=backend,
        gate=LLMGate(1),
        roster=roster(),
        settings=config,
        shared=None,
        retry_base_seconds=0.05,
        retry_cap_seconds=0.2,
    )


def players(disk: TinyDisk, npc_id: str) -> list[str]:
    path = disk.path / f"{npc_id}.json"
    if not path.exists():
        return []
    return [line["player"] for line in json.loads(path.read_text(encoding="utf-8"))["pending"]]


async def note(keeper: MemoryKeeper, npc_id: str, words: list[str]) -> None:
    for word in words:
        await asyncio.wait_for(keeper.note_exchange(npc_id, player=word, npc="はい。", at=AT), NOTE_SECONDS)


async def test_a_full_disk_loses_nothing_and_writes_everything_in_order_once_it_has_room(
    disk: TinyDisk, backend: OllamaBackend
) -> None:
    with capture_logs() as logs:
        async with running(make_keeper(disk.path, backend)) as keeper:
            await note(keeper, "cafe-minori", ["一"])
            disk.fill()
            await note(keeper, "cafe-minori", ["二", "三", "四", "五"])
            await note(keeper, "ryokan-fumi", ["いち", "に"])
            await asyncio.sleep(0.3)  # retries fail meanwhile
            assert players(disk, "cafe-minori") == ["一"]  # the file as it was: whole, not truncated
            assert disk.files() == ["cafe-minori.json"]  # no temporary file, no empty file
            disk.free()
            await eventually(lambda: players(disk, "cafe-minori") == ["一", "二", "三", "四", "五"])
            await eventually(lambda: players(disk, "ryokan-fumi") == ["いち", "に"])
            assert disk.files() == ["cafe-minori.json", "ryokan-fumi.json"]
    failed = [entry for entry in logs if entry["event"] == "memory_write_failed"]
    assert len(failed) == 1, "one warning a minute, not one per line or per retry"
    assert failed[0]["error"] == "ENOSPC"
    assert [entry["event"] for entry in logs].count("memory_write_recovered") == 1


async def test_a_read_only_disk_loses_nothing_and_writes_everything_in_order_once_writable(
    disk: TinyDisk, backend: OllamaBackend
) -> None:
    with capture_logs() as logs:
        async with running(make_keeper(disk.path, backend)) as keeper:
            await note(keeper, "cafe-minori", ["一", "二"])
            disk.read_only()
            try:
                await note(keeper, "cafe-minori", ["三", "四"])
                assert await keeper.recall("cafe-minori", query="紅茶") == []  # replies go on
                await asyncio.sleep(0.3)
                assert players(disk, "cafe-minori") == ["一", "二"]
            finally:
                disk.writable()
            await note(keeper, "cafe-minori", ["五"])
            await eventually(lambda: players(disk, "cafe-minori") == ["一", "二", "三", "四", "五"])
            assert disk.files() == ["cafe-minori.json"]
    assert [entry["error"] for entry in logs if entry["event"] == "memory_write_failed"] == ["EROFS"]


async def test_memories_extracted_while_the_disk_is_full_are_stored_once_it_has_room(
    disk: TinyDisk, backend: OllamaBackend
) -> None:
    disk.fill()
    async with running(make_keeper(disk.path, backend, memory_silence_seconds=0.2)) as keeper:
        await note(keeper, "cafe-minori", ["ここの紅茶がすきなんだよ"])
        # Extracted and checked on the full disk: the memory is recalled from RAM meanwhile.
        recalled: list[str] = []

        async def recall() -> None:
            recalled[:] = await recalled_lines(keeper, "cafe-minori", "紅茶")

        async with asyncio.timeout(5):
            while not recalled:
                await recall()
                await asyncio.sleep(0.02)
        assert recalled == ["- (9/29) ユーザーは紅茶が好き"]
        assert disk.files() == []
        disk.free()
        await eventually(lambda: disk.files() == ["cafe-minori.json"])
    data = json.loads((disk.path / "cafe-minori.json").read_text(encoding="utf-8"))
    assert [memory["text"] for memory in data["memories"]] == ["ユーザーは紅茶が好き"]
    assert data["pending"] == []
