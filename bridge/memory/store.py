"""Per-NPC memory files (memory.md "The file"): what the keeper and the commands change, and the atomic
write. The files in RAM, their writers and a failing disk are `bridge.memory.files`'s.

A write goes to a temporary file in the same folder, is flushed and fsynced, renamed over the file,
and the folder is fsynced, so the file on disk is always either the old or the new valid JSON; a
failed write removes its temporary file. The write takes one thread hop (`asyncio.to_thread`) for
the open, write, fsync, rename and folder fsync together: aiofiles would make each of those its own
hop, each a wake-up of the event loop that replies in flight wait behind.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path

import structlog

from bridge.errors import MemoryStoreError
from bridge.memory.active import IDLE_SECONDS
from bridge.memory.checks import Kept, apply_kept
from bridge.memory.files import DISK_RETRY_BASE_SECONDS, FILE_SUFFIX, MemoryFiles
from bridge.memory.models import NPC_ID_PATTERN, MemoryFile, OutboxItem, PendingLine
from bridge.memory.models import render as render  # the file format, also imported from here

log = structlog.get_logger(__name__)

TEMP_MARKER = ".tmp-"


def _write_atomically(path: Path, text: str, strays: list[Path]) -> None:
    """Temp file, fsync, rename over, fsync the folder: the file is whole, old or new, after a crash.

    A temporary file that cannot be removed after a failure (the folder went read-only meanwhile) is
    added to `strays`, for removal after the next write that goes through.
    """
    temp = path.with_name(f".{path.name}{TEMP_MARKER}{uuid.uuid4().hex}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
        _fsync_dir(path.parent)
    finally:
        try:
            os.remove(temp)
        except FileNotFoundError:
            pass
        except OSError:
            strays.append(temp)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MemoryStore:
    """Memory files of all NPCs under one folder; `limit` memories at most per NPC (oldest forgotten)."""

    def __init__(
        self,
        directory: Path,
        *,
        limit: int,
        keep_unwritten: bool = True,
        idle_seconds: float = IDLE_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
        retry_base_seconds: float = DISK_RETRY_BASE_SECONDS,
    ) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.directory = directory
        self.limit = limit
        self._files = MemoryFiles(
            directory,
            write=_write_atomically,
            keep_unwritten=keep_unwritten,
            idle_seconds=idle_seconds,
            monotonic=monotonic,
            retry_base_seconds=retry_base_seconds,
        )

    def path(self, npc_id: str) -> Path:
        return self._files.path(npc_id)

    def in_memory(self) -> list[str]:
        """Ids of the NPCs whose memory is held in RAM now."""
        return self._files.in_memory()

    # --- reading -------------------------------------------------------------------------------

    async def load(self, npc_id: str) -> MemoryFile:
        """The NPC's whole memory (empty when there is none yet), every change made so far included."""
        return await self._files.get(npc_id)

    def npc_ids_on_disk(self) -> list[str]:
        """Ids of every memory file in the folder (leftover temporary and corrupt files are skipped)."""
        if not self.directory.is_dir():
            return []
        return sorted(
            path.stem
            for path in self.directory.glob(f"*{FILE_SUFFIX}")
            if NPC_ID_PATTERN.fullmatch(path.stem) and path.is_file()
        )

    async def npc_ids_with_pending(self) -> list[str]:
        """NPCs whose file holds a conversation not yet extracted (scanned at start-up)."""
        return [memory.npc_id for memory in await self._load_all() if memory.pending]

    async def npc_ids_with_outbox(self) -> list[str]:
        """NPCs whose checked memories still wait for the shared service."""
        return [memory.npc_id for memory in await self._load_all() if memory.outbox]

    async def _load_all(self) -> list[MemoryFile]:
        loaded: list[MemoryFile] = []
        for npc_id in self.npc_ids_on_disk():
            try:
                loaded.append(await self.load(npc_id))
            except MemoryStoreError as exc:  # one broken file must not stop the others' start-up
                log.error("memory_file_unreadable", npc=npc_id, error=str(exc))
        return loaded

    # --- changing ------------------------------------------------------------------------------

    async def append_pending(self, npc_id: str, entry: PendingLine) -> None:
        """Note one exchange; on disk when this returns (while the disk takes writes)."""
        await self._files.change(npc_id, lambda f: f.model_copy(update={"pending": (*f.pending, entry)}))

    async def clear_pending(self, npc_id: str, count: int) -> None:
        """Drop the first `count` pending lines (those extracted); lines noted since then stay."""
        if count <= 0:
            return
        await self._files.change(npc_id, lambda f: f.model_copy(update={"pending": f.pending[count:]}))

    async def add_memories(self, npc_id: str, texts: Sequence[str], heard_at: datetime, source: str) -> None:
        """Append memories; past the limit the oldest are forgotten."""
        if texts:
            await self.record_extraction(npc_id, taken=0, texts=texts, heard_at=heard_at, source=source)

    async def record_extraction(
        self,
        npc_id: str,
        *,
        taken: int,
        texts: Sequence[str] = (),
        heard_at: datetime | None = None,
        source: str = "",
        outbox: Sequence[OutboxItem] = (),
        kept: Sequence[Kept] = (),
    ) -> None:
        """In one write: add the kept memories (or queue them in the outbox) and clear the first
        `taken` pending lines, so a crash cannot store memories yet keep the lines they came from.
        `texts` are new memories; `kept` may also refresh or replace stored ones (`apply_kept`)."""
        added = (*(Kept(text) for text in texts), *kept)
        if added and heard_at is None:
            raise ValueError("heard_at is required with texts")
        queued = tuple(outbox)
        if not added and not queued and taken <= 0:
            return

        def change(f: MemoryFile) -> MemoryFile:
            memories = apply_kept(f.memories, added, heard_at=heard_at, source=source) if heard_at else f.memories
            if len(memories) > self.limit:
                log.info("memory_forgotten", npc=npc_id, count=len(memories) - self.limit, reason="limit")
                memories = memories[-self.limit :]
            return f.model_copy(
                update={
                    "memories": memories,
                    "outbox": (*f.outbox, *queued),
                    "pending": f.pending[max(taken, 0) :],
                }
            )

        await self._files.change(npc_id, change)

    async def forget(self, npc_id: str, index: int | None) -> int:
        """Forget the memory at `index` (0-based), or all of them for None; returns how many went.

        Raises IndexError for an index out of range.
        """
        current = await self.load(npc_id)
        if index is not None and not 0 <= index < len(current.memories):
            raise IndexError(f"no memory number {index + 1} for {npc_id}")
        forgotten = len(current.memories) if index is None else 1

        def change(f: MemoryFile) -> MemoryFile:
            if index is None:
                return f.model_copy(update={"memories": ()})
            if index >= len(f.memories):  # shortened meanwhile by the limit: nothing left to forget
                return f
            return f.model_copy(update={"memories": (*f.memories[:index], *f.memories[index + 1 :])})

        await self._files.change(npc_id, change)
        return forgotten

    async def remove_outbox(self, npc_id: str, count: int) -> None:
        """Drop the first `count` outbox items (those the shared service took)."""
        if count > 0:
            await self._files.change(npc_id, lambda f: f.model_copy(update={"outbox": f.outbox[count:]}))

    async def flush(self, timeout_seconds: float) -> bool:
        """Wait (at most `timeout_seconds`) for writes in flight or waiting for the disk; True when
        every change is on disk."""
        return await self._files.flush(timeout_seconds)
