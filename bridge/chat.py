"""`npc-bridge chat <npc-id>`: talk to one character in the terminal, through the daemon's own path.

Same prompt, backend, cleaning, checks, fallbacks and memory (recall, pending lines, extraction after
silence) as `npc-bridge run`; only the world is replaced by the terminal. Useful for writing and
tuning character files; with `--explain`, each reply is preceded by the memories its prompt holds and
why each is there (one of the newest, or relevant with its score).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime

from bridge import logs
from bridge.errors import ConfigError
from bridge.llm.factory import make_backend
from bridge.llm.gate import LLMGate, Priority
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.recall import Recalled
from bridge.memory.shared import SharedMemoryClient
from bridge.memory.store import MemoryStore
from bridge.npc.characters import load_roster
from bridge.npc.conversation import Conversations
from bridge.npc.prompt import Exchange, format_memory_line, sanitize_player_text
from bridge.npc.responder import ReplyContext, Responder
from bridge.settings import Settings

PLAYER_ID = "terminal"
PLAYER_NAME = "あなた"
MATCHED_SHOWN = 5  # shared terms shown per relevant memory by --explain


async def _read_line(prompt: str) -> str | None:
    def read() -> str | None:
        try:
            return input(prompt)
        except EOFError:
            return None

    return await asyncio.get_running_loop().run_in_executor(None, read)


def explain_lines(recalled: Sequence[Recalled]) -> list[str]:
    """`--explain`: the memories in this prompt, as the prompt orders them, each with why it is there
    (one of the newest, or relevant with its score and the terms it shares with the line)."""
    if not recalled:
        return ["    [memory] none recalled"]
    lines = []
    for item in recalled:
        if item.why == "recent":
            why = "recent"
        else:  # a shared-memory character's items come scored by the service, not here
            why = f"relevant {item.score:.2f}" if item.score else "relevant (memory service)"
        if item.matched:
            why += " (" + " ".join(item.matched[:MATCHED_SHOWN]) + ")"
        lines.append(f"    [memory] {format_memory_line(item.text, item.heard_at)}   <- {why}")
    return lines


async def run_chat(settings: Settings, npc_id: str, *, explain: bool = False) -> int:
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
            history = conversations.history(npc_id, PLAYER_ID)
            recalled = await keeper.recall(npc_id, query=text, previous=history[-1].player if history else None)
            if explain:
                print("\n".join(explain_lines(recalled)), flush=True)
            context = ReplyContext(
                character=character,
                player_line=text,
                player_name=PLAYER_NAME,
                memories=recalled,
                history=history,
                last_said=conversations.last_said(npc_id, PLAYER_ID),
            )
            async with gate.slot(Priority.REPLY):
                deadline = asyncio.get_running_loop().time() + settings.reply_deadline_seconds
                reply = await responder.respond(context, deadline=deadline)
            elapsed = time.monotonic() - started
            print(f"{character.short_name}: {reply.text}", flush=True)
            print(f"    [{reply.emotion}, {reply.source}, {elapsed:.1f} s]", flush=True)
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
