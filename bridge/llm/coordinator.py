"""The `coordinator` backend: the LAN coordinator's /route, pinned to one worker and model, not streamed."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import httpx

from bridge.errors import LLMError, LLMResponseError
from bridge.llm._http import (
    DEFAULT_RETRY,
    Deadline,
    RetryPolicy,
    RetryState,
    make_client,
    read_error_body,
    request_timeout,
    status_error,
    transport_error,
)
from bridge.llm.base import Chunk, Done, GenerationRequest, GenerationStats, LLMBackend, TextChunk

ROUTE_PATH = "/route"
# The coordinator enforces deadline_ms itself; give it this long past it to answer with its own error.
DEADLINE_GRACE_SECONDS = 2.0


def route_body(request: GenerationRequest, worker: str, remaining_seconds: float) -> dict[str, Any]:
    """The /route body: the pinned worker and model, or the character's lane instead of both."""
    body: dict[str, Any] = {"messages": [message.as_dict() for message in request.messages]}
    if request.lane is not None:
        body["lane"] = request.lane
    else:
        body["worker"] = worker
        body["models"] = [request.model]
    body["options"] = {
        "temperature": request.temperature,
        "num_predict": request.max_tokens,
        "stop": list(request.stop),
    }
    if request.json_schema is not None:
        body["format"] = request.json_schema
    body["deadline_ms"] = max(0, int(remaining_seconds * 1000))
    return body


def parse_route_answer(data: Any, request: GenerationRequest, attempts: int) -> tuple[str, GenerationStats]:
    """`{"text": …, "route": {"worker", "model", "task_id"}}` → the text and its stats."""
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        raise LLMResponseError("coordinator: the answer has no text")
    route: dict[str, Any] = data["route"] if isinstance(data.get("route"), dict) else {}
    worker, model = route.get("worker"), route.get("model")
    stats = GenerationStats(
        model=model if isinstance(model, str) and model else request.model,
        backend="coordinator",
        worker=worker if isinstance(worker, str) and worker else None,
        attempts=attempts,
        extra={"task_id": route["task_id"]} if "task_id" in route else {},
    )
    return data["text"], stats


class CoordinatorBackend(LLMBackend):
    """One POST per generation; the whole text arrives at once, as one chunk."""

    name = "coordinator"

    def __init__(self, url: str, worker: str, *, retry: RetryPolicy = DEFAULT_RETRY) -> None:
        self.url = url.rstrip("/")
        self.worker = worker
        self._client = make_client(self.url)
        self._retry = retry

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        deadline = Deadline(request.deadline_seconds)
        retry = RetryState(self.name, self._retry, deadline)
        while True:
            retry.begin()
            try:
                text, stats = await self._route(request, deadline, retry.attempts)
            except LLMError as exc:
                if not await retry.wait(exc):
                    raise
                continue
            if text:
                yield TextChunk(text)
            yield Done(stats)
            return

    async def _route(
        self, request: GenerationRequest, deadline: Deadline, attempts: int
    ) -> tuple[str, GenerationStats]:
        remaining = deadline.remaining()
        body = route_body(request, self.worker, remaining)
        try:
            response = await self._client.post(
                ROUTE_PATH, json=body, timeout=request_timeout(remaining, DEADLINE_GRACE_SECONDS)
            )
        except httpx.HTTPError as exc:
            raise transport_error(self.name, exc) from None
        if not response.is_success:
            raise status_error(self.name, response, await read_error_body(response))
        try:
            data = response.json()
        except ValueError:
            raise LLMResponseError("coordinator: the answer is not JSON") from None
        return parse_route_answer(data, request, attempts)

    async def list_models(self) -> None:
        """The coordinator cannot tell which models its workers hold."""
        return None

    async def aclose(self) -> None:
        await self._client.aclose()
