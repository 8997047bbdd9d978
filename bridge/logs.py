"""structlog set-up: one JSON object a line on stdout for journald, or a console renderer on a terminal."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

# Keys that carry what players or NPCs said. They are dropped from every log line unless the
# configuration asks for content (NPC_BRIDGE_LOG_CONTENT=true): a home server's journal is not the
# place for a person's conversations by default.
# This filter is the one gate: code logs content under these keys and never checks the setting itself.
CONTENT_KEYS = frozenset(
    {
        "text",
        "player_text",
        "npc_text",
        "reply_text",
        "raw",
        "raw_text",
        "candidate",
        "memory_text",
        "prompt",
        "recalled",
        "replaced",
    }
)
REDACTED = "[redacted]"


class _Redactor:
    """Replaces each secret (the world token) wherever it appears in a log line, keys and values."""

    def __init__(self) -> None:
        self.secrets: tuple[str, ...] = ()

    def _scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            for secret in self.secrets:
                value = value.replace(secret, REDACTED)
            return value
        if isinstance(value, dict):
            return {self._scrub(k): self._scrub(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._scrub(v) for v in value)
        if isinstance(value, BaseException):
            return self._scrub(repr(value))
        return value

    def __call__(self, logger: WrappedLogger, name: str, event_dict: EventDict) -> EventDict:
        if not self.secrets:
            return event_dict
        return {self._scrub(k): self._scrub(v) for k, v in event_dict.items()}


class _ContentFilter:
    def __init__(self) -> None:
        self.enabled = False

    def __call__(self, logger: WrappedLogger, name: str, event_dict: EventDict) -> EventDict:
        if not self.enabled:
            for key in CONTENT_KEYS.intersection(event_dict):
                del event_dict[key]
        return event_dict


_redactor = _Redactor()
_content = _ContentFilter()
# The daemon's stdout as configure() wrapped it (None until configured, or when a test passes a stream).
output: SafeStream | None = None


def add_secret(secret: str | None) -> None:
    """Never let this string reach a log line (called with the world token as soon as it is read)."""
    if secret and secret not in _redactor.secrets:
        # Longest first, so a secret that contains another is replaced whole.
        _redactor.secrets = tuple(sorted((*_redactor.secrets, secret), key=len, reverse=True))


def _shared_processors() -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _content,
    ]


class SafeStream:
    """The log stream (stdout) that never raises: logging must not take the daemon down.

    When stdout is closed or its reader has gone (a broken pipe, `npc-bridge run | head -1`), each
    line is dropped and counted; the count goes to stderr as soon as stderr takes it (at the first
    drop, then at most once a minute, and at exit). The broken descriptor is pointed at /dev/null so
    the interpreter's own flush at exit does not fail either.
    """

    REPORT_EVERY_SECONDS = 60.0

    def __init__(self, stream: TextIO | None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._clock = clock
        self.dropped = 0
        self._reported = 0
        self._last_report: float | None = None
        self.error: str | None = None if stream is not None else "stdout is closed"

    def isatty(self) -> bool:
        try:
            return self._stream is not None and self.error is None and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def write(self, text: str) -> int:
        if self.error is None and self._stream is not None:
            try:
                return self._stream.write(text)
            except (OSError, ValueError) as exc:
                self._broken(exc)
        self.dropped += max(1, text.count("\n"))
        self._report()
        return len(text)

    def flush(self) -> None:
        if self.error is None and self._stream is not None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as exc:
                self._broken(exc)

    def _broken(self, exc: BaseException) -> None:
        self.error = f"stdout failed ({type(exc).__name__}: {getattr(exc, 'strerror', None) or exc})"
        stream, self._stream = self._stream, None
        with contextlib.suppress(Exception):
            # Whatever is still buffered cannot be written either; /dev/null takes it at exit.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno() if stream is not None else 1)
            os.close(devnull)

    def _report(self, *, final: bool = False) -> None:
        if self.dropped == self._reported:
            return
        now = self._clock()
        if not final and self._last_report is not None and now - self._last_report < self.REPORT_EVERY_SECONDS:
            return
        self._last_report = now
        line = f"npc-bridge: {self.error}: {self.dropped} log lines dropped so far\n"
        try:
            sys.__stderr__.write(line)  # type: ignore[union-attr]
            sys.__stderr__.flush()  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - stderr is gone too: try again later
            return
        self._reported = self.dropped

    def close(self) -> None:
        """At exit: write the final count of dropped lines (if any)."""
        self._report(final=True)


class _LineLogger(structlog.WriteLogger):
    """Writes each rendered line straight to the stream, with its module's name for `logger`.

    The daemon's own lines skip the standard library's logging (a LogRecord, a handler lock and a
    second pass of processors per line): that took about half the cost of every line, and several
    lines are written on the way from a player's talk to the LLM request.
    """

    def __init__(self, file: TextIO | SafeStream, name: str) -> None:
        super().__init__(file)  # type: ignore[arg-type]  # SafeStream has what WriteLogger uses
        self.name = name


def configure(
    *,
    fmt: str = "json",
    level: str = "info",
    log_content: bool = False,
    stream: TextIO | None = None,
    secrets: Iterable[str | None] = (),
) -> None:
    """Configure structlog; the standard library's loggers (websockets, httpx) get the same format."""
    global output
    _content.enabled = log_content
    for secret in secrets:
        add_secret(secret)
    out: TextIO | SafeStream
    if stream is not None:
        out = stream
    else:
        output = output if output is not None else SafeStream(sys.stdout)
        out = output
    renderer: Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    else:
        renderer = structlog.processors.JSONRenderer(ensure_ascii=False)
    final: list[Processor] = [
        structlog.processors.format_exc_info,
        structlog.processors.UnicodeDecoder(),
        _redactor,
        renderer,
    ]
    numeric = logging.getLevelName(level.upper())

    def line_logger(*args: Any) -> _LineLogger:
        return _LineLogger(out, str(args[0]) if args else "")

    structlog.configure(
        processors=[*_shared_processors(), *final],
        logger_factory=line_logger,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # Not cached: a cached logger would keep its processors, and tests swap them (capture_logs).
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=_shared_processors(),
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    # Library chatter: httpx logs every request at INFO, websockets every frame at DEBUG.
    for noisy in ("httpx", "httpcore", "websockets", "asyncio", "aiohttp"):
        logging.getLogger(noisy).setLevel(max(numeric, logging.WARNING))


def bind(**context: Any) -> None:
    """Bind npc / player / event_id for the current task (contextvars: tasks inherit a copy)."""
    structlog.contextvars.bind_contextvars(**context)


class Throttle:
    """At most `burst` log lines per key in each `window_seconds`; the rest are only counted.

    For lines a peer can cause at will (a world flooding bad frames must not flood the journal).
    `admit` returns None for a line to drop, else how many lines of that key were dropped since the
    last one let through (0 when none), to be logged with it.
    """

    def __init__(
        self, *, burst: int = 10, window_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._burst = burst
        self._window_seconds = window_seconds
        self._clock = clock
        self._windows: dict[Hashable, tuple[float, int, int]] = {}  # key -> (start, let through, dropped)

    def admit(self, key: Hashable) -> int | None:
        now = self._clock()
        start, passed, dropped = self._windows.get(key, (now, 0, 0))
        if now - start >= self._window_seconds:
            start, passed = now, 0
        if passed >= self._burst:
            self._windows[key] = (start, passed, dropped + 1)
            return None
        self._windows[key] = (start, passed + 1, 0)
        return dropped
