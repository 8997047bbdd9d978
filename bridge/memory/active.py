"""Per-NPC state kept only while it is in use (memory grows with the NPCs talked to, not with the cast).

The keeper (timers, extraction state) and the store (memory files in RAM) each keep one table. State
not used for `IDLE_SECONDS` is let go, unless its owner says it is busy (a write not yet on disk, a
timer or an extraction running, a lock held); the next use builds it again (the store reads the
file again). Ten minutes: well past the silence timer (default 2 min) and an extraction, so an NPC
in a conversation never loses its state, while a street of shops visited once an evening does not
stay in RAM all night. Idle state is looked for at most every `IDLE_SECONDS / 4`, on use: the sweep
costs one pass over the table, a few times per idle period.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

IDLE_SECONDS = 600.0

S = TypeVar("S")


class ActiveTable(Generic[S]):
    """A dict of per-NPC state that forgets entries idle for `idle_seconds` unless `busy(state)`."""

    def __init__(
        self,
        busy: Callable[[S], bool],
        *,
        idle_seconds: float = IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._busy = busy
        self._idle = idle_seconds
        self._clock = clock
        self._entries: dict[str, tuple[S, float]] = {}
        self._swept = clock()

    def find(self, npc_id: str) -> S | None:
        """The NPC's state, marked as used now; None when there is none (never built, or let go)."""
        entry = self._entries.get(npc_id)
        if entry is None:
            return None
        now = self._clock()
        self._entries[npc_id] = (entry[0], now)
        self._sweep_if_due(now)
        return entry[0]

    def add(self, npc_id: str, state: S) -> S:
        now = self._clock()
        self._entries[npc_id] = (state, now)
        self._sweep_if_due(now)
        return state

    def peek(self, npc_id: str) -> S | None:
        """The state without marking it used (for looking, not for work)."""
        entry = self._entries.get(npc_id)
        return None if entry is None else entry[0]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def values(self) -> list[S]:
        return [state for state, _ in self._entries.values()]

    def _sweep_if_due(self, now: float) -> None:
        if now - self._swept < self._idle / 4:
            return
        self._swept = now
        idle = [
            npc_id
            for npc_id, (state, used) in self._entries.items()
            if now - used >= self._idle and not self._busy(state)
        ]
        for npc_id in idle:
            del self._entries[npc_id]
