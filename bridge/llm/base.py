"""The one interface every LLM backend implements: stream text for a list of chat messages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Literal

from bridge.markers import TEMPLATE_STOP_STRINGS as TEMPLATE_STOP_STRINGS

Role = Literal["system", "user", "assistant"]

@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class GenerationRequest:
    """One call to the model: a reply (streamed prose) or an extraction (JSON, temperature 0)."""

    messages: tuple[ChatMessage, ...]
    model: str
    temperature: float
    max_tokens: int
    deadline_seconds: float
    stop: tuple[str, ...] = TEMPLATE_STOP_STRINGS
    json_schema: dict[str, Any] | None = None  # set for extractions: structured output
    lane: str | None = None  # coordinator only: route through this lane instead of the pinned worker
    kind: Literal["reply", "extraction"] = "reply"


@dataclass
class GenerationStats:
    """Figures the server reported for one generation; logged with every reply."""

    model: str
    backend: str
    eval_count: int | None = None
    prompt_eval_count: int | None = None
    total_duration_ms: float | None = None
    done_reason: str | None = None
    worker: str | None = None
    attempts: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TextChunk:
    text: str


@dataclass(frozen=True)
class Done:
    stats: GenerationStats


Chunk = TextChunk | Done


class LLMBackend(ABC):
    """A chat backend. `stream` yields text chunks, then one `Done` when the server finished.

    Closing the iterator early (``aclose()``, or leaving an ``async with aclosing(...)`` block) must
    close the HTTP stream at once, so the server stops generating tokens nobody will read.
    Retries of refused connections, 5xx and 503 happen inside, before the first chunk, bounded by the
    request's deadline; errors are raised as `bridge.errors.LLMError` subclasses.
    """

    name: str

    @abstractmethod
    def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        """Stream one generation."""

    @abstractmethod
    async def list_models(self) -> list[str] | None:
        """Models the server offers (for the start-up check); None when the API cannot tell."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release the HTTP client."""


def model_available(model: str, available: list[str]) -> bool:
    """Whether a server's model list holds `model` (Ollama lists "name:tag"; a bare name is ":latest")."""
    return model in available or any(name.split(":")[0] == model for name in available)
