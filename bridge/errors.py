"""The exception tree of npc-bridge.

    BridgeError
    ├── ConfigError              bad configuration or character file: exit code 2, never retried
    ├── ComponentFailed          a component crashed again and again: exit code 1, systemd restarts us
    ├── WorldError               the world link
    │   ├── WorldAuthError       the world refused our token (a configuration error; retried slowly)
    │   ├── WorldProtocolError   a frame or message we cannot understand
    │   └── WorldUnavailable     the world cannot be reached right now (retried with backoff)
    ├── LLMError                 the language model backend
    │   ├── LLMUnavailable       refused connection, 5xx, 503 busy: may succeed later
    │   ├── LLMModelMissing      404: the model is not installed on the server
    │   └── LLMResponseError     the server answered something we cannot parse
    └── MemoryStoreError         a memory file or the shared memory service
        └── SharedMemoryUnavailable

Each error says whether trying again can help (`retryable`), so callers decide from the exception
instead of from its type name scattered through the code.
"""

from __future__ import annotations


class BridgeError(Exception):
    """Base of every error npc-bridge raises on purpose."""

    retryable: bool = False


class ConfigError(BridgeError):
    """Configuration or a character file is invalid; the daemon must not start.

    One error can carry several problems (every error of every character file): `lines` has one plain
    line for each, and the command line prints each on its own line.
    """

    def __init__(self, message: str, *more: str) -> None:
        super().__init__(message)
        self.lines: tuple[str, ...] = (message, *more)

    def __str__(self) -> str:
        return "\n".join(self.lines)


class ComponentFailed(BridgeError):
    """A supervised component crashed too often in too short a time: the process must end (exit 1)."""


class WorldError(BridgeError):
    """Something went wrong with the world link."""

    retryable = True


class WorldAuthError(WorldError):
    """The world refused the worker token."""


class WorldProtocolError(WorldError):
    """A frame or a message broke the protocol."""


class WorldUnavailable(WorldError):
    """The world server cannot be reached right now."""


class LLMError(BridgeError):
    """The language model backend failed."""


class LLMUnavailable(LLMError):
    """Refused connection, 5xx or busy: trying again later may help."""

    retryable = True

    def __init__(self, message: str, *, retry_after_seconds: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class LLMModelMissing(LLMError):
    """The server does not have the requested model (HTTP 404)."""


class LLMResponseError(LLMError):
    """The server answered, but not in a form we understand."""


class MemoryStoreError(BridgeError):
    """A memory file or the shared memory service failed."""


class SharedMemoryUnavailable(MemoryStoreError):
    """The shared long-term memory service cannot be reached."""

    retryable = True
