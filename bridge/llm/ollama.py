"""The `ollama` backend: Ollama's native /api/chat, streamed as newline-delimited JSON."""

from __future__ import annotations

from typing import Any

from bridge.errors import LLMResponseError, LLMUnavailable
from bridge.llm._http import (
    StreamingBackend,
    labelled,
    parse_json_line,
)
from bridge.llm.base import Chunk, Done, GenerationRequest, GenerationStats, TextChunk

# Keep the model loaded between replies: loading an 8B model costs the player seconds.
KEEP_ALIVE = "30m"
NANOSECONDS_PER_MILLISECOND = 1_000_000


def chat_body(request: GenerationRequest) -> dict[str, Any]:
    """The /api/chat body for one request (llm-backends.md)."""
    body: dict[str, Any] = {
        "model": request.model,
        "messages": [message.as_dict() for message in request.messages],
        "stream": True,
        "keep_alive": KEEP_ALIVE,
        "options": {
            "temperature": request.temperature,
            "num_predict": request.max_tokens,
            "stop": list(request.stop),
        },
    }
    if request.json_schema is not None:
        body["format"] = request.json_schema
    return body


def _ms(value: Any) -> float | None:
    return value / NANOSECONDS_PER_MILLISECOND if isinstance(value, int | float) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def final_stats(data: dict[str, Any], request: GenerationRequest, attempts: int) -> GenerationStats:
    """Figures of the last (done) object: token counts, and durations from ns to ms."""
    extra = {
        key + "_ms": ms
        for key in ("load_duration", "prompt_eval_duration", "eval_duration")
        if (ms := _ms(data.get(key))) is not None
    }
    reason = data.get("done_reason")
    return GenerationStats(
        model=str(data.get("model") or request.model),
        backend="ollama",
        eval_count=_int(data.get("eval_count")),
        prompt_eval_count=_int(data.get("prompt_eval_count")),
        total_duration_ms=_ms(data.get("total_duration")),
        done_reason=reason if isinstance(reason, str) else None,
        attempts=attempts,
        extra=extra,
    )


class OllamaParser:
    """NDJSON lines → chunks. An `{"error": …}` line mid-stream is the server giving up."""

    def __init__(self, request: GenerationRequest, attempts: int) -> None:
        self._request = request
        self._attempts = attempts

    def feed(self, line: str) -> list[Chunk]:
        if not line.strip():
            return []
        data = parse_json_line("ollama", line)
        if "error" in data:
            error = LLMUnavailable(f"ollama: error in stream: {str(data['error'])[:200]}")
            raise labelled(error, "stream_error")
        chunks: list[Chunk] = []
        message = data.get("message")
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str) and content:
            chunks.append(TextChunk(content))
        if data.get("done") is True:
            chunks.append(Done(final_stats(data, self._request, self._attempts)))
        return chunks

    def finish(self) -> list[Chunk]:
        raise LLMResponseError("ollama: the stream ended without its final (done) object")


class OllamaBackend(StreamingBackend):
    """Streams /api/chat; `list_models` reads /api/tags."""

    name = "ollama"
    path = "/api/chat"

    def _body(self, request: GenerationRequest, fallback: bool) -> dict[str, Any]:
        return chat_body(request)

    def _parser(self, request: GenerationRequest, attempts: int) -> OllamaParser:
        return OllamaParser(request, attempts)

    async def list_models(self) -> list[str]:
        """Names as Ollama lists them, with their tag ("elyza-jp-8b:latest")."""
        return await self._list("/api/tags", lambda data: [str(entry["name"]) for entry in data["models"]])
