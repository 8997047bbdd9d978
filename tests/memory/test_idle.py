"""Memory held in RAM follows the NPCs in use, not the cast: idle per-NPC state is let go (never with
a write not on disk or a timer running) and read again from the file when the NPC is next used."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from bridge.llm.gate import LLMGate
from bridge.llm.ollama import OllamaBackend
from bridge.memory.active import IDLE_SECONDS
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.models import PendingLine
from bridge.memory.store import MemoryStore
from tests.fakes.llm_servers import FakeOllama
from tests.memory.helpers import FAST_RETRY, recalled_lines, roster, running, settings

JST = timezone(timedelta(hours=9))
AT = datetime(2026, 9, 29, 21, 12, 40, tzinfo=JST)
CAST = 300


class Clock:
    """A monotonic clock the test moves: minutes pass without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def backend() -> AsyncIterator[OllamaBackend]:
    async with FakeOllama(default='{"memories": []}') as server:
        client = OllamaBackend(server.url, retry=FAST_RETRY)
        yield client
        await client.aclose()


async def test_idle_npcs_are_let_go_and_their_memory_read_again_when_next_needed(
    tmp_path: Path, backend: OllamaBackend
) -> None:
    clock = Clock()
    seed = MemoryStore(tmp_path, limit=60)
    for n in range(CAST):
        await seed.add_memories(f"shop-{n}", [f"ユーザーはお店{n}の常連"], AT, "extraction")
    config = settings(tmp_path, memory_silence_seconds=3600)
    store = MemoryStore(tmp_path, limit=60, monotonic=clock)
    keeper = MemoryKeeper(
        store=store,
        backend=backend,
        gate=LLMGate(1),
        roster=roster(),
        settings=config,
        shared=None,
        monotonic=clock,
    )
    async with running(keeper):
        before = {}
        for n in range(CAST):  # a street of shops, each talked to once
            keeper.touch(f"shop-{n}")
            before[n] = await recalled_lines(keeper, f"shop-{n}", "")
        # One NPC still in a conversation: its silence timer runs (3600 s), its state must stay.
        await keeper.note_exchange("cafe-minori", player="紅茶がすき", npc="はい。", at=AT)
        assert len(keeper._npcs) == CAST + 1 and len(store.in_memory()) == CAST + 1

        clock.now += IDLE_SECONDS + 1
        keeper.touch("shop-7")  # the one NPC talked to now
        await keeper.recall("shop-7", query="")
        assert sorted(keeper._npcs) == ["cafe-minori", "shop-7"]
        assert sorted(store.in_memory()) == ["shop-7"]  # cafe-minori's file is on disk: read again when due

        # A later visit reads the file again and recalls the same memories.
        assert await recalled_lines(keeper, "shop-42", "") == before[42] == ["- (9/29) ユーザーはお店42の常連"]
        assert "shop-42" in store.in_memory()
        assert [line.player for line in (await store.load("cafe-minori")).pending] == ["紅茶がすき"]


async def test_a_memory_file_not_yet_on_disk_is_never_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bridge.memory.store as store_module

    clock = Clock()
    store = MemoryStore(tmp_path, limit=60, monotonic=clock, retry_base_seconds=0.02)
    real_replace = store_module.os.replace
    refusing = True

    def full_disk(src: str, dst: str) -> None:
        if refusing:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(store_module.os, "replace", full_disk)
    await store.append_pending("cafe-minori", PendingLine(player="一", npc="はい。", at=AT))
    clock.now += IDLE_SECONDS + 1
    await store.load("ryokan-fumi")  # a use that looks for idle state
    assert sorted(store.in_memory()) == ["cafe-minori", "ryokan-fumi"]  # its line is only in RAM

    refusing = False
    assert await store.flush(5.0)
    clock.now += IDLE_SECONDS + 1
    await store.load("ryokan-fumi")
    assert store.in_memory() == ["ryokan-fumi"]
    assert [line.player for line in (await store.load("cafe-minori")).pending] == ["一"]  # read again from the file


async def test_an_npc_let_go_mid_silence_is_still_extracted(tmp_path: Path, backend: OllamaBackend) -> None:
    clock = Clock()
    config = settings(tmp_path, memory_silence_seconds=0.3)
    store = MemoryStore(tmp_path, limit=60, monotonic=clock)
    keeper = MemoryKeeper(
        store=store, backend=backend, gate=LLMGate(1), roster=roster(), settings=config, shared=None, monotonic=clock
    )
    async with running(keeper):
        await keeper.note_exchange("cafe-minori", player="紅茶がすき", npc="はい。", at=AT)
        clock.now += IDLE_SECONDS + 1
        await keeper.recall("ryokan-fumi", query="")  # the store lets cafe-minori's file go meanwhile
        async with asyncio.timeout(5):
            while (await store.load("cafe-minori")).pending:  # noqa: ASYNC110 - the extraction signals nothing
                await asyncio.sleep(0.02)
