"""Replies kept while the world is out of reach: says and say-parts in one ordered, bounded buffer.

Rules (world-protocol.md, "Speaking" and "Speaking sentence by sentence"):
- Says and parts wait in one queue, in the order they were given, so a part never overtakes its say.
- A part for a reply whose `npc:say` was already given (sent or kept) is refused: it would arrive
  after its final line.
- The bound counts replies, not messages: when full, the oldest reply goes whole (its say and parts).
- Freshness is judged per reply: a reply is as old as its oldest kept message; past the age limit
  the reply's kept messages are dropped together, so the world never gets a say without the parts
  that were kept before it, nor parts without the say kept after them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from bridge.world.messages import Say, SayPart

__all__ = ["Kept", "Outbox"]

log = structlog.get_logger(__name__)

# How many replies' says the outbox remembers, to refuse parts that come after their say.
SAID_MEMORY = 4096


@dataclass(slots=True)
class Kept:
    message: Say | SayPart
    since: float


class Outbox:
    """Says and parts kept while disconnected (bounded, oldest first), and the said-replies memory."""

    def __init__(self, *, clock: Callable[[], float], max_age_seconds: float, max_replies: int) -> None:
        self._clock = clock
        self._max_age_seconds = max_age_seconds
        self._max_replies = max_replies
        self._kept: deque[Kept] = deque()
        self._replies: dict[str, int] = {}  # reply_to -> messages kept for it (insertion order = age)
        self._said: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def said(self, reply_to: str) -> bool:
        """Whether the final `npc:say` of this reply was already given (sent or kept)."""
        return reply_to in self._said

    def mark_said(self, reply_to: str) -> None:
        self._said[reply_to] = None
        self._said.move_to_end(reply_to)
        while len(self._said) > SAID_MEMORY:
            self._said.popitem(last=False)

    def keep(self, message: Say | SayPart) -> None:
        """Keep a message for the next connection; the oldest reply goes if that makes too many."""
        reply_to = message.reply_to
        if reply_to not in self._replies and len(self._replies) >= self._max_replies:
            self._drop_reply(next(iter(self._replies)), reason="buffer_full")
        self._kept.append(Kept(message=message, since=self._clock()))
        self._replies[reply_to] = self._replies.get(reply_to, 0) + 1
        if isinstance(message, Say):
            log.info("world_say_kept", npc=message.npc_id, reply_to=reply_to, kept=len(self._replies))

    def next_fresh(self) -> Kept | None:
        """The oldest kept message still fresh enough to send (stale replies are dropped first)."""
        while self._kept:
            head = self._kept[0]
            age = self._clock() - head.since
            if age <= self._max_age_seconds:
                return head
            self._drop_reply(head.message.reply_to, reason="stale", age_s=round(age, 3))
        return None

    def sent(self, kept: Kept) -> None:
        """`kept` (the head, from `next_fresh`) reached the world."""
        self._kept.popleft()
        self._forget_one(kept.message.reply_to)

    def drop_parts(self) -> int:
        """Drop every kept part (the new connection's world does not take them); return how many."""
        parts = [kept for kept in self._kept if isinstance(kept.message, SayPart)]
        if parts:
            self._kept = deque(kept for kept in self._kept if not isinstance(kept.message, SayPart))
            for kept in parts:
                self._forget_one(kept.message.reply_to)
        return len(parts)

    def _drop_reply(self, reply_to: str, *, reason: str, **fields: float) -> None:
        mine = [kept for kept in self._kept if kept.message.reply_to == reply_to]
        self._kept = deque(kept for kept in self._kept if kept.message.reply_to != reply_to)
        self._replies.pop(reply_to, None)
        parts = sum(isinstance(kept.message, SayPart) for kept in mine)
        for kept in mine:
            if isinstance(kept.message, Say):
                log.warning(
                    "world_say_dropped",
                    reason=reason,
                    npc=kept.message.npc_id,
                    reply_to=reply_to,
                    **({"parts": parts} if parts else {}),
                    **fields,
                )
        if parts and not any(isinstance(kept.message, Say) for kept in mine):
            log.warning("world_parts_dropped", reason=reason, reply_to=reply_to, parts=parts, **fields)

    def _forget_one(self, reply_to: str) -> None:
        left = self._replies.get(reply_to, 0) - 1
        if left > 0:
            self._replies[reply_to] = left
        else:
            self._replies.pop(reply_to, None)
