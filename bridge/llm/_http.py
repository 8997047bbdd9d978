"""HTTP plumbing shared by the backends: retry policy, error classification, the streaming attempt loop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Protocol, TypeVar

import httpx
import structlog

from bridge.backoff import delay_seconds
from bridge.errors import LLMError, LLMModelMissing, LLMResponseError, LLMUnavailable
from bridge.llm.base import Chunk, Done, GenerationRequest, LLMBackend, TextChunk

log = structlog.get_logger(__name__)

E = TypeVar("E", bound=BaseException)

CONNECT_TIMEOUT_SECONDS = 5.0
WRITE_TIMEOUT_SECONDS = 10.0
# Between two pieces of a stream: a server that sends nothing for this long has stalled.
STALL_SECONDS = 30.0
# How long a finished answer may take to send its last bytes before its connection is given up.
DRAIN_SECONDS = 0.5
# How much of an error body we read to quote the server's message.
MAX_ERROR_BODY_BYTES = 4096
# How much of a server's error message we put in an exception (never message content of ours).
MAX_ERROR_MESSAGE_CHARS = 200


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter; tests pass short delays instead of patching time."""

    first_delay_seconds: float = 0.5
    max_delay_seconds: float = 8.0
    # Attempts in all for failures (refused connection, 5xx, stall before the first piece).
    max_attempts: int = 4
    # A busy answer that says when to come back (503 + Retry-After) is the server pacing us, not a
    # failure: those waits are bounded by the deadline, and by this cap so a broken server cannot
    # keep us in a loop.
    max_busy_waits: int = 30
    # Each delay is scaled down by a random share of up to `jitter` (bridge/backoff.py).
    jitter: float = 0.2

    def backoff_seconds(self, failures: int) -> float:
        """Delay after the `failures`-th failure (1-based), jittered and capped."""
        return delay_seconds(
            failures - 1, base=self.first_delay_seconds, cap=self.max_delay_seconds, jitter=self.jitter
        )


DEFAULT_RETRY = RetryPolicy()


KEEPALIVE_SECONDS = 60.0
LIST_MODELS_TIMEOUT_SECONDS = 10.0


def make_client(url: str) -> httpx.AsyncClient:
    """One client per backend. trust_env is off: a system proxy must not capture LAN model traffic."""
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_SECONDS, read=None, write=WRITE_TIMEOUT_SECONDS, pool=None),
        # httpx closes a connection idle for 5 s by default: between players' lines that is the common
        # case, and each new one costs a name lookup in a thread and a handshake on the reply path.
        # A connection the server closed meanwhile is noticed before reuse.
        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_SECONDS),
        trust_env=False,
    )


def request_timeout(remaining_seconds: float, grace_seconds: float = 0.0) -> httpx.Timeout:
    """Timeouts for one request: waiting for the answer's headers is bounded by the deadline.

    The headers of a streamed answer only come with its first token, after the model has loaded,
    so the stall limit cannot apply there; the caller's own deadline is the bound.
    """
    wait = max(remaining_seconds, 0.001) + grace_seconds
    return httpx.Timeout(connect=min(CONNECT_TIMEOUT_SECONDS, wait), read=wait, write=WRITE_TIMEOUT_SECONDS, pool=wait)


class Deadline:
    """The request's deadline, counted from the call to `stream`."""

    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self._end - time.monotonic()


def retry_after_seconds(value: str | None) -> float | None:
    """Parse a Retry-After header: delay seconds (we also accept fractions) or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def server_message(body: bytes) -> str:
    """The `error` text of an error body ({"error": "…"} or {"error": {"message": "…"}}), shortened."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:MAX_ERROR_MESSAGE_CHARS]
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)[:MAX_ERROR_MESSAGE_CHARS]


async def read_error_body(response: httpx.Response) -> bytes:
    """At most MAX_ERROR_BODY_BYTES of an error answer (the stream is closed by the caller)."""
    data = b""
    try:
        async for part in response.aiter_bytes():
            data += part
            if len(data) >= MAX_ERROR_BODY_BYTES:
                break
    except httpx.HTTPError:
        pass
    return data[:MAX_ERROR_BODY_BYTES]


def status_error(backend: str, response: httpx.Response, body: bytes) -> LLMError:
    """Turn an error status into the exception that carries the retry decision."""
    status = response.status_code
    message = f"{backend}: HTTP {status}: {server_message(body)}"
    error: LLMError
    if status == 404:
        error = LLMModelMissing(message)
    elif status in (429, 503):
        retry_after = retry_after_seconds(response.headers.get("retry-after"))
        error = LLMUnavailable(message, retry_after_seconds=retry_after)
    elif status >= 500:
        error = LLMUnavailable(message)
    else:
        error = LLMResponseError(message)
    return labelled(error, status)


def transport_error(backend: str, exc: httpx.HTTPError) -> LLMError:
    """A connection-level failure: the server may come back."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return labelled(LLMUnavailable(f"{backend}: cannot connect: {exc}"), "connect_failed")
    if isinstance(exc, httpx.TimeoutException):
        return labelled(LLMUnavailable(f"{backend}: timed out ({type(exc).__name__})"), "timeout")
    return labelled(LLMUnavailable(f"{backend}: connection failed: {type(exc).__name__}: {exc}"), "connection_lost")


def labelled(error: E, label: int | str) -> E:
    """Attach what the llm_retry log line says about a failure: an HTTP status or its kind."""
    error.__dict__["llm_label"] = label
    return error


def error_label(exc: LLMError) -> int | str:
    label = exc.__dict__.get("llm_label", type(exc).__name__)
    return label if isinstance(label, int | str) else str(label)


class RetryState:
    """Counts one request's attempts and decides, from the exception, whether to try again."""

    def __init__(self, backend: str, policy: RetryPolicy, deadline: Deadline) -> None:
        self.backend = backend
        self.policy = policy
        self.deadline = deadline
        self.attempts = 0
        self._failures = 0
        self._busy_waits = 0

    def begin(self) -> None:
        self.attempts += 1

    def delay_for(self, exc: LLMError) -> float | None:
        """Seconds to wait before the next attempt, or None to give up (and raise `exc`)."""
        if not exc.retryable:
            return None
        retry_after = exc.retry_after_seconds if isinstance(exc, LLMUnavailable) else None
        if retry_after is not None:
            self._busy_waits += 1
            if self._busy_waits > self.policy.max_busy_waits:
                return None
            delay = retry_after
        else:
            self._failures += 1
            if self._failures >= self.policy.max_attempts:
                return None
            delay = self.policy.backoff_seconds(self._failures)
        # Never sleep past the deadline: an attempt that starts after it is wasted.
        if delay >= self.deadline.remaining():
            return None
        return delay

    async def wait(self, exc: LLMError) -> bool:
        """Log and sleep before the next attempt; False when we must give up."""
        delay = self.delay_for(exc)
        if delay is None:
            log.warning("llm_give_up", backend=self.backend, status=error_label(exc), attempts=self.attempts)
            return False
        log.warning(
            "llm_retry",
            backend=self.backend,
            status=error_label(exc),
            delay_s=round(delay, 3),
            attempt=self.attempts,
        )
        await asyncio.sleep(delay)
        return True


class LineReader:
    """Reads the lines of a streamed answer, raising LLMUnavailable when the server stalls.

    Iterates one httpx line iterator by hand (no nested generators), so closing is explicit.
    """

    def __init__(self, backend: str, response: httpx.Response, stall_seconds: float) -> None:
        self._backend = backend
        self._lines: AsyncIterator[str] = response.aiter_lines()
        self._stall_seconds = stall_seconds

    async def next(self) -> str | None:
        """The next line, or None at the end of the stream."""
        try:
            async with asyncio.timeout(self._stall_seconds):
                return await anext(self._lines)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            stalled = LLMUnavailable(f"{self._backend}: stream stalled (nothing for {self._stall_seconds:g} s)")
            raise labelled(stalled, "stalled") from None
        except httpx.HTTPError as exc:
            raise transport_error(self._backend, exc) from None

    async def drain(self, within_seconds: float) -> None:
        """Read what is left of a finished answer, so its connection can go back to the pool.

        A response closed before its end takes its connection with it: the next request would pay
        a new TCP connect (more on a LAN than on loopback). Bounded: a server that keeps sending
        after its last object is simply closed.
        """
        try:
            async with asyncio.timeout(within_seconds):
                async for _ in self._lines:
                    pass
        except (TimeoutError, httpx.HTTPError):
            pass

    async def aclose(self) -> None:
        aclose = getattr(self._lines, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except httpx.HTTPError:
                pass


def parse_json_line(backend: str, line: str) -> dict[str, Any]:
    try:
        data = json.loads(line)
    except ValueError:
        raise LLMResponseError(f"{backend}: a stream line is not JSON ({len(line)} chars)") from None
    if not isinstance(data, dict):
        raise LLMResponseError(f"{backend}: a stream line is not a JSON object")
    return data


class StreamParser(Protocol):
    """Turns the lines of one streamed answer into chunks; pure, so it is tested with plain strings."""

    def feed(self, line: str) -> list[Chunk]:
        """Chunks for one line; a `Done` among them ends the stream."""

    def finish(self) -> list[Chunk]:
        """The stream ended without a final object: the last chunks, ending with `Done`, or raise."""


@asynccontextmanager
async def open_stream(
    client: httpx.AsyncClient, backend: str, url: httpx.URL, body: dict[str, Any], timeouts: httpx.Timeout
) -> AsyncIterator[httpx.Response]:
    """POST and yield the response once it has a success status; everything else as an LLMError.

    Leaving the block closes the response: a stream that was not read to its end closes its
    connection, which is what tells the server to stop generating.
    """
    try:
        async with client.stream("POST", url, json=body, timeout=timeouts) as response:
            if not response.is_success:
                raise status_error(backend, response, await read_error_body(response))
            yield response
    except httpx.HTTPError as exc:
        raise transport_error(backend, exc) from None


class StreamingBackend(LLMBackend):
    """The attempt loop of the streaming backends: open, parse lines, retry before the first text."""

    path: str

    def __init__(
        self,
        url: str,
        *,
        retry: RetryPolicy = DEFAULT_RETRY,
        stall_seconds: float = STALL_SECONDS,
    ) -> None:
        self.url = url.rstrip("/")
        self._client = make_client(self.url)
        # Absolute, parsed once: a relative path is parsed and joined with the base URL on every request.
        self._endpoint = httpx.URL(self.url + self.path)
        self._retry = retry
        self._stall_seconds = stall_seconds

    def _body(self, request: GenerationRequest, fallback: bool) -> dict[str, Any]:
        """The request body; `fallback` once the server refused the first form (see `_refused`)."""
        raise NotImplementedError

    def _parser(self, request: GenerationRequest, attempts: int) -> StreamParser:
        raise NotImplementedError

    def _refused(self, request: GenerationRequest, exc: LLMError, fallback: bool) -> bool:
        """Whether an error answer refuses the request's form: then try the fallback form at once."""
        return False

    def _accepted(self, request: GenerationRequest, fallback: bool) -> None:
        """The server took the request (status 2xx)."""

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        deadline = Deadline(request.deadline_seconds)
        retry = RetryState(self.name, self._retry, deadline)
        fallback = False
        while True:
            retry.begin()
            sent_text = False
            try:
                body = self._body(request, fallback)
                timeout = request_timeout(deadline.remaining())
                async with open_stream(self._client, self.name, self._endpoint, body, timeout) as response:
                    self._accepted(request, fallback)
                    parser = self._parser(request, retry.attempts)
                    reader = LineReader(self.name, response, self._stall_seconds)
                    try:
                        while (line := await reader.next()) is not None:
                            for chunk in parser.feed(line):
                                sent_text = sent_text or isinstance(chunk, TextChunk)
                                if isinstance(chunk, Done):
                                    await reader.drain(DRAIN_SECONDS)
                                    yield chunk
                                    return
                                yield chunk
                        for chunk in parser.finish():
                            yield chunk
                        return
                    finally:
                        await reader.aclose()
            except LLMError as exc:
                # Once text went out, the caller has acted on it: a retry would repeat it.
                if sent_text:
                    raise
                if not fallback and self._refused(request, exc, fallback):
                    fallback = True
                    continue
                if not await retry.wait(exc):
                    raise

    async def _list(self, path: str, pick: Callable[[Any], list[str]]) -> list[str]:
        """GET a model list and `pick` the names from its JSON; every failure as an LLMError."""
        try:
            response = await self._client.get(path, timeout=LIST_MODELS_TIMEOUT_SECONDS)
        except httpx.HTTPError as exc:
            raise transport_error(self.name, exc) from None
        if not response.is_success:
            raise status_error(self.name, response, await read_error_body(response))
        try:
            return pick(response.json())
        except (ValueError, KeyError, TypeError) as exc:
            error: LLMError = LLMResponseError(f"{self.name}: {path} answer not understood ({exc!r})")
            raise error from None

    async def aclose(self) -> None:
        await self._client.aclose()
