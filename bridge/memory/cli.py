"""`npc-bridge memory show|forget <npc-id>`: read or trim an NPC's memory file from the terminal."""

from __future__ import annotations

import sys

from bridge.memory.keeper import forget_by_number, show_lines
from bridge.memory.store import MemoryStore
from bridge.npc.characters import load_roster
from bridge.settings import Settings


def _known(settings: Settings, npc_id: str, store: MemoryStore) -> bool:
    roster = load_roster(settings.characters_dir)
    if roster.get(npc_id) is None and npc_id not in store.npc_ids_on_disk():
        print(f"npc-bridge: no character or memory file {npc_id!r}", file=sys.stderr)
        return False
    return True


async def show_memory(settings: Settings, npc_id: str) -> int:
    store = MemoryStore(settings.memory_dir, limit=settings.memory_limit)
    if not _known(settings, npc_id, store):
        return 1
    for line in show_lines(await store.load(npc_id), settings.zone()):
        print(line)
    return 0


async def forget_memory(settings: Settings, npc_id: str, number: int | None) -> int:
    store = MemoryStore(settings.memory_dir, limit=settings.memory_limit)
    if not _known(settings, npc_id, store):
        return 1
    count = len(await store.memories(npc_id))
    if number is not None and not 1 <= number <= count:
        print(f"npc-bridge: {npc_id} has no memory number {number} (it has {count})", file=sys.stderr)
        return 1
    forgotten = await forget_by_number(store, npc_id, number)
    print(f"{npc_id}: forgot {forgotten} {'memory' if forgotten == 1 else 'memories'}")
    return 0
