"""`npc-bridge chat <npc-id>`: talk to one character in the terminal, through the daemon's own path.

The same reply path as `npc-bridge run` (`bridge.npc.turns.ReplyPath`: recall, prompt, backend,
cleaning, checks, fallbacks, the pending conversation, extraction after silence); only the world is
replaced by the terminal. Useful for writing and tuning character files. The reply is printed
sentence by sentence as each is final and checked, as a world that offers `say-parts` shows it
(unless `NPC_BRIDGE_SAY_PARTS=off`: then whole). With `--explain`, each reply is preceded by the
memories its prompt holds and why each is there (one of the newest, or relevant with its score).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable, Sequence

from bridge import logs
from bridge.errors import ConfigError
from bridge.llm.factory import make_backend
from bridge.llm.gate import LLMGate
from bridge.memory.keeper import MemoryKeeper
from bridge.memory.recall import Recalled
from bridge.memory.shared import SharedMemoryClient
from bridge.memory.store import MemoryStore
from bridge.npc.characters import load_roster
from bridge.npc.conversation import Conversations
from bridge.npc.deadline import Deadline
from bridge.npc.parts import PartSink
from bridge.npc.prompt import format_memory_line, sanitize_player_text
from bridge.npc.responder import Responder
from bridge.npc.turns import ReplyPath, Turn
from bridge.settings import Settings
from bridge.speech import Emotion

PLAYER_ID = "terminal"
PLAYER_NAME = "あなた"
MATCHED_SHOWN = 5  # shared terms shown per relevant memory by --explain
FLUSH_SECONDS = 5.0  # at exit, for the memory file to take the last exchange


async def _read_line(prompt: str) -> str | None:
    def read() -> str | None:
        try:
            return input(prompt)
        except EOFError:
            return None

    return await asyncio.get_running_loop().run_in_executor(None, read)


def _explainer(explain: bool) -> Callable[[Sequence[Recalled]], None]:
    def show(recalled: Sequence[Recalled]) -> None:
        if explain:
            print("\n".join(explain_lines(recalled)), flush=True)

    return show


def _part_printer(name: str) -> PartSink:
    """Prints each part on the NPC's line as it comes."""

    async def show(index: int, text: str, emotion: Emotion) -> None:
        print(f"{name}: {text}" if index == 0 else text, end="", flush=True)

    return show


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
    printer = _part_printer(character.short_name) if settings.say_parts != "off" else None
    path = ReplyPath(
        responder=Responder(backend=backend, settings=settings, roster=roster),
        gate=gate,
        memory=keeper,
        conversations=Conversations(history_seconds=settings.history_minutes * 60),
    )
    keeper_task = asyncio.create_task(keeper.run(), name="memory")
    print(f"{character.name} ({character.id}) — empty line or Ctrl-D to leave", flush=True)
    try:
        while True:
            line = await _read_line("> ")
            if line is None or not line.strip():
                break
            keeper.touch(npc_id)
            started = time.monotonic()
            turn = Turn(
                character=character,
                player_id=PLAYER_ID,
                player_name=PLAYER_NAME,
                line=sanitize_player_text(line),
                deadline=Deadline.after(settings.reply_deadline_seconds, since=started),
            )
            reply = await path.answer(turn, parts=lambda: printer, on_recall=_explainer(explain))
            assert reply is not None  # chat never takes a line back
            elapsed = time.monotonic() - started
            if reply.parts:
                print(flush=True)  # ends the line the parts were printed on
            else:
                print(f"{character.short_name}: {reply.text}", flush=True)
            first = f", first sentence {reply.first_part_ms / 1000:.1f} s" if reply.first_part_ms is not None else ""
            print(f"    [{reply.emotion}, {reply.source}, {elapsed:.1f} s{first}]", flush=True)
            await path.note(turn, reply)()
    finally:
        # What was said goes to the memory file before leaving (a refused write gets one more try).
        await keeper.flush(FLUSH_SECONDS)
        keeper_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keeper_task
        await backend.aclose()
        if shared is not None:
            await shared.aclose()
    print("(the conversation is kept as pending memory; the daemon extracts it after its next start)", flush=True)
    return 0
