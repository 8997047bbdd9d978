"""A dispatcher wired to a real loopback Ollama fake and a recorder standing in for the world link."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge.llm.gate import LLMGate
from bridge.llm.ollama import OllamaBackend
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.store import MemoryStore
from bridge.npc.characters import load_roster
from bridge.npc.conversation import Conversations
from bridge.npc.dispatcher import Dispatcher
from bridge.npc.responder import Responder
from bridge.settings import Settings, load_settings
from bridge.world.messages import Say, SayPart, Talk, Typing
from tests.fakes.llm_servers import FakeOllama

REPO = Path(__file__).resolve().parents[2]
_ids = itertools.count(1)


@dataclass
class Recorder:
    """Stands in for the world link's mouth."""

    says: list[Say] = field(default_factory=list)
    said_at: list[float] = field(default_factory=list)
    typings: list[Typing] = field(default_factory=list)
    said: asyncio.Event = field(default_factory=asyncio.Event)
    parts_wanted: bool = False
    parts: list[SayPart] = field(default_factory=list)
    part_at: list[float] = field(default_factory=list)
    # Everything said, in order: ("part", SayPart) or ("say", Say).
    spoken: list[tuple[str, SayPart | Say]] = field(default_factory=list)

    async def say(self, message: Say) -> None:
        self.says.append(message)
        self.spoken.append(("say", message))
        self.said_at.append(time.monotonic())
        self.said.set()

    async def say_part(self, message: SayPart) -> None:
        self.parts.append(message)
        self.part_at.append(time.monotonic())
        self.spoken.append(("part", message))

    async def typing(self, message: Typing) -> None:
        self.typings.append(message)

    async def wait_says(self, count: int, within: float = 10.0) -> list[Say]:
        async with asyncio.timeout(within):
            while len(self.says) < count:
                self.said.clear()
                await self.said.wait()
        return self.says


def talk(npc: str, player: str, text: str, name: str = "旅人1") -> Talk:
    return Talk(
        id=f"evt-{next(_ids)}", npcId=npc, playerId=player, playerName=name, text=text, at=time.time() * 1000
    )


@dataclass
class Rig:
    dispatcher: Dispatcher
    world: Recorder
    server: FakeOllama
    gate: LLMGate
    settings: Settings
    memory_dir: Path


@asynccontextmanager
async def dispatcher_rig(memory_dir: Path, **overrides: Any) -> AsyncIterator[Rig]:
    """A running dispatcher; `overrides`: deadline, concurrency, parts (the world wants parts), banned."""
    async with FakeOllama() as server:
        settings = load_settings(
            llm_url=server.url,
            characters_dir=REPO / "characters",
            memory_dir=memory_dir,
            memory_silence_seconds=3600,
            reply_deadline_seconds=overrides.get("deadline", 10.0),
            llm_concurrency=overrides.get("concurrency", 1),
            banned_words=overrides.get("banned", ()),
        )
        roster = load_roster(settings.characters_dir)
        backend = OllamaBackend(server.url)
        gate = LLMGate(settings.llm_concurrency)
        keeper = MemoryKeeper(
            store=MemoryStore(memory_dir, limit=60),
            backend=backend,
            gate=gate,
            roster=roster,
            settings=settings,
            shared=None,
        )
        world = Recorder(parts_wanted=overrides.get("parts", False))
        dispatcher = Dispatcher(
            roster=roster,
            speaker=world,
            responder=Responder(backend=backend, settings=settings, roster=roster),
            gate=gate,
            memory=keeper,
            conversations=Conversations(history_seconds=1800),
            reply_deadline_seconds=settings.reply_deadline_seconds,
        )
        task = asyncio.create_task(dispatcher.run())
        try:
            yield Rig(dispatcher, world, server, gate, settings, memory_dir)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await backend.aclose()
