"""Client of the shared long-term memory service on the LAN (memory.md "Shared memory").

The transport (`SharedMemoryClient`) and the courier of the outbox (`OutboxCourier`): memories
waiting for the service are kept in the character's own memory file (its `outbox` list, see
`bridge.memory.models`), handed over in order by one task per NPC, removed once the service took
them (at least once: a crash between the two may send one again), and retried with backoff while it
is down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from bridge.backoff import Backoff
from bridge.errors import MemoryStoreError, SharedMemoryUnavailable
from bridge.memory.models import iso_seconds
from bridge.memory.store import MemoryStore

log = structlog.get_logger(__name__)

SHARED_SOURCE = "3Dゲームの中のはるので話したとき"
RECALL_LIMIT = 5
REQUEST_TIMEOUT_SECONDS = 10.0


class SharedMemory(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    text: str
    created_at: str = ""
    source: str = ""


class _RecallAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    memories: list[SharedMemory]


class SharedMemoryClient:
    """`recall` and `save` against the service; raises SharedMemoryUnavailable when it is down."""

    def __init__(
        self,
        url: str,
        *,
        timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._client = client or httpx.AsyncClient(timeout=timeout_seconds)
        self._owns_client = client is None

    async def recall(self, query: str, limit: int = RECALL_LIMIT) -> list[SharedMemory]:
        """Memories close to `query`, as the service ranks them."""
        data = await self._post("/recall", {"query": query, "limit": limit})
        try:
            return _RecallAnswer.model_validate(data).memories[:limit]
        except ValidationError as exc:
            raise MemoryStoreError(f"shared memory service: unexpected /recall answer: {exc}") from None

    async def save(self, text: str, created_at: datetime | str, source: str = SHARED_SOURCE) -> None:
        """Hand one checked memory to the service."""
        when = iso_seconds(created_at) if isinstance(created_at, datetime) else created_at
        await self._post("/memories", {"text": text, "source": source, "created_at": when})

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        try:
            response = await self._client.post(self.url + path, json=body)
        except httpx.HTTPError as exc:  # refused, reset, timed out
            raise SharedMemoryUnavailable(f"shared memory service {path}: {type(exc).__name__}") from exc
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise SharedMemoryUnavailable(f"shared memory service {path}: HTTP {response.status_code}")
        if response.status_code >= 400:
            raise MemoryStoreError(f"shared memory service {path}: HTTP {response.status_code}")
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise MemoryStoreError(f"shared memory service {path}: answer is not JSON") from None


class OutboxCourier:
    """One task per NPC with an outbox: hands its memories to the service, oldest first."""

    def __init__(
        self,
        store: MemoryStore,
        shared: SharedMemoryClient,
        *,
        backoff: Callable[[], Backoff],
    ) -> None:
        self._store = store
        self._shared = shared
        self._backoff = backoff
        self._tasks: dict[str, asyncio.Task[None]] = {}  # only while an outbox holds something

    def ensure(self, npc_id: str) -> None:
        """Deliver this NPC's outbox unless a task already does."""
        task = self._tasks.get(npc_id)
        if task is None or task.done():
            self._tasks[npc_id] = asyncio.create_task(self._deliver(npc_id), name=f"memory-deliver-{npc_id}")

    def stop(self) -> list[asyncio.Task[None]]:
        """The running tasks, for the caller to cancel and await; the outboxes stay on disk."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        return tasks

    async def _deliver(self, npc_id: str) -> None:
        backoff = self._backoff()
        try:
            while True:
                # No await between this check and leaving: a memory queued later starts a new task.
                waiting = (await self._store.load(npc_id)).outbox
                if not waiting:
                    return
                first = waiting[0]
                try:
                    await self._shared.save(first.text, first.created_at, first.source)
                except Exception as exc:
                    delay = backoff.next_delay()
                    if isinstance(exc, MemoryStoreError):
                        log.warning(
                            "shared_memory_save_failed",
                            npc=npc_id,
                            error=type(exc).__name__,
                            detail=str(exc)[:200],
                            waiting=len(waiting),
                            retry_in_seconds=round(delay, 1),
                        )
                    else:  # a bug: logged with its traceback; the memory stays queued
                        log.exception("shared_memory_save_crashed", npc=npc_id)
                    await asyncio.sleep(delay)
                    continue
                # Only this task removes from the outbox, and only from its head: that is `first`.
                await self._store.remove_outbox(npc_id, 1)
                backoff.reset()
                log.info("shared_memory_saved", npc=npc_id, text=first.text)
        finally:
            if self._tasks.get(npc_id) is asyncio.current_task():
                del self._tasks[npc_id]
