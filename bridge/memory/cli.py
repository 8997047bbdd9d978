"""`npc-bridge memory show|forget <npc-id>`: read or trim an NPC's memory file from the terminal."""

from __future__ import annotations

import sys
from collections.abc import Collection
from datetime import tzinfo

from bridge.errors import MemoryStoreError
from bridge.memory.models import MemoryFile
from bridge.memory.store import MemoryStore
from bridge.settings import Settings

PENDING_MARK = "[pending]"  # each pending line starts with it, so it is never read as a memory


def show_lines(memory: MemoryFile, zone: tzinfo | None) -> list[str]:
    """What `npc-bridge memory show <npc>` prints: memories numbered from 1, then pending lines."""
    lines = [f"{memory.npc_id}: {len(memory.memories)} memories"]
    for number, item in enumerate(memory.memories, start=1):
        local = item.heard_at.astimezone(zone)
        lines.append(f"{number:>3}. ({local:%Y-%m-%d %H:%M}) {item.text}  [{item.source}]")
    if memory.outbox:
        lines.append(f"waiting for the shared memory service: {len(memory.outbox)}")
        for waiting in memory.outbox:
            lines.append(f"     ({waiting.created_at.astimezone(zone):%Y-%m-%d %H:%M}) {waiting.text}")
    lines.append(
        f"pending conversation: {len(memory.pending)} lines (said, not yet extracted into memories;"
        f" `npc-bridge memory forget {memory.npc_id} --pending` clears them)"
    )
    for line in memory.pending:
        when = f"{line.at.astimezone(zone):%Y-%m-%d %H:%M}"
        if line.is_event:
            lines.append(f"  {PENDING_MARK} ({when}) npc (event): {line.npc}")
        else:
            lines.append(f"  {PENDING_MARK} ({when}) player: {line.player}")
            lines.append(f"  {'':{len(PENDING_MARK)}} {'':18} npc: {line.npc}")
    return lines


async def forget_by_number(store: MemoryStore, npc_id: str, number: int | None) -> int:
    """`npc-bridge memory forget <npc> [N]`: forget memory N as `show_lines` numbers it, or all."""
    return await store.forget(npc_id, None if number is None else number - 1)


def _known(npc_id: str, store: MemoryStore, characters: Collection[str]) -> bool:
    if npc_id not in characters and npc_id not in store.npc_ids_on_disk():
        print(f"npc-bridge: no character or memory file {npc_id!r}", file=sys.stderr)
        return False
    return True


async def show_memory(settings: Settings, npc_id: str, characters: Collection[str]) -> int:
    """`characters`: the ids of the characters folder (an NPC may have no file yet)."""
    store = MemoryStore(settings.memory_dir, limit=settings.memory_limit, keep_unwritten=False)
    if not _known(npc_id, store, characters):
        return 1
    for line in show_lines(await store.load(npc_id), settings.zone()):
        print(line)
    return 0


async def forget_memory(
    settings: Settings, npc_id: str, number: int | None, characters: Collection[str], *, pending: bool = False
) -> int:
    """`memory forget <npc> N | --all | --pending`: one memory, every memory, or the pending conversation."""
    store = MemoryStore(settings.memory_dir, limit=settings.memory_limit, keep_unwritten=False)
    if not _known(npc_id, store, characters):
        return 1
    try:
        if pending:
            lines = len((await store.load(npc_id)).pending)
            await store.clear_pending(npc_id, lines)
            print(f"{npc_id}: forgot the pending conversation ({lines} {'line' if lines == 1 else 'lines'})")
            return 0
        count = len((await store.load(npc_id)).memories)
        if number is not None and not 1 <= number <= count:
            print(f"npc-bridge: {npc_id} has no memory number {number} (it has {count})", file=sys.stderr)
            return 1
        forgotten = await forget_by_number(store, npc_id, number)
    except MemoryStoreError as exc:  # e.g. a read-only or full disk: the file is left as it was
        print(f"npc-bridge: {exc}", file=sys.stderr)
        return 1
    print(f"{npc_id}: forgot {forgotten} {'memory' if forgotten == 1 else 'memories'}")
    return 0
