"""Claiming NPCs: `worker:claim` in frames that fit, and what one connection was granted.

Colyseus closes a client whose frame is over 4096 bytes (1009), so a long roster is claimed in as
many messages as it takes, each at most `CLAIM_FRAME_BYTES`; the world answers each one, and the
answers of one connection are merged (granted ids, denials, features). A reconnect starts afresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgpack

from bridge.world import codec
from bridge.world.messages import Claim, Claimed

__all__ = ["CLAIM_FRAME_BYTES", "ClaimAnswer", "Claims", "claim_chunks"]

# Well under the server's 4096-byte limit on client frames.
CLAIM_FRAME_BYTES = 2048
# The id list's msgpack header grows from 1 byte (fixarray) to 3 (array16) past 15 ids.
_ARRAY_HEADER_SLACK = 2


def claim_chunks(npc_ids: Iterable[str], max_frame_bytes: int = CLAIM_FRAME_BYTES) -> tuple[list[Claim], list[str]]:
    """`worker:claim` messages for `npc_ids` in order, each frame at most `max_frame_bytes`.

    Returns the claims and the ids too long to fit in any frame (never sent).
    """
    empty = Claim(npc_ids=[])
    overhead = len(codec.encode_room_data(empty.type_name, empty.payload())) + _ARRAY_HEADER_SLACK
    chunks: list[list[str]] = []
    too_long: list[str] = []
    current: list[str] = []
    size = overhead
    for npc_id in npc_ids:
        cost = len(msgpack.packb(npc_id, use_bin_type=True))
        if overhead + cost > max_frame_bytes:
            too_long.append(npc_id)
            continue
        if size + cost > max_frame_bytes:
            chunks.append(current)
            current, size = [], overhead
        current.append(npc_id)
        size += cost
    if current:
        chunks.append(current)
    return [Claim(npc_ids=chunk) for chunk in chunks], too_long


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    """One `worker:claimed` answer as this connection reads it."""

    granted: list[str]  # newly granted ids that were asked on this connection
    unasked: list[str]  # granted ids the bridge never asked for (ignored)


@dataclass(slots=True)
class Claims:
    """What one connection asked for and was granted; answers merge, they never replace."""

    asked: set[str] = field(default_factory=set)
    granted: set[str] = field(default_factory=set)
    features: set[str] = field(default_factory=set)
    unanswered: int = 0
    answered: asyncio.Event = field(default_factory=asyncio.Event)

    def to_ask(self, npc_ids: Sequence[str]) -> list[str]:
        """The ids not yet asked for on this connection, in order."""
        return [npc_id for npc_id in dict.fromkeys(npc_ids) if npc_id not in self.asked]

    def sent(self, claim: Claim) -> None:
        self.asked.update(claim.npc_ids)
        self.unanswered += 1
        self.answered.clear()

    def answer(self, claimed: Claimed) -> ClaimAnswer:
        granted = [npc_id for npc_id in dict.fromkeys(claimed.npc_ids) if npc_id in self.asked]
        unasked = sorted(set(claimed.npc_ids) - self.asked)
        fresh = [npc_id for npc_id in granted if npc_id not in self.granted]
        self.granted.update(granted)
        self.features.update(claimed.features)
        self.unanswered = max(0, self.unanswered - 1)
        if self.unanswered == 0:
            self.answered.set()
        return ClaimAnswer(granted=fresh, unasked=unasked)
