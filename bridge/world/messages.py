"""Typed messages exchanged with the world room (world-protocol.md), validated at the boundary."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from bridge.speech import Emotion, ReplySource

# Features a world may offer in `worker:claimed` that this bridge knows (world-protocol.md).
SAY_PARTS_FEATURE = "say-parts"


class _Incoming(BaseModel):
    # Unknown keys are ignored: the world may add fields without breaking the bridge.
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class Talk(_Incoming):
    """`npc:talk`: a player line addressed to one NPC."""

    id: str = Field(min_length=1)
    npc_id: str = Field(alias="npcId", min_length=1)
    player_id: str = Field(alias="playerId", min_length=1)
    player_name: str = Field(alias="playerName", default="")
    text: str
    at: float  # epoch milliseconds (arrives as a float from the server)


class NpcEvent(_Incoming):
    """`npc:event`: what the world's own routines just had the NPC say."""

    npc_id: str = Field(alias="npcId", min_length=1)
    player_id: str | None = Field(alias="playerId", default=None)
    kind: Literal["greet", "serve", "guide"]
    text: str
    at: float


class PlayerLeft(_Incoming):
    """`player:left`: the player's queued lines are dropped and their history ends."""

    player_id: str = Field(alias="playerId", min_length=1)
    at: float


class Denied(_Incoming):
    npc_id: str = Field(alias="npcId")
    reason: str = ""


class Claimed(_Incoming):
    """`worker:claimed`: which of the claimed NPCs the world granted."""

    npc_ids: list[str] = Field(alias="npcIds", default_factory=list)
    denied: list[Denied] = Field(default_factory=list)
    # Unknown entries are kept but ignored; no `features` means none (plain `npc:say` only).
    features: list[str] = Field(default_factory=list)


INCOMING_TYPES: dict[str, type[_Incoming]] = {
    "npc:talk": Talk,
    "npc:event": NpcEvent,
    "player:left": PlayerLeft,
    "worker:claimed": Claimed,
}


class _Outgoing(BaseModel):
    model_config = ConfigDict(populate_by_name=True, frozen=True)

    def payload(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)


class Say(_Outgoing):
    """`npc:say`: the cleaned line the NPC speaks."""

    npc_id: str = Field(alias="npcId")
    reply_to: str = Field(alias="replyTo")
    text: str = Field(min_length=1)
    emotion: Emotion = "neutral"
    source: ReplySource = "generated"

    type_name: Literal["npc:say"] = Field(default="npc:say", exclude=True)


class SayPart(_Outgoing):
    """`npc:say:part`: one final, checked sentence of a reply, sent before the whole line is done."""

    npc_id: str = Field(alias="npcId")
    reply_to: str = Field(alias="replyTo")
    index: int = Field(ge=0)
    text: str = Field(min_length=1)
    emotion: Emotion = "neutral"

    type_name: Literal["npc:say:part"] = Field(default="npc:say:part", exclude=True)


class Typing(_Outgoing):
    """`npc:typing`: the world may show a "…" bubble while `on` is true."""

    npc_id: str = Field(alias="npcId")
    reply_to: str = Field(alias="replyTo")
    on: bool

    type_name: Literal["npc:typing"] = Field(default="npc:typing", exclude=True)


class Claim(_Outgoing):
    """`worker:claim`: the NPCs whose talk the bridge takes over."""

    npc_ids: list[str] = Field(alias="npcIds")
    scope: Literal["talk"] = "talk"

    type_name: Literal["worker:claim"] = Field(default="worker:claim", exclude=True)
