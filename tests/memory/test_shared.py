"""Shared memory against a loopback memory service: recall, save, and saves queued while it is down."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from bridge.errors import SharedMemoryUnavailable
from bridge.llm.ollama import OllamaBackend
from bridge.memory.models import MemoryFile, OutboxItem
from bridge.memory.shared import SHARED_SOURCE, SharedMemoryClient
from bridge.memory.store import render
from tests.fakes.llm_servers import FakeOllama
from tests.memory.helpers import FAST_RETRY, eventually, make_keeper, read_file, recalled_lines, running
from tests.memory.memory_service import FakeMemoryService

JST = timezone(timedelta(hours=9))
AT = datetime(2026, 9, 29, 21, 12, 40, tzinfo=JST)


@pytest.fixture
async def service() -> AsyncIterator[FakeMemoryService]:
    async with FakeMemoryService() as fake:
        yield fake


@pytest.fixture
async def client(service: FakeMemoryService) -> AsyncIterator[SharedMemoryClient]:
    shared = SharedMemoryClient(service.url, timeout_seconds=2.0)
    yield shared
    await shared.aclose()


@pytest.fixture
async def backend() -> AsyncIterator[OllamaBackend]:
    async with FakeOllama() as server:
        server.script('{"memories": ["ユーザーは週末に山へ登る"]}')
        llm = OllamaBackend(server.url, retry=FAST_RETRY)
        yield llm
        await llm.aclose()


async def test_recall_posts_the_query_and_reads_the_memories(
    service: FakeMemoryService, client: SharedMemoryClient
) -> None:
    service.stored.append({"text": "ユーザーは紅茶が好き", "created_at": "2026-09-20T10:00:00+09:00", "source": "app"})
    found = await client.recall("紅茶ある？", limit=5)
    assert service.recall_bodies == [{"query": "紅茶ある？", "limit": 5}]
    assert [(m.text, m.created_at, m.source) for m in found] == [
        ("ユーザーは紅茶が好き", "2026-09-20T10:00:00+09:00", "app")
    ]


async def test_save_posts_text_source_and_time(service: FakeMemoryService, client: SharedMemoryClient) -> None:
    await client.save("ユーザーは紅茶が好き", AT)
    assert service.save_bodies == [
        {"text": "ユーザーは紅茶が好き", "source": SHARED_SOURCE, "created_at": "2026-09-29T21:12:40+09:00"}
    ]


async def test_a_service_that_is_down_raises_unavailable(
    service: FakeMemoryService, client: SharedMemoryClient
) -> None:
    service.failing = True
    with pytest.raises(SharedMemoryUnavailable):
        await client.recall("紅茶")
    service.failing = False
    await service.stop()
    with pytest.raises(SharedMemoryUnavailable):
        await client.save("ユーザーは紅茶が好き", AT)


async def test_a_shared_character_recalls_from_the_service(
    tmp_path: Path, service: FakeMemoryService, client: SharedMemoryClient, backend: OllamaBackend
) -> None:
    service.stored.append({"text": "ユーザーは紅茶が好き", "created_at": "2026-09-20T23:30:00+00:00", "source": "app"})
    keeper = make_keeper(tmp_path, backend, shared=client)
    assert await recalled_lines(keeper, "haruno", "紅茶のむ？") == ["- (9/21) ユーザーは紅茶が好き"]
    assert service.recall_bodies == [{"query": "紅茶のむ？", "limit": 5}]
    # A file-backend character never asks the service.
    assert await recalled_lines(keeper, "cafe-minori", "紅茶") == []
    assert len(service.recall_bodies) == 1


async def test_while_the_service_is_down_recall_is_empty_and_saves_wait_on_disk(
    tmp_path: Path, service: FakeMemoryService, client: SharedMemoryClient, backend: OllamaBackend
) -> None:
    service.stored.append({"text": "ユーザーは紅茶が好き", "created_at": "2026-09-20T10:00:00+09:00", "source": "app"})
    await service.stop()
    with capture_logs() as logs:
        async with running(make_keeper(tmp_path, backend, shared=client)) as keeper:
            assert await recalled_lines(keeper, "haruno", "紅茶") == []
            kept = await keeper.save_inline("haruno", ["ユーザーは来週から新しい仕事を始める"], at=AT)
            assert kept == ["ユーザーは来週から新しい仕事を始める"]
            await eventually(lambda: any(e["event"] == "shared_memory_save_failed" for e in logs))
            data = read_file(tmp_path, "haruno")
            assert data["memories"] == []
            assert data["outbox"] == [
                {
                    "text": "ユーザーは来週から新しい仕事を始める",
                    "created_at": "2026-09-29T21:12:40+09:00",
                    "source": SHARED_SOURCE,
                }
            ]
            await service.start()  # back on the same port
            await eventually(lambda: len(service.stored) == 2)
            await eventually(lambda: "outbox" not in read_file(tmp_path, "haruno"))
    assert service.stored[-1]["text"] == "ユーザーは来週から新しい仕事を始める"
    assert any(e["event"] == "shared_memory_recall_failed" for e in logs)


async def test_memories_queued_before_a_restart_are_delivered_after_it(
    tmp_path: Path, service: FakeMemoryService, client: SharedMemoryClient, backend: OllamaBackend
) -> None:
    queued = MemoryFile(
        npc_id="haruno",
        outbox=(OutboxItem(text="ユーザーは猫を二匹飼っている", created_at=AT, source=SHARED_SOURCE),),
    )
    (tmp_path / "haruno.json").write_text(render(queued))
    async with running(make_keeper(tmp_path, backend, shared=client)):
        await eventually(lambda: len(service.stored) == 1)
        await eventually(lambda: "outbox" not in read_file(tmp_path, "haruno"))
    assert service.stored[0]["text"] == "ユーザーは猫を二匹飼っている"


async def test_a_shared_character_extracted_after_silence_saves_to_the_service(
    tmp_path: Path, service: FakeMemoryService, client: SharedMemoryClient, backend: OllamaBackend
) -> None:
    async with running(make_keeper(tmp_path, backend, shared=client)) as keeper:
        await keeper.note_exchange("home-silent", player="週末はいつも山に登るんだ", npc="いいね！", at=AT)
        await eventually(lambda: len(service.stored) == 1)
        await eventually(lambda: read_file(tmp_path, "home-silent")["pending"] == [])
    assert service.stored[0] == {
        "text": "ユーザーは週末に山へ登る",
        "source": SHARED_SOURCE,
        "created_at": "2026-09-29T21:12:40+09:00",
    }
    assert read_file(tmp_path, "home-silent")["memories"] == []


async def test_without_a_service_url_a_shared_character_warns_once_and_uses_its_file(
    tmp_path: Path, backend: OllamaBackend
) -> None:
    keeper = make_keeper(tmp_path, backend, shared=None)
    with capture_logs() as logs:
        await keeper.save_inline("haruno", ["ユーザーは紅茶が好き"], at=AT)
        await keeper.save_inline("haruno", ["ユーザーは猫を飼っている"], at=AT)
        recalled = await recalled_lines(keeper, "haruno", "紅茶")
    assert recalled == ["- (9/29) ユーザーは紅茶が好き", "- (9/29) ユーザーは猫を飼っている"]
    assert [e["event"] for e in logs].count("shared_memory_unconfigured") == 1
