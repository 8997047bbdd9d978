"""Client of the shared long-term memory service on the LAN (memory.md "Shared memory").

Only the transport lives here. Memories waiting for the service are kept by the keeper in the
character's own memory file (its `outbox` list, see `bridge.memory.models`), removed once the service
took them, and retried with backoff while it is down.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
import structlog
from pydantic import BaseModel, ConfigDict, ValidationError

from bridge.errors import MemoryStoreError, SharedMemoryUnavailable
from bridge.memory.models import iso_seconds

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
