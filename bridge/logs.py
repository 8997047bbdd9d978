"""structlog set-up: one JSON object a line on stdout for journald, or a console renderer on a terminal."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

# Keys that carry what players or NPCs said. They are dropped from every log line unless the
# configuration asks for content (NPC_BRIDGE_LOG_CONTENT=true): a home server's journal is not the
# place for a person's conversations by default.
CONTENT_KEYS = frozenset(
    {"text", "player_text", "npc_text", "reply_text", "raw", "raw_text", "candidate", "memory_text", "prompt"}
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


class _LineLogger(structlog.WriteLogger):
    """Writes each rendered line straight to the stream, with its module's name for `logger`.

    The daemon's own lines skip the standard library's logging (a LogRecord, a handler lock and a
    second pass of processors per line): that took about half the cost of every line, and several
    lines are written on the way from a player's talk to the LLM request.
    """

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
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
    _content.enabled = log_content
    for secret in secrets:
        add_secret(secret)
    out = stream or sys.stdout
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
