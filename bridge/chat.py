"""`npc-bridge chat <npc-id>`: talk to one character in the terminal, through the daemon's own path.

Same prompt, backend, cleaning, checks, fallbacks and memory (recall, pending lines, extraction after
silence) as `npc-bridge run`; only the world is replaced by the terminal. Useful for writing and
tuning character files. The reply is printed sentence by sentence as each is final and checked,
as a world that offers `say-parts` shows it (unless `NPC_BRIDGE_SAY_PARTS=off`: then whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from datetime import UTC, datetime

from bridge import logs
from bridge.errors import ConfigError
from bridge.llm.factory import make_backend
from bridge.llm.gate import LLMGate, Priority
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.shared import SharedMemoryClient
from bridge.memory.store import MemoryStore
from bridge.npc.characters import load_roster
from bridge.npc.conversation import Conversations
from bridge.npc.deadline import Deadline
from bridge.npc.prompt import Exchange, sanitize_player_text
from bridge.npc.responder import PartSink, ReplyContext, Responder
from bridge.settings import Settings
from bridge.speech import Emotion

PLAYER_ID = "terminal"
PLAYER_NAME = "あなた"


async def _read_line(prompt: str) -> str | None:
    def read() -> str | None:
        try:
            return input(prompt)
        except EOFError:
            return None

    return await asyncio.get_running_loop().run_in_executor(None, read)


def _part_printer(name: str) -> PartSink:
    """Prints each part on the NPC's line as it comes."""

    async def show(index: int, text: str, emotion: Emotion) -> None:
        print(f"{name}: {text}" if index == 0 else text, end="", flush=True)

    return show


async def run_chat(settings: Settings, npc_id: str) -> int:
    roster = load_roster(settings.characters_dir)
    character = roster.get(npc_id)
    if character is None:
        have = ", ".join(roster.characters)
        raise ConfigError(f"no character {npc_id!r} in {settings.characters_dir} (have: {have})")
    # Logs go to stderr so the conversation on stdout stays readable.
    logs.configure(fmt="console", level=settings.log_level, log_content=settings.log_content, stream=sys.stderr)
    backend = make_backend(settings)
    gate = LLMGate(settings.llm_concurrency)
    shared = SharedMemoryClient(settings.shared_memory_url) if settings.shared_memory_url else None
    keeper = MemoryKeeper(
        store=MemoryStore(settings.memory_dir, limit=settings.memory_limit),
        backend=backend,
        gate=gate,
        roster=roster,
        settings=settings,
        shared=shared,
    )
    responder = Responder(backend=backend, settings=settings, roster=roster)
    conversations = Conversations(history_seconds=settings.history_minutes * 60)
    keeper_task = asyncio.create_task(keeper.run(), name="memory")
    print(f"{character.name} ({character.id}) — empty line or Ctrl-D to leave", flush=True)
    try:
        while True:
            line = await _read_line("> ")
            if line is None or not line.strip():
                break
            text = sanitize_player_text(line)
            keeper.touch(npc_id)
            started = time.monotonic()
            deadline = Deadline.after(settings.reply_deadline_seconds, since=started)
            context = ReplyContext(
                character=character,
                player_line=text,
                player_name=PLAYER_NAME,
                memories=await keeper.recall(npc_id, query=text),
                history=conversations.history(npc_id, PLAYER_ID),
                last_said=conversations.last_said(npc_id, PLAYER_ID),
            )
            on_part = _part_printer(character.short_name) if settings.say_parts != "off" else None
            async with gate.slot(Priority.REPLY):
                reply = await responder.respond(context, deadline=deadline, on_part=on_part)
            elapsed = time.monotonic() - started
            if reply.parts:
                print(flush=True)  # ends the line the parts were printed on
            else:
                print(f"{character.short_name}: {reply.text}", flush=True)
            first = f", first sentence {reply.first_part_ms / 1000:.1f} s" if reply.first_part_ms is not None else ""
            print(f"    [{reply.emotion}, {reply.source}, {elapsed:.1f} s{first}]", flush=True)
            conversations.record(npc_id, PLAYER_ID, Exchange(player=text, npc=reply.text))
            now = datetime.now(UTC)
            await keeper.note_exchange(npc_id, player=text, npc=reply.text, at=now)
            if reply.memory_lines:
                await keeper.save_inline(npc_id, reply.memory_lines, at=now)
    finally:
        keeper_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper_task
        await backend.aclose()
        if shared is not None:
            await shared.aclose()
    print("(the conversation is kept as pending memory; the daemon extracts it after its next start)", flush=True)
    return 0
