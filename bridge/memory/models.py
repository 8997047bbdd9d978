"""The memory file of one NPC (`<memory dir>/<npc id>.json`, memory.md "The file").

Choices where memory.md is silent:
- An `npc:event` line the world had the NPC say to a player is a pending line with an empty `player`
  (`{"player": "", "npc": "<event text>", "at": "…"}`): the documented keys stay the only keys, and an
  exchange always has a player line, so the empty one cannot be mistaken for one.
- A character with `memory.backend: "shared"` keeps its checked memories in an extra `outbox` list
  (`[{"text", "created_at", "source"}]`) until the shared service has taken them; the key is written
  only while it holds something, so a file-backend character's file is exactly the documented shape.
- Times are written as ISO 8601 with their offset, to the second (`2026-09-29T21:14:03+09:00`); a time
  read without an offset is refused (the file is then treated as unreadable).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_serializer

NPC_ID_PATTERN = re.compile(r"^[a-z0-9-]+$")  # characters.md: also keeps ids safe as file names

SOURCE_EXTRACTION = "extraction"
SOURCE_INLINE = "inline"


def iso_seconds(moment: datetime) -> str:
    """ISO 8601 with the offset, to the second: how every time in a memory file is written."""
    return moment.isoformat(timespec="seconds")


class _Model(BaseModel):
    # Frozen: the store replaces whole values, so a half-applied change can never reach the cache.
    model_config = ConfigDict(frozen=True, extra="ignore")


class _Item(_Model):
    """A list item of the file, kept as its own line of JSON."""

    @functools.cached_property
    def json_line(self) -> str:
        """The item as one line of JSON, built once: the file is rewritten on every reply, and
        re-serialising 60 memories and the pending lines each time is event-loop time on every reply
        (tests/perf/README.md has the measure).
        (A cached property: pydantic leaves it out of fields, dumps and equality.)"""
        return json.dumps(self.model_dump(mode="json"), ensure_ascii=False)


class Memory(_Item):
    text: str = Field(min_length=1)
    heard_at: AwareDatetime
    source: str = SOURCE_EXTRACTION

    @field_serializer("heard_at")
    def _dump_time(self, value: datetime) -> str:
        return iso_seconds(value)


class PendingLine(_Item):
    """One noted exchange: the player's line and the NPC's reply (`player == ""` for an npc:event)."""

    player: str = ""
    npc: str = ""
    at: AwareDatetime

    @property
    def is_event(self) -> bool:
        return self.player == ""

    @field_serializer("at")
    def _dump_time(self, value: datetime) -> str:
        return iso_seconds(value)


class OutboxItem(_Item):
    """A checked memory of a shared-memory character, waiting for the shared service to take it."""

    text: str = Field(min_length=1)
    created_at: AwareDatetime
    source: str

    @field_serializer("created_at")
    def _dump_time(self, value: datetime) -> str:
        return iso_seconds(value)


class MemoryFile(_Model):
    version: Literal[1] = 1
    npc_id: str = Field(pattern=NPC_ID_PATTERN.pattern)
    memories: tuple[Memory, ...] = ()
    pending: tuple[PendingLine, ...] = ()
    outbox: tuple[OutboxItem, ...] = ()

    @classmethod
    def empty(cls, npc_id: str) -> MemoryFile:
        return cls(npc_id=npc_id)


def render(content: MemoryFile) -> str:
    """The file's text: one key a line, and one list item (a memory, a pending line) a line.

    As readable as `indent=2` for a person who opens the file, and cheap to rewrite: each item's line
    is serialised once and kept with it (`json.dumps(..., indent=2)` of the whole file ran the
    pure-Python encoder on the event loop at every write; tests/perf/README.md has the measure).
    `outbox` is written only while it holds something.
    """
    fields: list[tuple[str, str | tuple[str, ...]]] = [
        ("version", json.dumps(content.version)),
        ("npc_id", json.dumps(content.npc_id, ensure_ascii=False)),
        ("memories", tuple(item.json_line for item in content.memories)),
        ("pending", tuple(item.json_line for item in content.pending)),
    ]
    if content.outbox:
        fields.append(("outbox", tuple(item.json_line for item in content.outbox)))
    lines = ["{"]
    for number, (key, value) in enumerate(fields):
        comma = "," if number < len(fields) - 1 else ""
        if isinstance(value, str):
            lines.append(f'  "{key}": {value}{comma}')
        elif value:
            items = ",\n".join(f"    {item}" for item in value)
            lines.append(f'  "{key}": [\n{items}\n  ]{comma}')
        else:
            lines.append(f'  "{key}": []{comma}')
    lines.append("}")
    return "\n".join(lines) + "\n"
