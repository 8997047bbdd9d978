"""Loopback fakes of the three LLM APIs (Ollama, OpenAI-compatible, the LAN coordinator), scriptable.

Each fake is a real aiohttp server on 127.0.0.1 (a free port) that answers the way the real API does,
byte for byte where it matters (chunked NDJSON, server-sent events, error bodies, Retry-After):

    async with FakeOllama() as server:
        server.script(Answer.text("いらっしゃいませ。", delay_seconds=0.05), busy(retry_after="1"))
        backend = OllamaBackend(server.url)
        ...
        assert server.requests[0].body["keep_alive"] == "30m"
        record = await server.requests[0].wait_ended()
        assert record.closed_early

Every generation request (/api/chat, /v1/chat/completions, /route) is recorded in `server.requests`
(`RecordedRequest`: body, status, pieces sent, whether the client closed early, when it arrived).
Its answer is the next scripted behaviour (`server.script(...)`), or else `server.default`: a text,
a behaviour, or a callable from the request body to either. Texts are streamed in pieces of
`piece_chars` characters, `piece_delay_seconds` apart. Behaviours:

    Answer(pieces, delay_seconds, first_delay_seconds, stall_after, drop_after, stream, ...)   the model answers
    Answer.text("…", piece_chars=4)       the same, cut into pieces
    stall("piece", …)                     send these pieces, then nothing, keeping the connection open
    Error(status, message, retry_after)   an error status with the API's error body
    busy(retry_after="1")                 503 + Retry-After
    model_missing()                       404, the API's "model not found" body
    Hang()                                accept the request and never send even the headers
    Drop()                                close the connection without answering
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Self

from aiohttp import web

DEFAULT_TEXT = "いらっしゃいませ。今日は何にしますか？"
DEFAULT_JSON_TEXT = '{"memories": []}'
DEFAULT_MODELS = ("elyza-jp-8b",)
DEFAULT_PIECE_CHARS = 4
# How long the server waits for a stalled handler when it shuts down.
SHUTDOWN_SECONDS = 0.5


@dataclass(frozen=True)
class Answer:
    """The model answers with these pieces (streamed when the client asked for a stream)."""

    pieces: tuple[str, ...]
    delay_seconds: float = 0.0  # before each piece
    first_delay_seconds: float = 0.0  # before the headers: model load and prompt evaluation
    stall_after: int | None = None  # after this many pieces, send nothing more and keep the line open
    drop_after: int | None = None  # after this many pieces, hang up mid-answer (a crashed server)
    stream: bool | None = None  # None: as the client asked; False: one JSON body even if it asked
    done_reason: str = "stop"
    eval_count: int | None = None  # default: the number of pieces
    prompt_eval_count: int | None = None  # default: the characters of the prompt

    @classmethod
    def text(
        cls, text: str, *, piece_chars: int = DEFAULT_PIECE_CHARS, **options: Any
    ) -> Answer:
        """`text` cut into pieces of `piece_chars` characters."""
        return cls(split_pieces(text, piece_chars), **options)


def stall(*pieces: str, delay_seconds: float = 0.0) -> Answer:
    """Send these pieces, then nothing more, holding the connection open until the client leaves."""
    return Answer(tuple(pieces), delay_seconds=delay_seconds, stall_after=len(pieces))


@dataclass(frozen=True)
class Error:
    """An error status with the API's own error body; `message` None means the API's usual text."""

    status: int = 500
    message: str | None = None
    retry_after: str | None = None  # the Retry-After header, verbatim ("1", or an HTTP date)


def busy(retry_after: str | None = "1") -> Error:
    """503 with Retry-After, what a busy Ollama or coordinator answers."""
    return Error(503, "server busy, please try again later", retry_after)


def model_missing() -> Error:
    """404, the API's "model not found" answer."""
    return Error(404)


@dataclass(frozen=True)
class Hang:
    """Accept the request and never answer, not even the headers."""


@dataclass(frozen=True)
class Drop:
    """Close the connection without answering (a crashed server)."""


Behaviour = Answer | Error | Hang | Drop
Responder = Callable[[dict[str, Any]], "Behaviour | str"]


def split_pieces(text: str, piece_chars: int = DEFAULT_PIECE_CHARS) -> tuple[str, ...]:
    return tuple(text[i : i + piece_chars] for i in range(0, len(text), piece_chars)) or ("",)


@dataclass
class RecordedRequest:
    """One generation request as the server saw it, and what became of its answer."""

    path: str
    body: Any
    received_at: float  # time.monotonic()
    client_port: int | None = None  # the same port on two requests: the client reused its connection
    behaviour: Behaviour | None = None
    status: int | None = None
    pieces_planned: int = 0
    pieces_sent: int = 0
    finished: bool = False  # the whole answer went out
    closed_early: bool = False  # the client closed the connection before the whole answer
    ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def model(self) -> Any:
        return self.body.get("model") if isinstance(self.body, dict) else None

    @property
    def messages(self) -> list[dict[str, Any]]:
        messages = self.body.get("messages") if isinstance(self.body, dict) else None
        return list(messages) if isinstance(messages, list) else []

    async def wait_ended(self, timeout_seconds: float = 5.0) -> RecordedRequest:
        """Wait until the server is done with this request (answered, failed, or the client left)."""
        async with asyncio.timeout(timeout_seconds):
            await self.ended.wait()
        return self


def _now_rfc3339() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _wants_json(body: dict[str, Any]) -> bool:
    return "format" in body or "response_format" in body


def _default_responder(body: dict[str, Any]) -> str:
    return DEFAULT_JSON_TEXT if _wants_json(body) else DEFAULT_TEXT


class _ClientLeft(Exception):
    """The client closed the connection (or the server is closing) while we were answering."""

    def __init__(self, response: web.StreamResponse | None = None) -> None:
        super().__init__()
        # What to hand back to aiohttp: the response already started, if any.
        self.response = response if response is not None else web.Response(status=499)


class FakeLLMServer:
    """What the three fakes share: the aiohttp app, the script, the records, the write loop."""

    generation_path: str = ""
    stream_content_type = "application/x-ndjson"
    stream_by_default = True

    def __init__(
        self,
        *,
        default: Behaviour | str | Responder = _default_responder,
        models: Sequence[str] | None = DEFAULT_MODELS,
        piece_chars: int = DEFAULT_PIECE_CHARS,
        piece_delay_seconds: float = 0.0,
    ) -> None:
        self.default = default
        self.models = tuple(models) if models is not None else None
        self.piece_chars = piece_chars
        self.piece_delay_seconds = piece_delay_seconds
        self.requests: list[RecordedRequest] = []
        self.other_requests: list[tuple[str, str]] = []  # (method, path) of listing calls
        self._script: deque[Behaviour | str] = deque()
        self._closing = asyncio.Event()
        self._arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._port = 0

    # -- life cycle --------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if not self._port:
            raise RuntimeError("the server is not started")
        return f"http://127.0.0.1:{self._port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(self.generation_path, self._handle_generation)
        self._add_routes(app)
        # handler_cancellation: a client that closes its connection cancels our handler at once,
        # which is how we see `closed_early` even while stalled or sleeping between pieces.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_SECONDS, access_log=None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = int(self._runner.addresses[0][1])

    async def close(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- scripting ---------------------------------------------------------------------------------

    def script(self, *behaviours: Behaviour | str) -> None:
        """Answer the next generation requests with these, in order; then `default` again."""
        self._script.extend(behaviours)

    @property
    def bodies(self) -> list[Any]:
        return [record.body for record in self.requests]

    async def wait_for_requests(self, count: int = 1, timeout_seconds: float = 5.0) -> RecordedRequest:
        """Wait until `count` generation requests arrived; return the `count`-th."""
        async with asyncio.timeout(timeout_seconds), self._arrived:
            await self._arrived.wait_for(lambda: len(self.requests) >= count)
        return self.requests[count - 1]

    def _next_behaviour(self, body: dict[str, Any]) -> Behaviour:
        chosen: Behaviour | str | Responder
        chosen = self._script.popleft() if self._script else self.default
        if callable(chosen) and not isinstance(chosen, Answer | Error | Hang | Drop):
            chosen = chosen(body)
        if isinstance(chosen, str):
            return Answer.text(
                chosen, piece_chars=self.piece_chars, delay_seconds=self.piece_delay_seconds
            )
        return chosen

    # -- the API-specific parts --------------------------------------------------------------------

    def _add_routes(self, app: web.Application) -> None:
        """Routes besides the generation endpoint (model lists)."""

    def _error_body(self, error: Error, body: dict[str, Any]) -> dict[str, Any]:
        return {"error": error.message or "internal server error"}

    def _refusal(self, body: dict[str, Any]) -> Error | None:
        """An error the server answers before any scripted behaviour (a missing model, say)."""
        model = body.get("model")
        if self.models is not None and isinstance(model, str) and not self._has_model(model):
            return model_missing()
        return None

    def _has_model(self, model: str) -> bool:
        assert self.models is not None
        return model in self.models or model.removesuffix(":latest") in self.models

    def _piece_bytes(self, piece: str, body: dict[str, Any], record: RecordedRequest, index: int) -> bytes:
        raise NotImplementedError

    def _final_bytes(self, answer: Answer, body: dict[str, Any], record: RecordedRequest) -> bytes:
        raise NotImplementedError

    def _whole_body(self, answer: Answer, body: dict[str, Any], record: RecordedRequest) -> dict[str, Any]:
        raise NotImplementedError

    # -- the generation handler --------------------------------------------------------------------

    async def _handle_generation(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        peer = request.transport.get_extra_info("peername") if request.transport else None
        record = RecordedRequest(
            path=request.path, body=body, received_at=time.monotonic(), client_port=peer[1] if peer else None
        )
        self.requests.append(record)
        async with self._arrived:
            self._arrived.notify_all()
        try:
            if not isinstance(body, dict):
                record.status = 400
                return web.json_response({"error": "invalid JSON body"}, status=400)
            refusal = self._refusal(body)
            behaviour = refusal or self._next_behaviour(body)
            record.behaviour = behaviour
            return await self._answer(request, record, behaviour, body)
        except asyncio.CancelledError:
            # handler_cancellation: the client closed the connection while we waited or slept.
            record.closed_early = not record.finished and not self._closing.is_set()
            raise
        except _ClientLeft as left:
            record.closed_early = not record.finished and not self._closing.is_set()
            return left.response
        finally:
            record.ended.set()

    async def _answer(
        self, request: web.Request, record: RecordedRequest, behaviour: Behaviour, body: dict[str, Any]
    ) -> web.StreamResponse:
        if isinstance(behaviour, Error):
            record.status = behaviour.status
            headers = {"Retry-After": behaviour.retry_after} if behaviour.retry_after else None
            record.finished = True
            return web.json_response(
                self._error_body(behaviour, body), status=behaviour.status, headers=headers
            )
        if isinstance(behaviour, Hang):
            await self._closing.wait()
            raise _ClientLeft
        if isinstance(behaviour, Drop):
            record.finished = True  # the server hung up, not the client
            if request.transport is not None:
                request.transport.close()
            raise _ClientLeft
        return await self._answer_text(request, record, behaviour, body)

    def _wants_stream(self, body: dict[str, Any], answer: Answer) -> bool:
        if answer.stream is not None:
            return answer.stream
        return bool(body.get("stream", self.stream_by_default))

    async def _answer_text(
        self, request: web.Request, record: RecordedRequest, answer: Answer, body: dict[str, Any]
    ) -> web.StreamResponse:
        record.pieces_planned = len(answer.pieces)
        if answer.first_delay_seconds:
            await asyncio.sleep(answer.first_delay_seconds)
        if not self._wants_stream(body, answer):
            for _ in answer.pieces:
                if answer.delay_seconds:
                    await asyncio.sleep(answer.delay_seconds)
            if answer.stall_after is not None:
                await self._closing.wait()
                raise _ClientLeft
            record.pieces_sent = len(answer.pieces)
            record.status = 200
            record.finished = True
            return web.json_response(self._whole_body(answer, body, record), dumps=_dumps)
        response = web.StreamResponse(status=200)
        response.content_type = self.stream_content_type
        response.charset = "utf-8"
        await response.prepare(request)
        record.status = 200
        for index, piece in enumerate(answer.pieces):
            if answer.stall_after is not None and index >= answer.stall_after:
                break
            if answer.drop_after is not None and index >= answer.drop_after:
                record.finished = True  # the server hung up, not the client
                if request.transport is not None:
                    request.transport.close()
                raise _ClientLeft(response)
            if answer.delay_seconds:
                await asyncio.sleep(answer.delay_seconds)
            await self._write(request, response, self._piece_bytes(piece, body, record, index))
            record.pieces_sent += 1
        if answer.stall_after is not None:
            await self._closing.wait()
            raise _ClientLeft(response)
        await self._write(request, response, self._final_bytes(answer, body, record))
        record.finished = True
        return response

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        # A write to a closed connection may still land in the kernel's buffer: check first.
        if request.transport is None or request.transport.is_closing():
            raise _ClientLeft(response)
        try:
            await response.write(data)
        except ConnectionResetError:
            raise _ClientLeft(response) from None


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)


def _prompt_chars(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))


class FakeOllama(FakeLLMServer):
    """Ollama's /api/chat (chunked NDJSON, `done` object with figures in ns) and /api/tags."""

    generation_path = "/api/chat"
    stream_content_type = "application/x-ndjson"
    stream_by_default = True

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_get("/api/tags", self._tags)

    async def _tags(self, request: web.Request) -> web.Response:
        self.other_requests.append((request.method, request.path))
        models = [
            {
                "name": name if ":" in name else f"{name}:latest",
                "model": name if ":" in name else f"{name}:latest",
                "modified_at": "2025-01-01T00:00:00.000000000Z",
                "size": 4_920_753_328,
                "digest": "0" * 64,
                "details": {
                    "parent_model": "",
                    "format": "gguf",
                    "family": "llama",
                    "families": ["llama"],
                    "parameter_size": "8.0B",
                    "quantization_level": "Q4_K_M",
                },
            }
            for name in self.models or ()
        ]
        return web.json_response({"models": models})

    def _error_body(self, error: Error, body: dict[str, Any]) -> dict[str, Any]:
        if error.message is None and error.status == 404:
            return {"error": f'model "{body.get("model")}" not found, try pulling it first'}
        return {"error": error.message or "an error was encountered while running the model"}

    def _chunk(self, body: dict[str, Any], content: str) -> dict[str, Any]:
        return {
            "model": body.get("model"),
            "created_at": _now_rfc3339(),
            "message": {"role": "assistant", "content": content},
            "done": False,
        }

    def _piece_bytes(self, piece: str, body: dict[str, Any], record: RecordedRequest, index: int) -> bytes:
        return (_dumps(self._chunk(body, piece)) + "\n").encode()

    def _final(
        self, answer: Answer, body: dict[str, Any], record: RecordedRequest, content: str
    ) -> dict[str, Any]:
        elapsed_ns = int((time.monotonic() - record.received_at) * 1e9)
        data = self._chunk(body, content)
        data.update(
            done_reason=answer.done_reason,
            done=True,
            total_duration=elapsed_ns + 1_000_000,
            load_duration=1_000_000,
            prompt_eval_count=(
                answer.prompt_eval_count if answer.prompt_eval_count is not None else _prompt_chars(body)
            ),
            prompt_eval_duration=elapsed_ns // 4,
            eval_count=answer.eval_count if answer.eval_count is not None else len(answer.pieces),
            eval_duration=elapsed_ns - elapsed_ns // 4,
        )
        return data

    def _final_bytes(self, answer: Answer, body: dict[str, Any], record: RecordedRequest) -> bytes:
        return (_dumps(self._final(answer, body, record, "")) + "\n").encode()

    def _whole_body(self, answer: Answer, body: dict[str, Any], record: RecordedRequest) -> dict[str, Any]:
        return self._final(answer, body, record, "".join(answer.pieces))


class FakeOpenAI(FakeLLMServer):
    """/v1/chat/completions (server-sent events ending with [DONE]) and /v1/models, llama.cpp-like.

    `refuse_json_schema`: a status (500, like llama.cpp's Python server) with which the server refuses
    `response_format: {"type": "json_schema", …}`; such a refusal does not use up a scripted behaviour.
    `usage` / `timings`: put llama.cpp's figures in the last chunk of a stream.
    """

    generation_path = "/v1/chat/completions"
    stream_content_type = "text/event-stream"
    stream_by_default = False

    def __init__(
        self,
        *,
        refuse_json_schema: int | None = None,
        usage: bool = True,
        timings: bool = True,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.refuse_json_schema = refuse_json_schema
        self.usage = usage
        self.timings = timings
        self._created = int(time.time())

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)

    async def _models(self, request: web.Request) -> web.Response:
        self.other_requests.append((request.method, request.path))
        data = [
            {"id": name, "object": "model", "created": self._created, "owned_by": "llamacpp"}
            for name in self.models or ()
        ]
        return web.json_response({"object": "list", "data": data})

    def _refusal(self, body: dict[str, Any]) -> Error | None:
        response_format = body.get("response_format")
        if (
            self.refuse_json_schema is not None
            and isinstance(response_format, dict)
            and response_format.get("type") == "json_schema"
        ):
            return Error(self.refuse_json_schema, "response_format type json_schema is not supported")
        return super()._refusal(body)

    def _error_body(self, error: Error, body: dict[str, Any]) -> dict[str, Any]:
        if error.message is None and error.status == 404:
            return {
                "error": {
                    "message": f"The model `{body.get('model')}` does not exist.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "model_not_found",
                }
            }
        kind = "server_error" if error.status >= 500 else "invalid_request_error"
        return {"error": {"message": error.message or "internal error", "type": kind, "code": error.status}}

    def _id(self, record: RecordedRequest) -> str:
        return f"chatcmpl-{id(record):x}"

    def _chunk(
        self, body: dict[str, Any], record: RecordedRequest, delta: dict[str, Any], finish: str | None
    ) -> dict[str, Any]:
        return {
            "id": self._id(record),
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": body.get("model"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    def _piece_bytes(self, piece: str, body: dict[str, Any], record: RecordedRequest, index: int) -> bytes:
        delta: dict[str, Any] = {"content": piece}
        if index == 0:
            delta = {"role": "assistant", "content": piece}
        return _event(self._chunk(body, record, delta, None))

    def _figures(self, answer: Answer, body: dict[str, Any], record: RecordedRequest) -> dict[str, Any]:
        prompt = answer.prompt_eval_count if answer.prompt_eval_count is not None else _prompt_chars(body)
        completion = answer.eval_count if answer.eval_count is not None else len(answer.pieces)
        elapsed_ms = (time.monotonic() - record.received_at) * 1000
        figures: dict[str, Any] = {}
        if self.usage:
            figures["usage"] = {
                "completion_tokens": completion,
                "prompt_tokens": prompt,
                "total_tokens": completion + prompt,
            }
        if self.timings:
            figures["timings"] = {
                "prompt_n": prompt,
                "prompt_ms": elapsed_ms / 4,
                "predicted_n": completion,
                "predicted_ms": elapsed_ms - elapsed_ms / 4,
            }
        return figures

    def _final_bytes(self, answer: Answer, body: dict[str, Any], record: RecordedRequest) -> bytes:
        chunk = self._chunk(body, record, {}, answer.done_reason)
        chunk.update(self._figures(answer, body, record))
        return _event(chunk) + b"data: [DONE]\n\n"

    def _whole_body(self, answer: Answer, body: dict[str, Any], record: RecordedRequest) -> dict[str, Any]:
        figures = self._figures(answer, body, record)
        data = {
            "id": self._id(record),
            "object": "chat.completion",
            "created": self._created,
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(answer.pieces)},
                    "finish_reason": answer.done_reason,
                }
            ],
        }
        data.update(figures)
        return data


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {_dumps(data)}\n\n".encode()


class FakeCoordinator(FakeLLMServer):
    """The LAN coordinator's /route: the whole text at once after the pieces' delays, never streamed.

    `lanes` maps a lane to the (worker, model) it routes to; unknown lanes route to "<lane>-worker".
    Pieces of a scripted `Answer` only set how long the "generation" takes; `stall(...)` never answers.
    """

    generation_path = "/route"
    stream_by_default = False

    def __init__(self, *, lanes: dict[str, tuple[str, str]] | None = None, **options: Any) -> None:
        options.setdefault("models", None)
        super().__init__(**options)
        self.lanes = dict(lanes or {})

    def _refusal(self, body: dict[str, Any]) -> Error | None:
        models = body.get("models")
        if self.models is not None and isinstance(models, list):
            if not any(isinstance(m, str) and self._has_model(m) for m in models):
                return Error(404, f"no worker has any of the models {models}")
        return None

    def _wants_stream(self, body: dict[str, Any], answer: Answer) -> bool:
        return False

    def _error_body(self, error: Error, body: dict[str, Any]) -> dict[str, Any]:
        return {"error": error.message or "internal error"}

    def _whole_body(self, answer: Answer, body: dict[str, Any], record: RecordedRequest) -> dict[str, Any]:
        lane = body.get("lane")
        if isinstance(lane, str):
            worker, model = self.lanes.get(lane, (f"{lane}-worker", "lane-model"))
        else:
            worker = str(body.get("worker"))
            models = body.get("models") or ["unknown"]
            model = str(models[0])
        return {
            "text": "".join(answer.pieces),
            "route": {"worker": worker, "model": model, "task_id": uuid.uuid4().hex},
        }
