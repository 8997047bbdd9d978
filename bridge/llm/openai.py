"""The `openai` backend: any OpenAI-compatible /v1/chat/completions, streamed as server-sent events."""

from __future__ import annotations

import json
from typing import Any, Literal

import structlog

from bridge.errors import LLMError, LLMResponseError, LLMUnavailable
from bridge.llm._http import (
    StreamingBackend,
    error_label,
    labelled,
    parse_json_line,
)
from bridge.llm.base import Chunk, Done, GenerationRequest, GenerationStats, TextChunk

log = structlog.get_logger(__name__)

ResponseFormat = Literal["json_schema", "json_object"]
SCHEMA_NAME = "memories"
# Statuses with which servers refuse a response_format they do not know: llama.cpp's Python server
# answers 500, others 400 or 422.
REFUSAL_STATUSES = frozenset({400, 422, 500})
DATA_PREFIX = "data:"
DONE_MARKER = "[DONE]"


def response_format(form: ResponseFormat, schema: dict[str, Any]) -> dict[str, Any]:
    """The two forms of structured output: OpenAI's json_schema, and llama.cpp's json_object+schema."""
    if form == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": schema}}
    return {"type": "json_object", "schema": schema}


def completion_body(request: GenerationRequest, form: ResponseFormat = "json_schema") -> dict[str, Any]:
    """The /v1/chat/completions body; `form` only matters for extractions."""
    body: dict[str, Any] = {
        "model": request.model,
        "messages": [message.as_dict() for message in request.messages],
        "stream": True,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
    }
    # OpenAI's own API takes at most 4 stop strings; llama.cpp, vLLM and Ollama take them all.
    if request.stop:
        body["stop"] = list(request.stop)
    if request.json_schema is not None:
        body["response_format"] = response_format(form, request.json_schema)
    return body


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class OpenAIParser:
    """SSE lines → chunks. Also takes a whole chat.completion body from a server that did not stream."""

    def __init__(self, request: GenerationRequest, attempts: int) -> None:
        self._request = request
        self._attempts = attempts
        self._model: str | None = None
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] = {}
        self._timings: dict[str, Any] = {}
        self._saw_event = False
        self._plain: list[str] = []  # lines of a body that is not an event stream

    def feed(self, line: str) -> list[Chunk]:
        if not line.startswith(DATA_PREFIX):
            # Blank lines end an event; ":" lines are comments; "event:"/"id:" carry nothing we use.
            if not self._saw_event and line.strip() and not line.startswith((":", "event:", "id:")):
                self._plain.append(line)
            return []
        self._saw_event = True
        payload = line[len(DATA_PREFIX) :].strip()
        if payload == DONE_MARKER:
            return [self._done()]
        if not payload:
            return []
        data = parse_json_line("openai", payload)
        if "error" in data:
            error = LLMUnavailable(f"openai: error in stream: {str(data['error'])[:200]}")
            raise labelled(error, "stream_error")
        self._note_figures(data)
        text = ""
        choices = data.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            choice = choices[0]
            delta = choice.get("delta")
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(content, str):
                text = content
            if isinstance(choice.get("finish_reason"), str):
                self._finish_reason = choice["finish_reason"]
        return [TextChunk(text)] if text else []

    def finish(self) -> list[Chunk]:
        if self._saw_event:
            if self._finish_reason is None:
                raise LLMResponseError("openai: the event stream ended before a finish_reason or [DONE]")
            return [self._done()]
        return self._whole_body()

    def _whole_body(self) -> list[Chunk]:
        try:
            data = json.loads("\n".join(self._plain))
            message = data["choices"][0]["message"]
            text = message.get("content") or ""
            if not isinstance(text, str):
                raise TypeError("content is not text")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise LLMResponseError("openai: the answer is neither an event stream nor a completion") from None
        self._note_figures(data)
        reason = data["choices"][0].get("finish_reason")
        self._finish_reason = reason if isinstance(reason, str) else None
        chunks: list[Chunk] = [TextChunk(text)] if text else []
        chunks.append(self._done())
        return chunks

    def _note_figures(self, data: dict[str, Any]) -> None:
        if isinstance(data.get("model"), str):
            self._model = data["model"]
        # llama.cpp sends "timings" (and "usage") with its last chunk; OpenAI sends "usage" when asked.
        if isinstance(data.get("usage"), dict):
            self._usage = data["usage"]
        if isinstance(data.get("timings"), dict):
            self._timings = data["timings"]

    def _done(self) -> Done:
        usage, timings = self._usage, self._timings
        completion = _int(usage.get("completion_tokens"))
        prompt = _int(usage.get("prompt_tokens"))
        if completion is None:
            completion = _int(timings.get("predicted_n"))
        if prompt is None:
            prompt = _int(timings.get("prompt_n"))
        prompt_ms, predicted_ms = timings.get("prompt_ms"), timings.get("predicted_ms")
        total_ms = (
            float(prompt_ms) + float(predicted_ms)
            if isinstance(prompt_ms, int | float) and isinstance(predicted_ms, int | float)
            else None
        )
        extra: dict[str, Any] = {}
        if timings:
            extra["timings"] = dict(timings)
        return Done(
            GenerationStats(
                model=self._model or self._request.model,
                backend="openai",
                eval_count=completion,
                prompt_eval_count=prompt,
                total_duration_ms=total_ms,
                done_reason=self._finish_reason,
                attempts=self._attempts,
                extra=extra,
            )
        )


class OpenAIBackend(StreamingBackend):
    """Streams /v1/chat/completions and remembers which structured-output form the server takes."""

    name = "openai"
    path = "/v1/chat/completions"

    # None until a server accepted one form; then every extraction uses that form first.
    response_format_form: ResponseFormat | None = None

    def _form(self, fallback: bool) -> ResponseFormat:
        if fallback:
            return "json_object"
        return self.response_format_form or "json_schema"

    def _body(self, request: GenerationRequest, fallback: bool) -> dict[str, Any]:
        return completion_body(request, self._form(fallback))

    def _parser(self, request: GenerationRequest, attempts: int) -> OpenAIParser:
        return OpenAIParser(request, attempts)

    def _refused(self, request: GenerationRequest, exc: LLMError, fallback: bool) -> bool:
        # Only while we do not know the server's form yet: a known form failing is a plain error.
        if request.json_schema is None or self.response_format_form is not None:
            return False
        if error_label(exc) not in REFUSAL_STATUSES:
            return False
        log.info("llm_response_format_fallback", backend=self.name, status=error_label(exc))
        return True

    def _accepted(self, request: GenerationRequest, fallback: bool) -> None:
        if request.json_schema is not None and self.response_format_form is None:
            self.response_format_form = self._form(fallback)
            log.info("llm_response_format_chosen", backend=self.name, form=self.response_format_form)

    async def list_models(self) -> list[str]:
        """Model ids from /v1/models."""
        return await self._list("/v1/models", lambda data: [str(entry["id"]) for entry in data["data"]])
