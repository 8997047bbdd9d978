"""Recent exchanges per NPC and player session, and the lines the world just had each NPC say."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bridge.npc.prompt import MAX_HISTORY_LINES, Exchange

MAX_HISTORY_EXCHANGES = MAX_HISTORY_LINES // 2  # only what the prompt can use is kept
MAX_WORLD_LINES = 3
WORLD_LINE_SECONDS = 600.0  # an npc:event older than this is no longer "what the world just said"


@dataclass
class _Session:
    exchanges: deque[tuple[float, Exchange]] = field(default_factory=lambda: deque(maxlen=MAX_HISTORY_EXCHANGES))
    last_said: str | None = None


class Conversations:
    """In-memory context for prompts; memory files keep what must outlive a restart."""

    def __init__(self, *, history_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._history_seconds = history_seconds
        self._clock = clock
        self._sessions: dict[tuple[str, str], _Session] = {}
        self._world: dict[str, deque[tuple[float, str | None, str]]] = {}

    def history(self, npc_id: str, player_id: str) -> list[Exchange]:
        session = self._sessions.get((npc_id, player_id))
        if session is None:
            return []
        horizon = self._clock() - self._history_seconds
        while session.exchanges and session.exchanges[0][0] < horizon:
            session.exchanges.popleft()
        return [exchange for _, exchange in session.exchanges]

    def last_said(self, npc_id: str, player_id: str) -> str | None:
        session = self._sessions.get((npc_id, player_id))
        return session.last_said if session else None

    def record(self, npc_id: str, player_id: str, exchange: Exchange) -> None:
        session = self._sessions.setdefault((npc_id, player_id), _Session())
        session.exchanges.append((self._clock(), exchange))
        session.last_said = exchange.npc

    def note_world_line(self, npc_id: str, player_id: str | None, text: str) -> None:
        self._world.setdefault(npc_id, deque(maxlen=MAX_WORLD_LINES * 4)).append((self._clock(), player_id, text))

    def world_lines(self, npc_id: str, player_id: str) -> list[str]:
        """What the world's routines just had this NPC say to this player (or to everyone)."""
        horizon = self._clock() - WORLD_LINE_SECONDS
        lines = [
            text for at, target, text in self._world.get(npc_id, ()) if at >= horizon and target in (None, player_id)
        ]
        return lines[-MAX_WORLD_LINES:]

    def end_player(self, player_id: str) -> None:
        """`player:left`: their recent history ends (the memory file keeps what matters)."""
        for key in [key for key in self._sessions if key[1] == player_id]:
            del self._sessions[key]
        for lines in self._world.values():
            for entry in [entry for entry in lines if entry[1] == player_id]:
                lines.remove(entry)
