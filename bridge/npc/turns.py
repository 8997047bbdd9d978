"""One player's line → one checked reply, noted: the reply path `run` (the dispatcher) and `chat` share.

`ReplyPath.answer` gathers what the reply depends on (memories recalled within the deadline, the
recent history with this player, what the world had the NPC say, the last line said to this
player), waits for the LLM slot until the deadline, and has the responder generate, clean and
check the line (sentence by sentence when the caller gives a part sink). `ReplyPath.note` puts
the exchange in the recent history at once and hands back the memory write (the pending
conversation, and a character's inline memories) for the caller to run in its own order.

Around it the callers differ only in what is not the reply: the dispatcher queues lines, shows
typing and speaks to the world; `chat` reads the terminal and prints.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import structlog

from bridge.llm.gate import LLMGate, Priority
from bridge.memory.keeper import RECALL_TIMEOUT_SECONDS
from bridge.memory.recall import Recalled
from bridge.npc.characters import Character
from bridge.npc.conversation import Conversations
from bridge.npc.deadline import Deadline
from bridge.npc.parts import PartSink
from bridge.npc.prompt import Exchange
from bridge.npc.responder import Reply, ReplyContext, Responder

log = structlog.get_logger(__name__)

class Memory(Protocol):
    """What the reply path needs of the memory keeper."""

    def touch(self, npc_id: str) -> None: ...

    async def recall(self, npc_id: str, *, query: str, previous: str | None = None) -> Sequence[Recalled]: ...

    async def note_exchange(self, npc_id: str, *, player: str, npc: str, at: datetime) -> None: ...

    async def note_event(self, npc_id: str, *, text: str, at: datetime) -> None: ...

    async def save_inline(self, npc_id: str, lines: list[str], *, at: datetime) -> object: ...


@dataclass(frozen=True)
class Turn:
    """One player's line to one NPC."""

    character: Character
    player_id: str
    player_name: str
    line: str  # sanitised (prompt.sanitize_player_text)
    deadline: Deadline  # from the line's arrival


def _always() -> bool:
    return True


def _no_parts() -> PartSink | None:
    return None


def _ignore(recalled: Sequence[Recalled]) -> None:
    pass


class ReplyPath:
    def __init__(self, *, responder: Responder, gate: LLMGate, memory: Memory, conversations: Conversations) -> None:
        self.responder = responder
        self.memory = memory
        self.conversations = conversations
        self._gate = gate

    async def answer(
        self,
        turn: Turn,
        *,
        parts: Callable[[], PartSink | None] = _no_parts,
        sending: Callable[[], bool] = _always,
        on_recall: Callable[[Sequence[Recalled]], None] = _ignore,
    ) -> Reply | None:
        """The checked reply to `turn`; None when `sending` says, as the request is about to go out, not to.

        `parts` is asked then too: where to hand each final sentence (None: the line whole). A turn
        whose deadline passed before its request went out gets a fallback and no LLM call.
        `on_recall` is told which memories the prompt holds (the reply's log line, `chat --explain`).
        """
        context = await self._context(turn)
        on_recall(context.memories)
        slot = await self._slot(turn.deadline)
        try:
            if not sending():
                return None
            if not slot or turn.deadline.passed:
                log.warning("reply_deadline_passed", where="llm slot", deadline_at=round(turn.deadline.at, 3))
                return self.responder.fallback(turn.character, error="deadline")
            return await self.responder.respond(context, deadline=turn.deadline, on_part=parts())
        finally:
            if slot:
                self._gate.release()

    def note(self, turn: Turn, reply: Reply) -> Callable[[], Awaitable[None]]:
        """Put the exchange in the recent history now; the memory write to run (in the NPC's order)."""
        npc_id = turn.character.id
        self.conversations.record(npc_id, turn.player_id, Exchange(player=turn.line, npc=reply.text))
        at = datetime.fromtimestamp(time.time(), UTC)

        async def write() -> None:
            await self.memory.note_exchange(npc_id, player=turn.line, npc=reply.text, at=at)
            if reply.memory_lines:
                await self.memory.save_inline(npc_id, reply.memory_lines, at=at)

        return write

    async def _context(self, turn: Turn) -> ReplyContext:
        npc_id, player_id = turn.character.id, turn.player_id
        history = self.conversations.history(npc_id, player_id)
        # The query is the line, plus this player's previous line while the history still holds it.
        previous = history[-1].player if history else None
        memories: Sequence[Recalled] = ()
        try:
            async with asyncio.timeout(min(RECALL_TIMEOUT_SECONDS, turn.deadline.remaining())):
                memories = await self.memory.recall(npc_id, query=turn.line, previous=previous)
        except Exception as exc:  # noqa: BLE001 - a reply goes on without memories
            log.warning("recall_failed", error_type=type(exc).__name__)
        return ReplyContext(
            character=turn.character,
            player_line=turn.line,
            player_name=turn.player_name,
            world_lines=self.conversations.world_lines(npc_id, player_id),
            memories=memories,
            history=history,
            last_said=self.conversations.last_said(npc_id, player_id),
        )

    async def _slot(self, deadline: Deadline) -> bool:
        """Wait for the LLM slot until the deadline; whether it was taken (then release it)."""
        try:
            async with deadline.scope():
                await self._gate.acquire(Priority.REPLY)
        except TimeoutError:
            return False
        return True
